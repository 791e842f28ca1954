"""The engine behind the server: one thread owns the step loop, the event loop owns the requests.

HTTP handlers call `generate`, an async generator of RequestOutputs. Adds and aborts travel to the
engine thread through a command queue; outputs travel back through each request's bounded
`OutputStream` (`call_soon_threadsafe`, once per event loop and step). Only the engine thread touches
the LLMEngine — that is the invariant that makes the engine itself lock-free. PyTorch releases the
GIL inside its kernels, so the event loop keeps serving hundreds of open streams while a step runs.

Failures are kept to their owner: a request whose own work fails in a step ends alone
(`RequestFailedError`); a fault of the engine itself fails the requests in flight, after which the
engine proves it can still run (a one-token probe) or is declared dead (`on_dead`, so the server exits
non-zero and a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable, Optional

from tokenmill.engine.admission import AdmissionLimits, Ticket
from tokenmill.engine.engine_info import EngineInfo
from tokenmill.engine.live_sample import build_sample
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_stream import OutputStream, deliver
from tokenmill.engine.tracing import RequestTracer, incoming_trace
from tokenmill.executor import ExecutorDiedError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

_PROBE_MAX_STEPS = 64


class QueueFullError(RuntimeError):
    """The server is at its admission limit; the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped or is shutting down; no request can run (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """This request's own work failed inside an engine step; other requests were not affected."""


class AsyncEngine:
    """Runs an LLMEngine on a background thread and streams outputs to asyncio callers.

    The engine is built on that thread too (`make_engine`): all PyTorch work must happen on one
    thread. Measured on this 2-core machine, a model loaded on the main thread and stepped on
    another decodes 2.4x slower (0.35 s vs 0.15 s per 16-sequence step): the two threads' OpenMP
    pools compete for the cores.
    """

    def __init__(self, make_engine: Callable[[], LLMEngine], model_name: str,
                 limits: Optional[AdmissionLimits] = None,
                 on_dead: Optional[Callable[[str], None]] = None,
                 tracer: Optional[RequestTracer] = None) -> None:
        self.model_name = model_name
        self.tracer = tracer
        self.limits = limits or AdmissionLimits()
        self.on_dead = on_dead
        self.metrics = EngineMetrics(model_name)
        self._commands: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, OutputStream] = {}
        self._stopping = False
        self._accepting = True
        self._reserved = 0  # sequences of requests between arrival and their end
        self._reserve_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self.fault: Optional[str] = None  # why the engine is unhealthy right now (None = healthy)
        self.dead = False
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix="tokenmill-grammar")
        # KV transfers fetched over TCP (engine/kv_transfer_tcp.py): each fetch ends by its own deadline
        self._transfer_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-fetch")
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        self.engine: LLMEngine  # the engine thread's alone (see the module's docstring)
        self.info: EngineInfo  # what other threads read of it
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def tokenizer(self):
        """The model's tokenizer (thread-safe for encoding and decoding)."""
        return self.info.tokenizer

    # ------------------------------------------------------------------ event-loop side
    def reserve(self, num_sequences: int) -> Ticket:
        """Hold admission room for a request of `num_sequences` sequences (prompts x n) from its arrival
        to its end; release the ticket when the response is over.

        Raises ValueError when the request alone exceeds what the server can ever hold, QueueFullError
        when the server holds as much as it may now, EngineDeadError when it admits nothing.
        """
        self._check_open()
        capacity = self.limits.max_sequences(self.engine.config.scheduler.max_num_seqs)
        if num_sequences > capacity:
            raise ValueError(f"the request has {num_sequences} sequences (prompts x n); this server holds at "
                             f"most {capacity} at once")
        with self._reserve_lock:
            full = self._reserved + num_sequences > capacity
            if not full:
                self._reserved += num_sequences
        if full:
            self.metrics.record_rejection()
            raise QueueFullError(f"the server is at capacity ({capacity} sequences running or waiting); "
                                 f"retry later")
        return Ticket(num_sequences, self._release)

    def _release(self, num_sequences: int) -> None:
        with self._reserve_lock:  # a ticket collected by the GC may be released on any thread
            self._reserved -= num_sequences

    @property
    def num_reserved(self) -> int:
        """Sequences of requests between arrival and end."""
        return self._reserved

    async def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile (or find cached) an output constraint off the event loop and the engine thread.

        Raises ValueError when it is invalid or takes longer than the limit to compile.
        """
        future = self._grammar_pool.submit(self.engine.grammars.compile, spec)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.limits.grammar_compile_timeout)
        except asyncio.TimeoutError:
            raise ValueError(f"the output constraint did not compile within "
                             f"{self.limits.grammar_compile_timeout:g} s; simplify it") from None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: Optional[str] = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (as `params.output_kind` asks) until it finishes.

        Raises ValueError (bad request), QueueFullError or EngineDeadError before the first output, and
        RequestFailedError or EngineDeadError after it. Closing the generator early (client gone, task
        cancelled), at any point from admission on, aborts the request in the engine.
        """
        self._check_open()
        stream = OutputStream(asyncio.get_running_loop())
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        arrival = time.monotonic()
        submitted = finished = False
        trace_parent = incoming_trace.get()
        last: Optional[RequestOutput] = None
        completion_tokens = 0
        failure: Optional[str] = None

        def add() -> None:
            try:
                self._check_open()
                self._check_room(len(prompt_token_ids))
                self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                                        priority=priority, arrival_time=arrival)
                self._streams[request_id] = stream
                if params.structured_output is not None:
                    self.metrics.record_structured()
                admitted.set_result(None)
            except BaseException as exc:  # handed to the caller, never kills the loop
                admitted.set_exception(exc)

        try:
            if params.structured_output is not None:
                await self.compile_grammar(params.structured_output)
            transfers = self.info.kv_transfers
            if transfers is not None and transfers.needs_fetch(params.kv_transfer_params):
                fetched = await asyncio.get_running_loop().run_in_executor(
                    self._transfer_pool, transfers.fetch, params.kv_transfer_params, len(prompt_token_ids))
                params = dataclasses.replace(params, kv_transfer_params=fetched)
            self._submit(add)
            submitted = True
            await asyncio.wrap_future(admitted)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    failure = str(item) or item.__class__.__name__
                    raise item
                finished = item.finished
                last = item
                produced = sum(len(c.token_ids) for c in item.outputs)
                completion_tokens = completion_tokens + produced if item.delta else produced
                yield item
                if finished:
                    return
        finally:
            # Commands run in order, so an abort sent while the add is still queued finds it added.
            if submitted and not finished:
                self.abort(request_id)
                failure = "aborted"
            if self.tracer is not None and admitted.done() and admitted.exception() is None:
                try:
                    self.tracer.record(request_id, last, params, len(prompt_token_ids), completion_tokens,
                                       trace_parent, failure if failure is not None else (last.error if last else None))
                except Exception:  # a trace is never worth a request
                    logger.exception("could not record the trace of %s", request_id)

    async def live_sample(self, after_step: int) -> dict:
        """A sample of the live engine stream (engine/live_sample.py), taken on the engine thread between
        steps, with the steps logged after `after_step`."""
        sampled: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            try:
                sampled.set_result(build_sample(self.engine, self.metrics.families, self.model_name, after_step))
            except BaseException as exc:
                sampled.set_exception(exc)
        self._submit(take)
        return await asyncio.wrap_future(sampled)

    def watch(self, change: int) -> None:
        """One more (+1) or one fewer (-1) watcher of the live stream: while there are any, the engine
        records each request's timeline (engine/telemetry.py)."""
        def apply() -> None:
            telemetry = self.engine.telemetry
            telemetry.watchers += change
            if telemetry.watchers <= 0:
                telemetry.watchers = 0
                telemetry.stop_tracing()
        self._submit(apply)

    def _check_open(self) -> None:
        if self.dead:
            raise EngineDeadError(f"the engine has stopped: {self.fault}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down and admits no new requests")

    def abort(self, request_id: str) -> None:
        """Abort a request (safe from any thread; unknown or finished ids are ignored)."""
        if self._stopping:
            return

        def abort() -> None:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                self.metrics.record_abort(request_id)
                self._refresh_gauges()  # no step may follow (idle engine): publish the freed blocks now
        self._submit(abort)

    def _submit(self, command: Callable[[], None]) -> None:
        # Invariant: a command queued while the engine is alive always runs; `_die` sets `dead` under
        # this lock and then runs what is queued, so no caller waits on a command nobody will run.
        with self._submit_lock:
            if self._stopping or self.dead:
                raise EngineDeadError(f"the engine loop has stopped{': ' + self.fault if self.dead else ''}")
            self._commands.put(command)
        self._wakeup.set()

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (running ones continue)."""
        self._accepting = False

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and is not recovering from a fault."""
        return self._thread.is_alive() and not self._stopping and self.fault is None

    def shutdown(self) -> None:
        """Abort every live request, stop the loop and wait for the thread."""
        self._accepting = False
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._transfer_pool.shutdown(wait=False, cancel_futures=True)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()

    # ------------------------------------------------------------------ engine-thread side
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
