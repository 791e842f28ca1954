"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, over the chat machinery.

A Messages request becomes the chat request of the same conversation (system prompt, turns, tools) and
runs through ChatHandler, so its prompt, admission, limits and greedy output are chat's; only the shapes
differ: content blocks (thinking, text, tool_use) instead of a message, Anthropic's stop reasons and usage,
and its SSE event sequence.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.messages_protocol import (
    CountTokensRequest, ImageBlock, Message, MessagesRequest, TextBlock, ThinkingBlock, ToolResultBlock,
    ToolUseBlock, anthropic_error_body, block_text)
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving_chat import ChatHandler, ChatRun, chat_request
from tokenmill.server.serving_common import STREAM_ERRORS, APIError, cached_tokens, engine_error, respond, sse
from tokenmill.server.tool_calls import tool_mode

class MessagesHandler:
    """Runs Messages requests on a ChatHandler; `defaults` are the model's recommended sampling controls,
    used where a request leaves temperature, top_p or top_k unset."""

    def __init__(self, chat: ChatHandler, defaults: dict[str, Any]) -> None:
        self.chat, self.defaults = chat, defaults

    def chat_request(self, body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
        """The chat request of the same conversation, tools and sampling (APIError 400 when the
        conversation holds what chat cannot take: documents, calls in a user turn, ...)."""
        fields: dict[str, Any] = {"model": body.model, "messages": _conversation(body.system, body.messages)}
        if body.tools:
            fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                 "parameters": t.input_schema}} for t in body.tools]
        if body.tool_choice is not None:
            choice = body.tool_choice
            fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                     else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        kwargs = dict(body.chat_template_kwargs or {})
        if body.thinking is not None:
            kwargs.setdefault("enable_thinking", body.thinking.type == "enabled")
        if kwargs:
            fields["chat_template_kwargs"] = kwargs
        if isinstance(body, MessagesRequest):
            fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
                          temperature=_given(body.temperature, self.defaults.get("temperature", 1.0)),
                          top_p=_given(body.top_p, self.defaults.get("top_p", 1.0)),
                          top_k=_given(body.top_k, self.defaults.get("top_k", -1)),
                          user=body.metadata.user_id if body.metadata else None,
                          **{name: getattr(body, name) for name in body.EXTENSIONS})
        return chat_request(fields, {"stop": "stop_sequences"})

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, Any]:
        """`{"input_tokens": N}`: the prompt's length as a Messages request would send it."""
        chat = self.chat_request(body)
        try:
            tools = tool_mode(chat)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        ids = await self.chat.prompt_ids(chat.messages, True, tools, chat.chat_template_kwargs)
        return {"input_tokens": len(ids)}

    async def complete(self, body: MessagesRequest) -> dict[str, Any]:
        """The whole Message."""
        chat = self.chat_request(body)
        run = await self.chat.start(chat, "msg")
        final = await self.chat.finish(run)
        (output,) = final.outputs
        turn = run.parsing.whole(output.text, output.token_ids)
        content: list[dict[str, Any]] = []
        if turn.thinking is not None:
            content.append({"type": "thinking", "thinking": turn.thinking, "signature": ""})
        if turn.content:
            content.append({"type": "text", "text": turn.content})
        for call in turn.calls:
            content.append({"type": "tool_use", "id": _tool_use_id(), "name": call.name,
                            "input": json.loads(call.arguments)})
        reason, sequence = _stop(output, bool(turn.calls))
        return {**self._message(run, body), "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(run, final, len(output.token_ids))}

    def _message(self, run: ChatRun, body: MessagesRequest) -> dict[str, Any]:
        return {"id": run.response_id.replace("msg-", "msg_", 1), "type": "message", "role": "assistant",
                "model": self.chat.answering(body)}

    async def stream(self, body: MessagesRequest) -> AsyncIterator[str]:
        """The SSE events of a streamed Message (admission errors raise before the first one)."""
        chat = self.chat_request(body)
        run = await self.chat.start(chat, "msg")
        run.outputs = await self.chat.primed(run)
        return self._events(run, body)

    async def _events(self, run: ChatRun, body: MessagesRequest) -> AsyncIterator[str]:
        blocks = _Blocks()
        turn = run.parsing.stream()
        output_tokens = 0
        start = {**self._message(run, body), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": _usage(run, None, 0)}
        try:
            yield _event("message_start", {"message": start})
            yield _event("ping", {})
            async for output in run.outputs:
                (completion,) = output.outputs
                output_tokens += len(completion.token_ids)
                thinking, text, calls = turn.push(completion.text, completion.token_ids, completion.finished)
                for event in blocks.thinking(thinking) + blocks.text(text) + blocks.calls(calls):
                    yield event
                if completion.finished:
                    reason, sequence = _stop(completion, turn.called)
                    for event in blocks.close():
                        yield event
                    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                   "usage": _usage(run, output, output_tokens)})
                    yield _event("message_stop", {})
        except STREAM_ERRORS as exc:
            status, _ = engine_error(exc)
            yield _event("error", anthropic_error_body(status, str(exc)))
        finally:
            run.ticket.release()
            await run.outputs.aclose()  # type: ignore[attr-defined]


class _Blocks:
    """The content blocks of a streamed Message: each opens when its first piece comes and closes when
    another kind starts or the Message ends; indexes count blocks from 0."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Optional[str] = None

    def _switch(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def thinking(self, text: str) -> list[str]:
        """Events for a piece of thinking."""
        if not text:
            return []
        events = [] if self.open == "thinking" else self._switch("thinking", {"type": "thinking", "thinking": "",
                                                                              "signature": ""})
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[str]:
        """Events for a piece of answer text."""
        if not text:
            return []
        events = [] if self.open == "text" else self._switch("text", {"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": text})]

    def calls(self, calls: list[Any]) -> list[str]:
        """Events for tool-call pieces: a call's first piece opens its tool_use block."""
        events: list[str] = []
        for call in calls:
            if call.id is not None:
                events += self._switch("tool_use", {"type": "tool_use", "id": _tool_use_id(), "name": call.name,
                                                    "input": {}})
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def close(self) -> list[str]:
        """The stop event of the open block, if any."""
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})


def _event(kind: str, data: dict[str, Any]) -> str:
    return sse({"type": kind, **data}, kind)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _stop(output: CompletionOutput, called: bool) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished output."""
    if called:
        return "tool_use", None
    if output.finish_reason == "length":
        return "max_tokens", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


def _usage(run: ChatRun, output: Optional[RequestOutput], output_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt tokens the prefix cache did not supply (as `output`'s
    metrics say; None before the first output)."""
    cached = cached_tokens([output])
    return {"input_tokens": len(run.prompt_ids) - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _conversation(system: Any, messages: list[Message]) -> list[dict[str, Any]]:
    """The chat messages of a Messages conversation: tool results become tool messages (before the user's
    text and images of the same turn), tool_use blocks an assistant's tool_calls, thinking its
    reasoning_content, image blocks `image_url` parts (`chat_content`)."""
    out: list[dict[str, Any]] = []
    try:
        if system:
            out.append({"role": "system", "content": system if isinstance(system, str)
                        else "".join(block_text(b) for b in system)})
        for index, message in enumerate(messages):
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                out += _user_turn(message.content, index)
            else:
                out.append(_assistant_turn(message.content, index))
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return out


def _user_turn(blocks: list[Any], index: int) -> list[dict[str, Any]]:
    results, parts = [], []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            content = block.content if block.content is None or isinstance(block.content, str) else \
                chat_content(block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""})
        elif isinstance(block, (ToolUseBlock, ThinkingBlock)):
            raise ValueError(f"messages.{index}: a user turn cannot hold {block.type} blocks")
        elif not isinstance(block, TextBlock) and block.type == "redacted_thinking":
            raise ValueError(f"messages.{index}: a user turn cannot hold redacted_thinking blocks")
        else:
            parts.append(block)
    return results + ([{"role": "user", "content": chat_content(parts)}] if parts or not results else [])


def chat_content(blocks: list[Any]) -> str | list[dict[str, Any]]:
    """Text and image blocks as a chat message's content: their text joined when none is an image (the
    prompt of a text-only conversation is as it always was), else OpenAI parts in the blocks' order, each
    image an `image_url` part (a base64 source as a data URL); ValueError naming any other kind."""
    if not any(isinstance(block, ImageBlock) for block in blocks):
        return "".join(block_text(block) for block in blocks)
    return [{"type": "image_url", "image_url": {"url": block.url()}} if isinstance(block, ImageBlock)
            else {"type": "text", "text": block_text(block)} for block in blocks]


def _assistant_turn(blocks: list[Any], index: int) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    calls, thinking = [], []
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolResultBlock):
            raise ValueError(f"messages.{index}: an assistant turn cannot hold tool_result blocks")
        elif isinstance(block, TextBlock) or block.type != "redacted_thinking":
            turn["content"] += block_text(block)
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    return turn


def add_messages_routes(app: FastAPI, handler: MessagesHandler, check_model: Callable[[Optional[str]], None]) -> None:
    """POST /v1/messages (streamed or whole, aborted when the client goes) and /v1/messages/count_tokens."""

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        check_model(body.model)
        return await respond(handler, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        check_model(body.model)
        return await handler.count_tokens(body)

