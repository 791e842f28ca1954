"""One worker process per rank, forked from a server that imported its modules once (rank_start.py); each step is pickled once and sent down a pipe to every rank.

Each worker owns its device, its model (its shard) and its KV pool. The engine's process keeps the
scheduler, tokenizer and grammars. A worker that exits is noticed at once (its process sentinel), by
the step waiting on it and by a monitor thread when no step runs, so nothing waits on a dead rank; a step
that takes longer than `worker_step_timeout` fails the executor as hung (a rank stopped, or stuck in a
collective). Either way the engine may replace the whole group (LLMEngine.replace_workers).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import pickle
import threading
import time
from multiprocessing import connection
from typing import Iterable, Optional

from tokenmill.config import ParallelConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor, ExecutorDiedError, WorkerStepError
from tokenmill.executor.rank_start import Surroundings, rank_context
from tokenmill.executor.worker_process import (CallDone, StepDone, WorkerCall, WorkerFailed, WorkerMessage,
                                              WorkerReady, worker_main)
from tokenmill.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)

# How long a stopping worker gets to exit by itself before it is terminated, then killed.
_STOP_GRACE_SECONDS = 5.0
# how long a rank's failed step waits for a peer's exit to show before the rank's own failure is reported: a peer
# killed mid-step breaks the others' collectives while its process is still being reaped
PEER_EXIT_GRACE_S = 2.0


class MultiprocExecutor(Executor):
    """Spawns `spec.world_size` worker processes and runs each step on all of them.

    Invariant: every rank receives every step, in order, over its own pipe; only the driver (the first
    tensor-parallel rank of the last pipeline stage) answers with the step's output, so a step costs one
    pickle of the step and one of the output. Up to one step per pipeline stage is in flight: each rank
    runs its steps in the order sent, and the driver answers them in that order.
    """

    def __init__(self, spec: WorkerSpec, parallel: ParallelConfig) -> None:
        context = rank_context()
        world_size = spec.world_size
        self.driver = spec.driver_rank
        self.max_steps_in_flight = spec.pp_size
        self.step_timeout = parallel.worker_step_timeout or None
        self.multi_node = parallel.nnodes > 1
        self._num_in_flight = 0
        # Held while a step is sent or its answer received, so the monitor sees a quiet connection only
        # when no step is in flight (see _watch).
        self._step_lock = threading.Lock()
        key = None
        if parallel.nnodes > 1:
            from tokenmill.envs import distributed_key

            key = distributed_key()  # before any worker starts
            rendezvous = f"tcp://{parallel.master_addr}:{parallel.master_port}"
        else:
            rendezvous = spec.init_method or f"tcp://127.0.0.1:{_free_port()}"
        if world_size > 1:
            spec = dataclasses.replace(spec, init_method=rendezvous, nnodes=parallel.nnodes,
                                       timeout=parallel.distributed_timeout)
        self._failure: Optional[str] = None
        self._stopping = False
        self.processes: list = []  # this host's workers: ranks 0 .. ranks_per_node - 1
        self.pipes: list = [None] * world_size  # every rank's connection, local (pipe) or remote (socket)
        for rank in range(spec.ranks_per_node):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_main, name=f"tokenmill-worker-{rank}", daemon=True,
                                      args=(dataclasses.replace(spec, rank=rank), theirs,
                                            logging.getLogger().getEffectiveLevel(), Surroundings.now()))
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes[rank] = ours
        try:
            if key is not None:
                from tokenmill.executor.nodes import accept_remote_ranks

                accept_remote_ranks(spec, parallel, key, self.pipes)
            readies = [self._receive(rank, [rank]) for rank in range(world_size)]
        except BaseException:
            self.shutdown()
            raise
        if not all(isinstance(ready, WorkerReady) for ready in readies):
            raise ExecutorDiedError(f"a worker answered its start with {readies}")
        descriptions = [ready.description for ready in readies]
        # every rank's pool holds at least this many blocks (each sizes its own from GPU memory when asked)
        self.num_blocks = min(ready.num_blocks for ready in readies)
        self.rank_descriptions = descriptions  # each rank's own (its shard: e.g. its experts)
        self.description = f"{descriptions[0]}; {world_size} worker process{'es' if world_size > 1 else ''}"
        if parallel.nnodes > 1:
            self.description += f" on {parallel.nnodes} nodes"
        self._monitor = threading.Thread(target=self._watch, name="tokenmill-worker-monitor", daemon=True)
        self._monitor.start()
        # at exit, stop the workers ourselves: multiprocessing's own handler would SIGTERM them first
        # (atexit runs handlers last-registered first), which the monitor would report as a failure
        atexit.register(self.shutdown)

    def submit(self, schedule: SchedulerOutput) -> None:
        """Send the step to every rank."""
        if self._failure is not None:
            raise ExecutorDiedError(self._failure)
        if self._num_in_flight >= self.max_steps_in_flight:
            raise RuntimeError(f"more than {self.max_steps_in_flight} steps submitted before one was collected")
        payload = pickle.dumps(schedule, protocol=pickle.HIGHEST_PROTOCOL)
        with self._step_lock:
            self._num_in_flight += 1
            for rank, pipe in enumerate(self.pipes):
                try:
                    pipe.send_bytes(payload)
                except OSError as exc:
                    raise ExecutorDiedError(self._died(rank, f"its pipe broke ({exc})")) from exc

    def collect(self) -> ModelRunnerOutput:
        """The driver's output of the oldest step in flight."""
        if self._num_in_flight == 0:
            raise RuntimeError("collect() with no step in flight")
        if self._failure is not None:  # (a hung group would keep the caller another timeout)
            self._num_in_flight -= 1
            raise ExecutorDiedError(self._failure)
        with self._step_lock:
            try:
                done = self._receive(self.driver, range(len(self.pipes)), self.step_timeout)
                assert isinstance(done, StepDone), f"a worker answered a step with {type(done).__name__}"
                return done.output
            finally:
                self._num_in_flight -= 1

    def call(self, name: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """Worker.control on every rank, with no step in flight; each rank's answer within the step timeout (a
        group that does not answer has failed, as for a step). ValueError (a rank refused: the first one's
        message) or RuntimeError (a rank raised) when one did not answer with a result; the ranks serve on."""
        if self._failure is not None:
            raise ExecutorDiedError(self._failure)
        if self._num_in_flight:
            raise RuntimeError(f"a control call ({name}) with a step in flight")
        payload = pickle.dumps(WorkerCall(name, tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
        with self._step_lock:
            for rank, pipe in enumerate(self.pipes):
                try:
                    pipe.send_bytes(payload)
                except OSError as exc:
                    raise ExecutorDiedError(self._died(rank, f"its pipe broke ({exc})")) from exc
            answers = []
            for rank in range(len(self.pipes)):
                answer = self._receive(rank, (rank,), self.step_timeout)  # (the others' answers wait in their pipes)
                assert isinstance(answer, CallDone), f"a worker answered a call with {type(answer).__name__}"
                answers.append(answer)
        for rank, answer in enumerate(answers):
            if answer.problem is not None:
                raise (ValueError if answer.refused else RuntimeError)(
                    answer.problem if answer.refused else f"{name} failed on rank {rank}: {answer.problem}")
        return [answer.result for answer in answers]

    def _receive(self, rank: int, listening: Iterable[int], timeout: Optional[float] = None) -> WorkerMessage:
        """The next answer of `rank`, while watching the `listening` ranks' pipes (the others speak only
        to report a failed step) and every worker's sentinel. A step that fails on one rank of several
        leaves the ranks out of step (some may wait in a collective): the executor is then failed too, as it
        is when no answer comes within `timeout` seconds (None: no limit)."""
        pipes = {self.pipes[r]: r for r in listening}
        sentinels = {process.sentinel: r for r, process in enumerate(self.processes)}
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait([*pipes, *sentinels], timeout=left)
            if not ready:
                stopped = [r for r, p in enumerate(self.processes) if _stopped(p.pid)]
                how = f" (stopped: rank {', '.join(map(str, stopped))})" if stopped else ""
                self._failure = self._failure or (f"a step had no answer within {timeout:g} s (--worker-step-timeout): "
                                                  f"the worker group hangs{how}")
                raise ExecutorDiedError(self._failure)
            for pipe in (p for p in ready if p in pipes):
                speaker = pipes[pipe]
                try:
                    message = pickle.loads(pipe.recv_bytes())
                except (EOFError, OSError) as exc:
                    raise ExecutorDiedError(self._died(speaker, f"its pipe closed ({exc})")) from exc
                if isinstance(message, WorkerFailed):
                    failed = f"worker rank {speaker} failed: {message.reason}"
                    if len(self.pipes) > 1:
                        dead = self._dead_peer(speaker)
                        if dead is not None:  # its collective broke because that peer died: name the peer
                            raise ExecutorDiedError(self._died(dead, f"it exited{self._last_words(dead)}; then "
                                                                     f"{failed}"))
                        self._failure = self._failure or failed
                        raise ExecutorDiedError(failed)
                    raise WorkerStepError(failed)
                if speaker == rank:
                    return message
            for sentinel in (s for s in ready if s in sentinels):
                gone = sentinels[sentinel]
                raise ExecutorDiedError(self._died(gone, f"it exited{self._last_words(gone)}"))

    def _dead_peer(self, rank: int) -> Optional[int]:
        """A local rank other than `rank` that has exited or exits within PEER_EXIT_GRACE_S, else None. A rank whose
        collective fails because a peer was killed often reports before the peer's exit is seen."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.processes) if r != rank}
        ready = connection.wait(list(sentinels), timeout=PEER_EXIT_GRACE_S)
        return min((sentinels[s] for s in ready), default=None)

    def _last_words(self, rank: int) -> str:
        """The error a worker sent before exiting (a failed start), if any is waiting in its pipe."""
        pipe = self.pipes[rank]
        try:
            if pipe.poll():
                message = pickle.loads(pipe.recv_bytes())
                if isinstance(message, WorkerFailed):
                    return f" after reporting: {message.reason}"
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        return ""

    def _died(self, rank: int, how: str) -> str:
        if rank < len(self.processes):
            process = self.processes[rank]
            process.join(timeout=0.1)
            reason = (f"worker rank {rank} (pid {process.pid}) is gone: {how}"
                      f"{'' if process.exitcode is None else f', exit code {process.exitcode}'}")
        else:
            reason = f"worker rank {rank} (on another node) is gone: {how}"
        if self._failure is None:
            self._failure = reason
        return self._failure

    def _watch(self) -> None:
        """Report a worker that goes away while no step runs. A local one: its process sentinel. One on
        another node: its connection turns readable while no step is in flight (such a worker speaks
        only to answer a step), which is its end of file."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        remote = {self.pipes[rank]: rank for rank in range(len(self.processes), len(self.pipes))}
        while True:
            try:
                ready = connection.wait([*sentinels, *remote], timeout=1.0 if remote else None)
            except (OSError, ValueError):  # a connection closed by shutdown()
                ready = []
            if self._stopping or self._failure is not None:
                return
            gone = [sentinels[s] for s in ready if s in sentinels]
            if gone:
                logger.error("%s", self._died(gone[0], "it exited"))
                return
            for pipe in (p for p in ready if p in remote):
                with self._step_lock:
                    if self._num_in_flight == 0 and not self._stopping and pipe.poll():
                        logger.error("%s", self._died(remote[pipe], "its connection closed"))
                        return
            if ready:
                time.sleep(0.05)  # an answer waiting for collect(): let it be read

    def failure(self) -> Optional[str]:
        """Why a worker is gone, or None while all run."""
        return self._failure

    def replacement_refused(self) -> Optional[str]:
        """None on one node; ranks on other nodes would have to start again too."""
        if self.multi_node:
            return "the ranks on the other nodes would have to start again too: a multi-node group is not replaced"
        return None

    def shutdown(self, grace: Optional[float] = None) -> None:
        """Ask every worker to stop, then terminate and kill what is left, each step given `grace` seconds
        (default _STOP_GRACE_SECONDS; idempotent). A failed group being replaced gets a short grace: a hung rank
        never stops by itself."""
        grace = _STOP_GRACE_SECONDS if grace is None else grace
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        for pipe in (p for p in self.pipes if p is not None):
            try:
                pipe.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=grace)
            if process.is_alive():
                process.terminate()
                process.join(timeout=grace)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in (p for p in self.pipes if p is not None):
            pipe.close()


def _stopped(pid: Optional[int]) -> bool:
    """Whether the process is stopped (SIGSTOP; Linux's /proc says so; False where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _free_port() -> int:
    """A TCP port free on this host right now, for a single-host rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
