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
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence, TypeVar

from tokenmill.engine.admission import AdmissionLimits, Ticket, batch_work, current_client
from tokenmill.engine.engine_errors import EngineDeadError, QueueFullError, RequestFailedError
from tokenmill.engine.engine_info import EngineInfo
from tokenmill.engine.engine_loop import EngineLoop
from tokenmill.engine.live_sample import build_sample
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.output_stream import OutputStream
from tokenmill.engine.prompt_embeds import embeds_length
from tokenmill.engine.tracing import RequestTracer, incoming_trace
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.multimodal.processing import ImageLike
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.spec import StructuredOutput

T = TypeVar("T")

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestFailedError"]


class AsyncEngine:
    """Runs an LLMEngine on a background thread and streams outputs to asyncio callers. The thread is
    its `EngineLoop` (engine/engine_loop.py); this side admits requests and turns them into commands
    for it.

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
        self.metrics = EngineMetrics(model_name)
        self._accepting = True
        self._reserved = 0  # sequences of requests between arrival and their end
        self._reserve_lock = threading.Lock()
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix="tokenmill-grammar")
        # KV transfers fetched over TCP (engine/kv_transfer_tcp.py): each fetch ends by its own deadline
        self._transfer_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-fetch")
        self._engine_loop = EngineLoop(make_engine, self.limits, self.metrics, on_dead)

    @property
    def engine(self) -> LLMEngine:
        """The LLMEngine. Only the engine thread steps it or changes its requests (commands do, through
        `EngineLoop.submit`); other threads call only its thread-safe parts."""
        return self._engine_loop.engine

    @property
    def info(self) -> EngineInfo:
        """What other threads may read of the engine, taken once it was built."""
        return self._engine_loop.info

    @property
    def fault(self) -> Optional[str]:
        """Why the engine is unhealthy right now (None = healthy)."""
        return self._engine_loop.fault

    @property
    def dead(self) -> bool:
        """True once the engine can run no more (`on_dead` was called)."""
        return self._engine_loop.dead

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

    def prepare_images(self, prompt_token_ids: list[int], images: Sequence[ImageLike]
                       ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """The prompt with each image's placeholder expanded, and the images' features for `generate`
        (`LLMEngine.prepare_images`, thread-safe); blocking (the model's image processor runs): call it off the
        event loop. ValueError for a text-only model, or placeholders and images that do not pair up."""
        return self.engine.prepare_images(prompt_token_ids, images)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: Optional[str] = None, priority: int = 0, images: tuple[ImageFeature, ...] = (),
                       prompt_embeds: Any = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (as `params.output_kind` asks) until it finishes. `images`: the
        prompt's images, as `prepare_images` made them with the prompt. `prompt_embeds`: the prompt as a
        [tokens, hidden] tensor of input embeddings instead (`prompt_token_ids` then []).

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
        background = batch_work.get()
        client = current_client.get()
        if client is not None:
            priority = max(priority, client.priority)
            if client.isolate_cache:
                params = dataclasses.replace(params, cache_salt=client.isolated_salt(params.cache_salt))
        usage = client.usage if client is not None else None
        last: Optional[RequestOutput] = None
        completion_tokens = 0
        failure: Optional[str] = None

        def add() -> None:
            try:
                self._check_open()
                self._engine_loop.admit(request_id, stream, prompt, params, prompt_token_ids, priority, arrival,
                                        images, prompt_embeds, background, client.share if client else None)
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
            self._engine_loop.submit(add)
            submitted = True
            await asyncio.wrap_future(admitted)
            if usage is not None:
                usage.prompt(len(prompt_token_ids) if prompt_embeds is None else embeds_length(prompt_embeds))
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    failure = str(item) or item.__class__.__name__
                    raise item
                finished = item.finished
                last = item
                produced = sum(len(c.token_ids) for c in item.outputs)
                if usage is not None and completion_tokens == 0 < produced:
                    usage.first_output(time.monotonic() - arrival)
                completion_tokens = completion_tokens + produced if item.delta else produced
                yield item
                if finished:
                    return
        finally:
            # Commands run in order, so an abort sent while the add is still queued finds it added.
            if submitted and not finished:
                self.abort(request_id)
                failure = "aborted"
            if usage is not None and admitted.done() and admitted.exception() is None:
                usage.finished(completion_tokens, time.monotonic() - arrival)
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
        self._engine_loop.submit(take)
        return await asyncio.wrap_future(sampled)

    async def call(self, command: Callable[[LLMEngine], T]) -> T:
        """`command(engine)`'s result, run on the engine thread between steps (what it raises is raised here)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(command(self.engine))
            except BaseException as exc:
                done.set_exception(exc)
        self._engine_loop.submit(run)
        return await asyncio.wrap_future(done)

    async def pause(self, mode: str) -> None:
        """Stop stepping, as EngineLoop.pause says for `mode` (abort, wait or keep); returns once no step runs."""
        paused = threading.Event()
        self._engine_loop.submit(lambda: self._engine_loop.pause(mode, paused))
        await asyncio.to_thread(paused.wait)

    def resume(self) -> None:
        """Step again; the requests that arrived while paused go in."""
        self._engine_loop.submit(self._engine_loop.resume)

    @property
    def is_paused(self) -> bool:
        """Whether no step runs, by `pause` (a pause in mode wait counts once the engine has emptied)."""
        return self._engine_loop.paused

    def watch(self, change: int) -> None:
        """One more (+1) or one fewer (-1) watcher of the live stream: while there are any, the engine
        records each request's timeline (engine/telemetry.py)."""
        def apply() -> None:
            telemetry = self.engine.telemetry
            telemetry.watchers += change
            if telemetry.watchers <= 0:
                telemetry.watchers = 0
                telemetry.stop_tracing()
        self._engine_loop.submit(apply)

    def _check_open(self) -> None:
        # `dead` first: it never clears, and the engine loop leaves `_accepting` alone when it dies
        if self.dead:
            raise EngineDeadError(f"the engine has stopped: {self.fault}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down and admits no new requests")

    def abort(self, request_id: str) -> None:
        """Abort a request (safe from any thread; unknown or finished ids are ignored)."""
        self._engine_loop.abort(request_id)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (running ones continue)."""
        self._accepting = False

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and is not recovering from a fault."""
        return self._engine_loop.healthy

    def shutdown(self) -> None:
        """Abort every live request, stop the loop and wait for the thread."""
        self._accepting = False
        self._engine_loop.stop()
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._transfer_pool.shutdown(wait=False, cancel_futures=True)
        self._engine_loop.close()
        if self.tracer is not None:
            self.tracer.shutdown()
