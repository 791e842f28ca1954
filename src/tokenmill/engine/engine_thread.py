"""The engine thread's side of `AsyncEngine`: the step loop, admission checks run on it, delivery of
outputs to the event loops, and recovery from a failed step (engine/async_engine.py says how the two
sides talk)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable, Optional

from tokenmill.engine.engine_errors import EngineDeadError, QueueFullError, RequestFailedError
from tokenmill.engine.engine_info import EngineInfo
from tokenmill.engine.output_stream import deliver
from tokenmill.executor import ExecutorDiedError
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.admission import AdmissionLimits
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.metrics import EngineMetrics
    from tokenmill.engine.output_stream import OutputStream

logger = logging.getLogger(__name__)

_PROBE_MAX_STEPS = 64


class EngineThread:
    """`AsyncEngine`'s base class: what runs on the engine thread. Only this side touches `engine`."""

    engine: LLMEngine
    info: EngineInfo
    limits: AdmissionLimits
    metrics: EngineMetrics
    fault: Optional[str]
    dead: bool
    on_dead: Optional[Callable[[str], None]]
    _streams: dict[str, OutputStream]
    _commands: queue.SimpleQueue
    _wakeup: threading.Event
    _ready: threading.Event
    _startup_error: Optional[BaseException]
    _stopping: bool
    _accepting: bool
    _submit_lock: threading.Lock

    def _check_room(self, prompt_len: int) -> None:
        scheduler = self.engine.scheduler
        limit = self.limits.max_waiting_requests
        if scheduler.num_waiting >= limit:
            self.metrics.record_rejection()
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        tokens, token_limit = scheduler.num_waiting_tokens, self.limits.max_waiting_tokens
        if scheduler.num_waiting and tokens + prompt_len > token_limit:
            self.metrics.record_rejection()
            raise QueueFullError(f"the waiting queue holds {tokens} prompt tokens and takes at most "
                                 f"{token_limit}; retry later")

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
            self._loop()
        except BaseException as exc:  # the loop itself broke: nothing can run any more
            logger.exception("the engine loop stopped")
            self._die(f"the engine loop stopped: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            self._run_commands()
            if self._stopping:
                self._run_commands()
                return
            gone = self.engine.executor.failure()
            if gone is not None:  # a worker process died: no step can run again
                self._die(gone)
                return
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                self._step()
            except ExecutorDiedError as exc:
                self._die(str(exc))
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
        new_steps = self.engine.telemetry.steps_after(self.metrics.last_step)
        self.metrics.observe_step(outputs, self.engine.stats(), new_steps)
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
        self.metrics.observe_step([], self.engine.stats())

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.loop.call_soon_threadsafe(stream.put, error)
        self._streams.clear()

    def _recover(self, reason: str) -> None:
        """After a fault of the engine itself: fail the requests in flight, then run a one-token probe.
        Healthy again if it completes with the pool empty; otherwise dead."""
        self.fault = f"engine step failed: {reason}"
        self.metrics.record_fault()
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
        self._accepting = False
        try:
            self._fail_all(EngineDeadError(f"the engine has stopped: {reason}"))
        except Exception:
            logger.exception("could not fail the requests in flight")
        self._run_commands()  # adds queued before the death now fail fast (`_check_open`)
        if self.on_dead is not None:
            self.on_dead(reason)
