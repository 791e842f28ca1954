"""The engine thread that `AsyncEngine` owns: it builds the LLMEngine, runs the commands other threads
submit and the steps between them, hands each step's outputs to the requests' streams, and recovers
from a failed step or declares the engine dead (engine/async_engine.py says how the two sides talk)."""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from tokenmill.core.fair_share import FairShare
from tokenmill.engine.engine_errors import EngineDeadError, QueueFullError, RequestFailedError
from tokenmill.engine.engine_info import EngineInfo
from tokenmill.engine.output_stream import deliver
from tokenmill.engine.prompt_embeds import embeds_length
from tokenmill.executor import ExecutorDiedError
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.admission import AdmissionLimits
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.metrics import EngineMetrics
    from tokenmill.engine.output_stream import OutputStream
    from tokenmill.multimodal.inputs import ImageFeature
    from tokenmill.request import TenantShare

logger = logging.getLogger(__name__)

_PROBE_MAX_STEPS = 64


class EngineLoop:
    """One thread that owns an LLMEngine: it builds it (`make_engine`), then runs submitted commands and
    steps until `stop`. Only this thread steps `engine` or changes its requests, so the engine needs no
    lock; other threads read `info`, `fault` and `dead`, and call only the engine's thread-safe parts.

    The constructor returns once the engine is built, and raises what building it raised. `on_dead` is
    called on this thread, once, with the reason when the engine can run no more.
    """

    def __init__(self, make_engine: Callable[[], LLMEngine], limits: AdmissionLimits, metrics: EngineMetrics,
                 on_dead: Optional[Callable[[str], None]] = None) -> None:
        self._limits = limits
        self._metrics = metrics
        self._on_dead = on_dead
        self._commands: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # the requests in the engine, by id; changed on this thread only (`stop` reads the ids from another)
        self._streams: dict[str, OutputStream] = {}
        self._stopping = False
        self._submit_lock = threading.Lock()
        self.fault: Optional[str] = None  # why the engine is unhealthy right now (None = healthy)
        self.dead = False
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        # pause and resume (RL trainers, around weight updates): while `_holding`, admissions wait in `_held` (by
        # request id, bounded as the waiting queue is) instead of entering the engine; while `paused`, no step
        # runs; `_pausing` is set when paused, once the engine is idle (mode wait)
        self._holding = False
        self.paused = False
        self._held: dict[str, dict[str, Any]] = {}  # request id -> LLMEngine.add_request's keywords
        self._pausing: Optional[threading.Event] = None
        self._restarts: collections.deque[float] = collections.deque()  # when the worker group was replaced
        self.engine: LLMEngine  # this thread's alone (see the class's docstring)
        self.info: EngineInfo  # what other threads read of it
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    # ------------------------------------------------------------------ any thread
    def submit(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread, between steps and in submission order. Raises
        EngineDeadError once the loop is stopping or dead."""
        # Invariant: a command queued while the engine is alive always runs; `_die` sets `dead` under
        # this lock and then runs what is queued, so no caller waits on a command nobody will run.
        with self._submit_lock:
            if self._stopping or self.dead:
                raise EngineDeadError(f"the engine loop has stopped{': ' + self.fault if self.dead else ''}")
            self._commands.put(command)
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored; nothing once the loop is stopping)."""
        if self._stopping:
            return

        def abort() -> None:
            self._held.pop(request_id, None)
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                self._metrics.record_abort(request_id)
                self._refresh_gauges()  # no step may follow (idle engine): publish the freed blocks now
        self.submit(abort)

    @property
    def healthy(self) -> bool:
        """True while the thread runs, is not stopping and is not recovering from a fault."""
        return self._thread.is_alive() and not self._stopping and self.fault is None

    def stop(self) -> None:
        """Abort every live request, end the loop and wait for the thread (30 s at most); `close` then
        shuts the engine down."""
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    def close(self) -> None:
        """Shut the engine down (its workers and servers); after `stop`."""
        self.engine.shutdown()

    # ------------------------------------------------------------------ the engine thread
    def admit(self, request_id: str, stream: OutputStream, prompt: Optional[str], params: SamplingParams,
              prompt_token_ids: list[int], priority: int, arrival_time: float,
              images: tuple[ImageFeature, ...], prompt_embeds: Any = None, background: bool = False,
              tenant: Optional[TenantShare] = None) -> None:
        """From a submitted command only: queue the request in the engine, its outputs bound for `stream`.
        Raises QueueFullError when the waiting queue is at a bound, and what `LLMEngine.add_request`
        raises for a request that can never run. While the engine is paused the request waits outside it (in
        `_held`, bounded alike) and enters on `resume`."""
        self._check_room(len(prompt_token_ids) if prompt_embeds is None else embeds_length(prompt_embeds), tenant)
        request = dict(prompt=prompt, params=params, prompt_token_ids=prompt_token_ids, priority=priority,
                       arrival_time=arrival_time, images=images, prompt_embeds=prompt_embeds, background=background,
                       tenant=tenant)
        if self._holding:
            if len(self._held) >= self._limits.max_waiting_requests:
                self._metrics.record_rejection()
                raise QueueFullError(f"the engine is paused and {len(self._held)} requests wait for it; retry later")
            self._held[request_id] = request
        else:
            self.engine.add_request(request_id, **request)
        self._streams[request_id] = stream

    def pause(self, mode: str, paused: threading.Event) -> None:
        """From a submitted command only: stop stepping (vLLM's /pause). New requests wait outside the engine from
        now on. `mode` abort: the requests in the engine end now, failed; keep: they stay where they are and go on
        at `resume`; wait: they run to the end first. `paused` is set once no step runs any more."""
        self._holding = True
        if mode == "abort":
            for request_id in [rid for rid in self._streams if rid not in self._held]:  # those in the engine
                stream = self._streams.pop(request_id)
                self.engine.abort_request(request_id)
                stream.loop.call_soon_threadsafe(stream.put, RequestFailedError(
                    "the request was aborted: the server was paused (mode abort)"))
        if mode == "wait" and self.engine.has_unfinished_requests():
            self._pausing = paused  # set by `_serve` once the engine is idle
            return
        self.paused = True
        paused.set()

    def resume(self) -> None:
        """From a submitted command only: step again (vLLM's /resume), and let the requests that waited in."""
        self._holding = self.paused = False
        if self._pausing is not None:  # a pause still waiting for the engine to empty: it is over
            self._pausing.set()
            self._pausing = None
        held, self._held = self._held, {}
        for request_id, request in held.items():
            try:
                self.engine.add_request(request_id, **request)
            except Exception as exc:  # that request's alone
                stream = self._streams.pop(request_id)
                stream.loop.call_soon_threadsafe(stream.put, RequestFailedError(str(exc)))

    def _check_room(self, prompt_len: int, tenant: Optional["TenantShare"] = None) -> None:
        """QueueFullError when the waiting queue is at a bound, unless `tenant` holds less than its weighted share
        of it (FairShare.within_share): another tenant's flood never locks it out."""
        scheduler = self.engine.scheduler
        limit, token_limit = self._limits.max_waiting_requests, self._limits.max_waiting_tokens
        tokens = scheduler.num_waiting_tokens
        if scheduler.num_waiting >= limit:
            problem = f"the waiting queue is full ({limit} requests); retry later"
        elif scheduler.num_waiting and tokens + prompt_len > token_limit:
            problem = f"the waiting queue holds {tokens} prompt tokens and takes at most {token_limit}; retry later"
        else:
            return
        if tenant is not None and FairShare.within_share(scheduler.waiting, tenant, prompt_len, limit, token_limit):
            return
        self._metrics.record_rejection()
        raise QueueFullError(problem)

    def _run(self, make_engine: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = make_engine()
            self.info = EngineInfo.of(self.engine)
        except BaseException as exc:
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        except BaseException as exc:  # the loop itself broke: nothing can run any more
            logger.exception("the engine loop stopped")
            self._die(f"the engine loop stopped: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while True:
            self._run_commands()
            if self._stopping:
                self._run_commands()
                return
            gone = self.engine.executor.failure()
            if gone is not None:  # a worker process died: no step can run on this group again
                if not self._replace_workers(gone):
                    return
                continue
            idle = not self.engine.has_unfinished_requests()
            if idle and self._pausing is not None:  # a pause in mode wait: the engine has emptied
                self.paused = True
                self._pausing.set()
                self._pausing = None
            if idle or self.paused:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                self._step()
            except ExecutorDiedError as exc:
                if not self._replace_workers(str(exc)):
                    return
            except Exception as exc:
                logger.exception("engine step failed; failing the requests in flight")
                self._recover(f"{type(exc).__name__}: {exc}")
                if self.dead:
                    return

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # a failed command must not stop the loop
                logger.exception("engine command failed")

    def _step(self) -> None:
        outputs = self.engine.step()
        new_steps = self.engine.telemetry.steps_after(self._metrics.last_step)
        self._metrics.observe_step(outputs, self.engine.stats(), new_steps)
        # one wake-up per event loop and step, however many streams: each wake-up is a socket write,
        # after which the loop takes the GIL to stream what it was handed
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            item = output if output.error is None else RequestFailedError(
                f"generation failed for this request: {output.error}")
            deliveries.setdefault(stream.loop, []).append((stream, item))
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(deliver, items)

    def _refresh_gauges(self) -> None:
        self._metrics.observe_step([], self.engine.stats())

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.loop.call_soon_threadsafe(stream.put, error)
        self._streams.clear()
        self._held.clear()

    def _recover(self, reason: str) -> None:
        """After a fault of the engine itself: fail the requests in flight, then run a one-token probe.
        Healthy again if it completes with the pool empty; otherwise dead."""
        self.fault = f"engine step failed: {reason}"
        self._metrics.record_fault()
        self._fail_all(EngineDeadError(f"the engine failed while running this request ({reason})"))
        try:
            self._probe()
        except Exception as exc:
            logger.exception("the engine did not recover")
            self._die(f"{self.fault}; the recovery probe failed too: {type(exc).__name__}: {exc}")
            return
        self._refresh_gauges()
        logger.warning("the engine recovered from a failed step (%s)", reason)
        self.fault = None

    def _replace_workers(self, reason: str) -> bool:
        """A rank of the worker group died or hung: replace the group and resume every request by recompute
        (the clients see a pause), unless --max-worker-restarts replacements were already made within
        --worker-restart-window (or the group cannot be replaced): then the engine is dead. True when it serves
        again."""
        parallel = self.engine.config.parallel
        now = time.monotonic()
        while self._restarts and self._restarts[0] <= now - parallel.worker_restart_window:
            self._restarts.popleft()
        if len(self._restarts) >= parallel.max_worker_restarts:
            self._die(f"{reason}; {len(self._restarts)} worker group replacement(s) within the last "
                      f"{parallel.worker_restart_window:g} s already (--max-worker-restarts "
                      f"{parallel.max_worker_restarts}): not replacing it again")
            return False
        self._restarts.append(now)
        self.fault = f"replacing the worker group: {reason}"
        logger.error("the worker group failed (%s); replacing it", reason)
        try:
            resumed = self.engine.replace_workers()
        except Exception as exc:
            logger.exception("the worker group could not be replaced")
            self._die(f"{reason}; the worker group could not be replaced: {type(exc).__name__}: {exc}")
            return False
        seconds = time.monotonic() - now
        self._metrics.record_worker_restart(seconds)
        self._refresh_gauges()
        logger.warning("worker group replaced in %.1f s; %d requests resume by recomputing what they had", seconds,
                       resumed)
        self.fault = None
        return True

    def _probe(self) -> None:
        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("requests are still queued after every request was aborted")
        engine.add_request("tokenmill-recovery-probe", None, SamplingParams(max_tokens=1, temperature=0.0),
                           prompt_token_ids=[0])
        for _ in range(_PROBE_MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        if engine.has_unfinished_requests() or engine.kv_cache.pool.num_used_blocks:
            raise RuntimeError("the probe did not finish, or KV blocks stayed in use")

    def _die(self, reason: str) -> None:
        with self._submit_lock:
            self.fault, self.dead = reason, True
        if self._pausing is not None:  # no step will run again: a pause waiting for the engine to empty is over
            self._pausing.set()
            self._pausing = None
        try:
            self._fail_all(EngineDeadError(f"the engine has stopped: {reason}"))
        except Exception:
            logger.exception("could not fail the requests in flight")
        self._run_commands()  # adds queued before the death now fail fast (`AsyncEngine._check_open`)
        if self._on_dead is not None:
            self._on_dead(reason)
