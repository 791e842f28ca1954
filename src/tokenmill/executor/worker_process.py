"""A worker process's side of the multiprocess executor: build the rank, then run the steps that arrive.

The same loop serves a rank on the engine's host (multiproc.py starts it over a pipe) and one on
another node (nodes.py, over an authenticated socket). A worker answers with the typed messages below,
pickled, never with bare tuples.
"""

from __future__ import annotations

import logging
import pickle
import threading
import traceback
from dataclasses import dataclass
from multiprocessing import connection
from typing import Callable, Optional, Union

from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.executor.rank_start import Surroundings
from tokenmill.worker.worker import WorkerSpec


@dataclass(frozen=True)
class WorkerReady:
    """The rank is built: its description (its shard) and the KV blocks its pool holds."""

    description: str
    num_blocks: int


@dataclass(frozen=True)
class WorkerFailed:
    """The rank could not start, or a step failed on it (the worker lives on after a failed step)."""

    reason: str


@dataclass(frozen=True)
class StepDone:
    """The driver rank's output of one step (the other ranks answer only failures)."""

    output: ModelRunnerOutput


@dataclass(frozen=True)
class WorkerCall:
    """The engine asks every rank, between steps, for Worker.control(name, *args, **kwargs)."""

    name: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class CallDone:
    """A rank's answer to a WorkerCall: its result, or what it raised (`problem`: a ValueError's message when
    `refused`, else the traceback); either way the rank serves on."""

    result: object = None
    problem: Optional[str] = None
    refused: bool = False


WorkerMessage = Union[WorkerReady, WorkerFailed, StepDone, CallDone]


def worker_main(spec: WorkerSpec, pipe: connection.Connection, log_level: int,
                surroundings: Optional[Surroundings] = None) -> None:
    """A worker process: take on the engine's `surroundings` (a rank started by rank_start's context), build
    the rank, say ready (or why not), then run steps until told to stop or until the engine's end of the pipe
    closes (the engine is gone)."""
    import signal

    if surroundings is not None:
        surroundings.enter()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the engine, which then stops us
    logging.basicConfig(level=log_level, format=f"%(asctime)s [worker {spec.rank}] %(levelname)s %(name)s: %(message)s")
    from tokenmill.worker.worker import Worker

    try:
        worker = Worker(spec)
    except BaseException as exc:
        _send(pipe, WorkerFailed(f"{type(exc).__name__}: {exc}"))
        return
    _send(pipe, WorkerReady(worker.description, worker.num_blocks))
    receive = _pipe_reader(pipe) if spec.pp_size > 1 else pipe.recv_bytes
    while True:
        try:
            schedule = pickle.loads(receive())
        except (EOFError, OSError):
            return
        if schedule is None:
            return
        if isinstance(schedule, WorkerCall):
            try:
                _send(pipe, CallDone(worker.control(schedule.name, schedule.args, schedule.kwargs)))
            except Exception as exc:
                refused = isinstance(exc, ValueError)
                _send(pipe, CallDone(problem=str(exc) if refused else traceback.format_exc(), refused=refused))
            continue
        try:
            output = worker.execute(schedule)
        except Exception:
            _send(pipe, WorkerFailed(traceback.format_exc()))
            continue
        if spec.rank == spec.driver_rank:
            _send(pipe, StepDone(output))


def _pipe_reader(pipe: connection.Connection) -> Callable[[], bytes]:
    """A `recv_bytes` served by a thread that drains the pipe as steps arrive.

    With steps in flight the engine may write a step to a rank that is blocked handing activations to a
    stage that is itself blocked answering the engine; reading the pipe off the compute thread keeps
    such a cycle from ever closing. The queue is bounded by the engine: at most one step per stage is
    in flight, plus the stop message.
    """
    import queue

    steps: "queue.Queue[bytes | BaseException]" = queue.Queue()

    def drain() -> None:
        while True:
            try:
                steps.put(pipe.recv_bytes())
            except (EOFError, OSError) as exc:
                steps.put(exc)
                return

    threading.Thread(target=drain, name="tokenmill-step-reader", daemon=True).start()

    def receive() -> bytes:
        item = steps.get()
        if isinstance(item, BaseException):
            raise item
        return item

    return receive


def _send(pipe: connection.Connection, message: WorkerMessage) -> None:
    pipe.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
