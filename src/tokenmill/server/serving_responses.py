"""POST /v1/responses (and GET, DELETE /v1/responses/{id}): OpenAI's Responses API over the chat machinery.

A Responses request becomes a chat completion request (`ResponsesHandler.chat_request`): `instructions` a
system message first, then the conversation of `previous_response_id`, then the `input` items as chat
messages; so the same conversation is the same prompt, sampled the same way, through either API. The
output is read by the chat run's parsing into a turn (thinking, answer text, tool calls) and shown as
Responses output items: a `reasoning` item, a `message` item, one `function_call` item per call.

Streamed, the events are (each with `type` and an increasing `sequence_number`): `response.created`,
`response.in_progress`, then per item, opened as the turn produces its kind (thinking first) and closed
when the next kind starts or the output ends:

    reasoning      output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                   content_part.done, output_item.done
    message        output_item.added, content_part.added, output_text.delta..., output_text.done,
                   content_part.done, output_item.done
    function_call  output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                   output_item.done

and last `response.completed` (`response.incomplete` when max_output_tokens cut the output) with the whole
response; a failure after the first event ends the stream with an `error` event instead.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.outputs import CompletionOutput
from tokenmill.server.assistant_turn import Turn
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.responses_protocol import (
    FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, ResponsesRequest, chat_content, input_items)
from tokenmill.server.serving_chat import ChatHandler, ChatRun, chat_request
from tokenmill.server.serving_common import (
    STREAM_ERRORS, APIError, ChoiceTracker, cached_tokens, engine_error, now, respond, sse)
from tokenmill.server.tool_parsers import CallDelta, call_id

# the chat request's field -> the Responses field it came from, for errors that name one
CHAT_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
# Responses fields passed to the chat request under the same name, when given
SHARED_FIELDS = ("temperature", "top_p", "user", "parallel_tool_calls", "seed", "top_k", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "ignore_eos",
                 "min_tokens", "cache_salt", "priority", "chat_template_kwargs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                 "vllm_xargs")


def item_id(prefix: str) -> str:
    """An output item's (or a response's) id, like OpenAI's: `msg_…`, `rs_…`, `fc_…`, `resp_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_messages(items: Union[str, list[InputItem], None]) -> list[dict[str, Any]]:
    """Input items as chat messages: a string is one user message; function calls join the assistant
    message before them (as one chat turn holds its text and its calls); input_image parts become
    `image_url` parts (`chat_content`); reasoning items are left out."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                last = messages[-1]
                messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": chat_content(item.output)})
    return messages


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message output item holding `text`."""
    return {"type": "message", "id": item_id("msg"), "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str) -> dict[str, Any]:
    """A reasoning output item holding the model's thinking."""
    return {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [reasoning_text(text)]}


def reasoning_text(text: str) -> dict[str, Any]:
    """A `reasoning_text` content part."""
    return {"type": "reasoning_text", "text": text}


def function_call_item(call_id_: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """A function_call output item."""
    return {"type": "function_call", "id": item_id("fc"), "call_id": call_id_, "name": name,
            "arguments": arguments, "status": status}


def turn_items(turn: Turn, cut: bool) -> list[dict[str, Any]]:
    """A finished turn's output items, in order: its reasoning, its message, its calls; `cut`: the
    output was cut by max_output_tokens (its message is then incomplete)."""
    items = []
    if turn.thinking:
        items.append(reasoning_item(turn.thinking))
    if turn.content:
        items.append(message_item(turn.content, "incomplete" if cut and not turn.calls else "completed"))
    items.extend(function_call_item(call_id(), call.name, call.arguments) for call in turn.calls)
    return items


def response_usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict[str, Any]:
    """The Responses usage object."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


@dataclass
class ResponseJob:
    """One Responses request on its way: the body, the chat request it runs as, the conversation it
    continues (without instructions) and the id and time it answers with."""

    body: ResponsesRequest
    chat_body: ChatCompletionRequest
    conversation: list[dict[str, Any]]
    response_id: str
    created_at: int
    model: str

    def response(self, status: str, output: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None
                 ) -> dict[str, Any]:
        """The Response object with `status` and `output`, echoing the request's settings."""
        body = self.body
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {}
        text.setdefault("format", {"type": "text"})
        tool_choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        reasoning = body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else {}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": body.store is not False,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": text, "tool_choice": tool_choice if tool_choice is not None else "auto",
            "tools": [tool.model_dump() for tool in body.tools or []],
            "top_p": body.top_p if body.top_p is not None else 1.0, "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }


class ResponsesHandler:
    """Runs Responses requests through `chat` (ChatHandler) and keeps the stored ones in `store`."""

    def __init__(self, chat: ChatHandler, store: ResponseStore) -> None:
        self.chat, self.store = chat, store

    def job(self, body: ResponsesRequest) -> ResponseJob:
        """The request as a chat request over its whole conversation (400 naming the field when the
        previous response is not stored, or the chat request would be invalid)."""
        conversation = self.store.continued(body.previous_response_id) if body.previous_response_id else []
        conversation = conversation + chat_messages(body.input)
        if not conversation:
            raise APIError(400, "input is required: give the conversation's next message(s)", param="input")
        instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat_body = self.chat_request(body, instructions + conversation)
        return ResponseJob(body, chat_body, conversation, item_id("resp"), now(), self.chat.answering(chat_body))

    @staticmethod
    def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request that runs `body` over `messages` (whole, n=1)."""
        fields: dict[str, Any] = {name: getattr(body, name) for name in SHARED_FIELDS
                                  if getattr(body, name) is not None}
        fields.update(model=body.model, messages=messages, max_tokens=body.max_output_tokens)
        if body.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in body.tools]
        if isinstance(body.tool_choice, str):
            fields["tool_choice"] = body.tool_choice
        elif body.tool_choice is not None:
            fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
        if body.text is not None and body.text.format is not None:
            fields["response_format"] = body.text.format.response_format()
        return chat_request(fields, CHAT_FIELDS)

    async def start(self, job: ResponseJob) -> ChatRun:
        """The chat run of `job` (its errors name the Responses fields)."""
        try:
            return await self.chat.start(job.chat_body, id_prefix="resp")
        except APIError as exc:
            exc.param = CHAT_FIELDS.get(exc.param or "", exc.param)
            raise

    async def complete(self, body: ResponsesRequest) -> dict[str, Any]:
        """The whole response (stored when `store` is true)."""
        job = self.job(body)
        run = await self.start(job)
        final = await self.chat.finish(run)
        completion = final.outputs[0]
        turn = run.parsing.whole(completion.text, completion.token_ids)
        cut = completion.finish_reason == "length"
        output_tokens = len(completion.token_ids)
        usage = response_usage(len(run.prompt_ids), output_tokens, cached_tokens([final]),
                               await self._reasoning_tokens(turn.thinking, output_tokens))
        response = job.response("incomplete" if cut else "completed", turn_items(turn, cut), usage)
        self._keep(job, response)
        return response

    async def stream(self, body: ResponsesRequest) -> AsyncIterator[str]:
        """The SSE events of a streamed response (errors before generation starts are raised, not sent)."""
        job = self.job(body)
        run = await self.start(job)
        run.outputs = await self.chat.primed(run)
        return self._events(job, run)

    async def _events(self, job: ResponseJob, run: ChatRun) -> AsyncIterator[str]:
        events = EventWriter()
        output = StreamedOutput(events)
        tracker, turn = ChoiceTracker(), run.parsing.stream()
        output_tokens, finish_reason, last = 0, None, None
        try:
            started = job.response("in_progress", [])
            yield events.emit("response.created", response=started) + events.emit("response.in_progress",
                                                                                   response=started)
            async for step in run.outputs:
                last = step
                for completion in step.outputs:
                    if not _news(tracker, completion):
                        continue
                    output_tokens += len(completion.token_ids)
                    finish_reason = completion.finish_reason if completion.finished else finish_reason
                    chunk = output.push(*turn.push(completion.text, completion.token_ids, completion.finished))
                    if chunk:
                        yield chunk
            cut = finish_reason == "length"
            closing = output.finish(cut)
            usage = response_usage(len(run.prompt_ids), output_tokens, cached_tokens([last]),
                                   await self._reasoning_tokens(output.thinking, output_tokens))
            response = job.response("incomplete" if cut else "completed", output.items, usage)
            self._keep(job, response)
            yield closing + events.emit("response.incomplete" if cut else "response.completed", response=response)
        except (*STREAM_ERRORS, ValueError) as exc:
            yield events.error(exc)
        finally:
            run.ticket.release()
            await run.outputs.aclose()  # type: ignore[attr-defined]

    async def _reasoning_tokens(self, thinking: Optional[str], output_tokens: int) -> int:
        """How many of the output tokens were thinking: the thinking text's length in tokens (an estimate:
        the tags and the retokenisation differ by a token or two), at most the output."""
        if not thinking:
            return 0
        ids = await asyncio.to_thread(self.chat.engine.tokenizer.encode, thinking, add_special_tokens=False)
        return min(len(ids), output_tokens)

    def _keep(self, job: ResponseJob, response: dict[str, Any]) -> None:
        if job.body.store is not False:
            self.store.put(response, job.conversation + chat_messages(input_items(response["output"])))

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """A stored response (404 when it is not stored)."""
        return self.store.found(response_id).response

    def delete(self, response_id: str) -> dict[str, Any]:
        """Drop a stored response (404 when it is not stored)."""
        self.store.found(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _news(tracker: ChoiceTracker, completion: CompletionOutput) -> bool:
    """Whether a streamed delta brings anything (text, tokens, or the end) to a choice not yet finished."""
    return tracker.take(completion.index, completion) and bool(
        completion.text or completion.token_ids or completion.finished)


class EventWriter:
    """Writes one stream's SSE events (`event:` and `data:` lines), numbering them from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def emit(self, type_: str, **fields: Any) -> str:
        """The event `type_` carrying `fields`."""
        payload = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse(payload, type_)

    def error(self, exc: BaseException) -> str:
        """The `error` event that ends a stream whose request failed after it started."""
        status, type_ = engine_error(exc)
        if isinstance(exc, ValueError) and type(exc) not in STREAM_ERRORS:
            type_ = "invalid_request_error"
        message = str(exc).encode("utf-8", "backslashreplace").decode("utf-8")
        return self.emit("error", code=type_, message=message, param=None)


class StreamedOutput:
    """The output items of a streamed turn, opened as its thinking, text and calls come and closed when
    the next kind starts or the output ends; each step returns the events it makes, joined. Answer text
    that is only whitespace so far is held: before a call it is dropped, as the whole turn strips it."""

    def __init__(self, events: EventWriter) -> None:
        self.events = events
        self.items: list[dict[str, Any]] = []
        self.open: Optional[dict[str, Any]] = None  # the item being written: the last of `items`
        self.text = ""  # the open reasoning or message item's text so far
        self.held = ""  # whitespace answer text not yet shown
        self.thinking = ""  # all the thinking, for the usage's reasoning tokens

    def push(self, thinking: str, text: str, calls: list[CallDelta]) -> str:
        """The events for the turn's next pieces."""
        chunks = []
        if thinking:
            self.thinking += thinking
            chunks.append(self._write("reasoning", thinking))
        if text:
            self.held += text
            if self._writing("message") or self.held.strip():
                chunks.append(self._write("message", self.held))
                self.held = ""
        for call in calls:
            self.held = ""
            chunks.append(self._call(call))
        return "".join(chunks)

    def finish(self, cut: bool) -> str:
        """The events that end the output (`cut`: by max_output_tokens, which leaves a message incomplete)."""
        held = self._write("message", self.held) if self.held else ""
        return held + self.close(cut)

    def close(self, cut: bool = False) -> str:
        """The events that close the open item."""
        item, self.open = self.open, None
        if item is None:
            return ""
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        emit = self.events.emit
        if item["type"] == "function_call":
            item["status"] = "completed"
            return (emit("response.function_call_arguments.done", arguments=item["arguments"], **where)
                    + emit("response.output_item.done", output_index=where["output_index"], item=item))
        if item["type"] == "reasoning":
            part = reasoning_text(self.text)
            done = emit("response.reasoning_text.done", content_index=0, text=self.text, **where)
        else:
            part = output_text(self.text)
            done = emit("response.output_text.done", content_index=0, text=self.text, logprobs=[], **where)
            item["status"] = "incomplete" if cut else "completed"
        item["content"] = [part]
        return (done + emit("response.content_part.done", content_index=0, part=part, **where)
                + emit("response.output_item.done", output_index=where["output_index"], item=item))

    def _writing(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _write(self, kind: str, delta: str) -> str:
        chunks = []
        if not self._writing(kind):
            chunks.append(self.close())
            item = reasoning_item("") if kind == "reasoning" else message_item("", "in_progress")
            item["content"] = []
            part = reasoning_text("") if kind == "reasoning" else output_text("")
            chunks.append(self._opened(item))
            chunks.append(self.events.emit("response.content_part.added", content_index=0, part=part,
                                           **self._where()))
        self.text += delta
        if kind == "reasoning":
            chunks.append(self.events.emit("response.reasoning_text.delta", content_index=0, delta=delta,
                                           **self._where()))
        else:
            chunks.append(self.events.emit("response.output_text.delta", content_index=0, delta=delta,
                                           logprobs=[], **self._where()))
        return "".join(chunks)

    def _call(self, call: CallDelta) -> str:
        chunks = []
        if call.id is not None:  # a call's first piece
            chunks.append(self.close())
            chunks.append(self._opened(function_call_item(call.id, call.name or "", "", "in_progress")))
        if call.arguments and self._writing("function_call"):
            self.open["arguments"] += call.arguments  # type: ignore[index]
            chunks.append(self.events.emit("response.function_call_arguments.delta", delta=call.arguments,
                                           **self._where()))
        return "".join(chunks)

    def _opened(self, item: dict[str, Any]) -> str:
        self.items.append(item)
        self.open, self.text = item, ""
        return self.events.emit("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}


def add_responses_routes(app: FastAPI, handler: ResponsesHandler, check_model: Callable[[Optional[str]], None]
                         ) -> None:
    """POST /v1/responses (streamed or whole, aborted when the client goes away), and GET and DELETE
    /v1/responses/{response_id} for stored responses."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        check_model(body.model)
        return await respond(handler, body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return handler.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return handler.delete(response_id)
