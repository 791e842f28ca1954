"""What completions and chat share: errors, model checks, SSE, merging streams, disconnects, deltas."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, Logprob, LogprobsDict, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.messages_protocol import anthropic_error_body
from tokenmill.server.protocol import error_body

T = TypeVar("T")


# a body's `model` -> the LoRA adapter it names (None: the base model); an APIError 404 for an unknown name
AdapterLookup = Callable[[Optional[str]], Optional[LoRARequest]]


def with_adapter(params: SamplingParams, adapter: Optional[LoRARequest]) -> SamplingParams:
    """`params` running on the LoRA adapter `adapter` (unchanged for the base model)."""
    return params if adapter is None else dataclasses.replace(params, lora_request=adapter)


class APIError(Exception):
    """An error answered in the OpenAI shape with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def bad_request(exc: ValueError, fields: Any = ()) -> APIError:
    """A 400 from a ValueError; `param` is the field its message starts with, when it names one."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return APIError(400, message, param=first if first in fields else None)


def error_response(status: int, message: str, type_: str, param: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None, path: str = "") -> JSONResponse:
    """An error in the OpenAI shape, or Anthropic's for a request to `path` under /v1/messages. Text from
    the request that is not Unicode (lone surrogates) is escaped, so no error can fail to encode."""
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error_body(status, _printable(message)), status_code=status, headers=headers)
    return JSONResponse(error_body(_printable(message), type_, _printable(param)), status_code=status,
                        headers=headers)


ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's Messages API: its clients read its error shape


def _printable(text: Optional[str]) -> Optional[str]:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


# How an engine exception is answered: (HTTP status, OpenAI error type).
ENGINE_ERRORS: dict[type, tuple[int, str]] = {
    QueueFullError: (429, "rate_limit_error"),
    EngineDeadError: (503, "service_unavailable"),
    RequestFailedError: (500, "internal_error"),
}


def engine_error(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of an engine exception: ENGINE_ERRORS', else a 500."""
    return ENGINE_ERRORS.get(type(exc), (500, "internal_error"))


def engine_error_response(exc: BaseException, path: str = "") -> JSONResponse:
    """The HTTP answer to an engine exception on `path`, as ENGINE_ERRORS maps it (a 429 says when to retry)."""
    status, type_ = engine_error(exc)
    return error_response(status, str(exc), type_, headers={"Retry-After": "1"} if status == 429 else None,
                          path=path)


def sse_error(exc: BaseException) -> str:
    """The SSE event that ends a stream whose request failed after its first event (vLLM's shape:
    an `error` object; `code` is the HTTP status the failure would have had)."""
    status, type_ = engine_error(exc)
    body = error_body(_printable(str(exc)), type_, code=status)
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


STREAM_ERRORS = tuple(ENGINE_ERRORS)


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its engine request) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def respond(handler: Any, body: Any, request: Request) -> Response:
    """A generation route's answer: `handler.stream(body)`'s events when the body streams, else
    `handler.complete(body)`'s JSON; either is cancelled (aborting its engine request) if the client goes."""
    if body.stream:
        events = await unless_disconnected(request, handler.stream(body))
        return StreamingResponse(events, media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(request, handler.complete(body)))


def sse(payload: Any, event: Optional[str] = None) -> str:
    """One Server-Sent Event carrying `payload` as JSON, named `event` when given (Responses' and Messages'
    events are named by their type)."""
    name = f"event: {event}\n" if event is not None else ""
    return f"{name}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_chunk(response_id: str, object_: str, created: int, model: str, choices: list[dict[str, Any]],
                 usage_: Optional[dict[str, Any]] = None) -> str:
    """One SSE event of a streamed response; the usage chunk has no choices and carries `usage_`."""
    payload: dict[str, Any] = {"id": response_id, "object": object_, "created": created, "model": model,
                               "choices": choices}
    if usage_ is not None:
        payload["usage"] = usage_
    return sse(payload)


def new_id(prefix: str) -> str:
    """A response id like OpenAI's."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds, for `created`."""
    return int(time.time())


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as they produce, tagging each output with its stream index.

    Closing the merged iterator cancels every producer, which closes (and aborts) their requests.
    """
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, done))
        except BaseException as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def primed(stream: AsyncIterator[T], fields: Any) -> AsyncIterator[T]:
    """Wait for `stream`'s first item, so admission errors raise here (as a 400 for ValueError) before
    any byte of a streamed response is sent; return an iterator that yields it and the rest.
    Closing the returned iterator closes `stream`."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return _replay([], stream)
    except ValueError as exc:
        raise bad_request(exc, fields) from None
    return _replay([first], stream)


async def _replay(items: list[T], stream: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        for item in items:
            yield item
        async for item in stream:
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


class ChoiceTracker:
    """What was streamed of each choice of delta outputs: whether it finished (later outputs of a
    finished choice are skipped), and its whole text so far (tool calls are parsed from it)."""

    def __init__(self) -> None:
        self.finished: set[int] = set()
        self.texts: dict[int, str] = {}

    def take(self, choice: int, completion: CompletionOutput) -> bool:
        """Record `completion`, a delta of `choice`; False when the choice had already finished."""
        if choice in self.finished:
            return False
        self.texts[choice] = self.texts.get(choice, "") + completion.text
        if completion.finished:
            self.finished.add(choice)
        return True


def top_entries(entry: LogprobsDict, count: int) -> list[tuple[int, Logprob]]:
    """The `count` most likely tokens of one position, most likely first."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= count]
    return sorted(ranked, key=lambda item: item[1].rank)[:count]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The OpenAI usage object; `cached_tokens`: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_tokens(outputs: Iterable[Optional[RequestOutput]]) -> int:
    """Prompt tokens the prefix cache supplied, over the outputs of a response's prompts."""
    return sum(o.metrics.num_cached_tokens or 0 for o in outputs if o is not None and o.metrics is not None)
