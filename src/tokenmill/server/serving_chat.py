"""POST /v1/chat/completions: messages through the model's chat template, streamed or whole."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, AsyncIterator, Optional

from pydantic import ValidationError

from tokenmill.engine.admission import Ticket
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.multimodal.media import MediaPolicy
from tokenmill.outputs import CompletionOutput, LogprobsDict, RequestOutput, merge_outputs
from tokenmill.server.assistant_turn import TurnParsing, TurnStream
from tokenmill.server.chat_images import check_conversation_images, load_conversation_images
from tokenmill.server.chat_prompt import chat_prompt_ids
from tokenmill.server.harmony import Harmony, HarmonyParsing
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.request_limits import RequestLimits
from tokenmill.server.serving_beam import run_beam_search
from tokenmill.server.serving_common import (
    SSE_DONE, STREAM_ERRORS, AdapterLookup, APIError, ChoiceTracker, bad_request, new_id, now, primed, sse_error, stream_chunk,
    top_entries, usage, cached_tokens, with_adapter)
from tokenmill.server.tool_calls import ToolMode, forced_call, render_messages, tool_mode
from tokenmill.server.tool_parsers import CallDelta, ToolParser, call_id, tool_parser

_FIELDS = set(ChatCompletionRequest.model_fields)
CONSTRAINT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constraint_field(body: ChatCompletionRequest) -> str:
    """The field that asks `body`'s output constraint, as an error names it (`response_format json_object`)."""
    for name in CONSTRAINT_FIELDS:
        if getattr(body, name) is not None:
            return name
    return f"response_format {body.response_format.type}" if body.response_format is not None else "response_format"


def chat_prompt(tokenizer: Any, chat_template: Optional[str], messages: list[ChatMessage],
                add_generation_prompt: bool = True, tools: Optional[ToolMode] = None,
                family: Optional[ToolParser] = None, template_kwargs: Optional[dict[str, Any]] = None
                ) -> tuple[str, list[int]]:
    """The prompt text the chat template makes of `messages` (and of the tools offered, described in
    `family`'s syntax when the template renders no tools), and its token ids, in which text from the
    messages is never a control token (`chat_prompt_ids`); APIError 400 when the model has no template or
    the template refuses the messages."""
    if not chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        conversation, tool_specs = render_messages(messages, tools, "tools" in chat_template,
                                                   family or tool_parser("auto", chat_template))
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    try:
        return chat_prompt_ids(tokenizer, chat_template, conversation, tool_specs, add_generation_prompt,
                               template_kwargs)
    except Exception as exc:  # a template may raise on a conversation it does not accept
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None


def chat_request(fields: dict[str, Any], names: Optional[dict[str, str]] = None) -> ChatCompletionRequest:
    """The chat request another API's body translates to (`fields`); APIError 400 when it is invalid, naming the
    field as that API calls it (`names`: chat's field -> the other API's)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"]]
        param = (names or {}).get(loc[0], loc[0]) if loc else None
        message = str(error["msg"]).removeprefix("Value error, ")
        raise APIError(400, f"'{param}': {message}" if param else message, param=param) from None


@dataclass
class ChatRun:
    """A chat generation under way: its id, prompt, engine stream, how its output is read, the
    admission ticket the response releases when it ends, and the images of its prompt (only for a model
    that accepts images: EngineInfo.accepts_images), whose placeholders `prompt_ids` holds expanded."""

    response_id: str
    prompt_ids: list[int]
    outputs: AsyncIterator[RequestOutput]
    parsing: TurnParsing
    ticket: Ticket
    images: tuple[ImageFeature, ...] = ()


class ChatHandler:
    """Runs a chat completion on the engine and shapes the OpenAI response. `reasoning` splits thinking
    from answers (--reasoning-parser); `tool_family` names the tool-call syntax read from answers
    (--tool-call-parser; auto: from the chat template); `media` bounds the images of a request and where
    they may come from. `harmony`, for a GPT-OSS model, replaces the template and both parsers: prompts are
    harmony's renderings, outputs read by its parser (server/harmony.py)."""

    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: Optional[str],
                 limits: RequestLimits = RequestLimits(), adapter_of: AdapterLookup = lambda name: None,
                 reasoning: Optional[ReasoningParser] = None, tool_family: str = "auto",
                 media: MediaPolicy = MediaPolicy(), harmony: Optional[Harmony] = None) -> None:
        self.engine, self.model_name, self.chat_template, self.limits = engine, model_name, chat_template, limits
        self.media = media
        self.adapter_of = adapter_of  # the LoRA adapter a body's `model` names (None: the base model)
        self.reasoning = reasoning
        self.family = tool_parser(tool_family, chat_template)
        self.forced_family = tool_parser("hermes", None)  # what forced_call's grammar writes
        self.harmony = harmony

    def answering(self, body: Any) -> str:
        """The model a response names: the LoRA adapter the body asked for, else the base model (as vLLM)."""
        adapter = self.adapter_of(body.model)
        return adapter.lora_name if adapter is not None else self.model_name

    def check_images(self, messages: list[ChatMessage]) -> int:
        """How many images `messages` hold; APIError 400 past --limit-mm-per-prompt, or for any image when
        the model is text-only."""
        return check_conversation_images(messages, self.media, self.model_name, self.engine.info.accepts_images)

    def prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: Optional[ToolMode] = None, template_kwargs: Optional[dict[str, Any]] = None
               ) -> tuple[str, list[int]]:
        """The prompt text and token ids of `messages` (`chat_prompt`); APIError 400 for images a text-only
        model cannot take, which the template (rendering text parts only) would otherwise drop."""
        self.check_images(messages)
        if self.harmony is not None:
            try:
                token_ids = self.harmony.prompt_ids(messages, tools, template_kwargs)
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
            return self.engine.tokenizer.decode(token_ids), token_ids
        family = self.forced_family if tools is not None and tools.forced else self.family
        return chat_prompt(self.engine.tokenizer, self.chat_template, messages, add_generation_prompt, tools,
                           family, template_kwargs)

    async def expanded_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                              tools: Optional[ToolMode] = None, template_kwargs: Optional[dict[str, Any]] = None,
                              image_count: int = 0) -> tuple[str, list[int], tuple[ImageFeature, ...]]:
        """The prompt text, its token ids with each of its `image_count` images' placeholder expanded to the
        positions its embeddings fill, and the images' features: the images read and decoded, the template
        rendered and the processor run off the event loop. APIError 400 naming what is wrong. The caller
        holds an admission ticket while images load."""
        images = await load_conversation_images(messages, self.media) if image_count else []
        prompt, token_ids = await asyncio.to_thread(self.prompt, messages, add_generation_prompt, tools,
                                                    template_kwargs)
        if not images:
            return prompt, token_ids, ()
        try:
            token_ids, features = await asyncio.to_thread(self.engine.prepare_images, token_ids, images)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return prompt, token_ids, features

    async def prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                         tools: Optional[ToolMode] = None, template_kwargs: Optional[dict[str, Any]] = None
                         ) -> list[int]:
        """The token ids a chat request of `messages` would run, image positions included (what /tokenize,
        the render routes and count_tokens report); images load under an admission ticket of their own."""
        image_count = self.check_images(messages)
        if not image_count:
            return (await asyncio.to_thread(self.prompt, messages, add_generation_prompt, tools, template_kwargs))[1]
        ticket = self.engine.reserve(1)
        try:
            return (await self.expanded_prompt(messages, add_generation_prompt, tools, template_kwargs,
                                               image_count))[1]
        finally:
            ticket.release()

    async def start(self, body: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> ChatRun:
        """Check the request, hold admission room for it, load its images and render and tokenise its prompt
        off the event loop and start its engine request. The caller releases the run's ticket when the
        response ends."""
        if body.use_beam_search:  # a streamed one: beam search answers whole
            raise APIError(400, "beam search cannot honour stream: leave it unset with use_beam_search",
                           param="stream")
        self.limits.check(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}", param="top_logprobs")
        image_count = self.check_images(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            tools = tool_mode(body)
            params = with_adapter(body.sampling_params(max_tokens, logprobs), self.adapter_of(body.model))
            if self.harmony is not None:
                params = self._harmony_params(params, tools, body)
            elif tools is not None and tools.forced:
                params = dataclasses.replace(params, structured_output=forced_call(tools))  # re-validated
            ticket = self.engine.reserve(body.n)
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        if image_count and body.truncate_prompt_tokens is not None:
            ticket.release()
            raise APIError(400, "truncate_prompt_tokens cannot cut a prompt with images (their placeholders would "
                                "be cut apart)", param="truncate_prompt_tokens")
        try:  # images are decoded under the ticket, so admission bounds how many requests decode at once
            prompt, token_ids, features = await self.expanded_prompt(
                body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs, image_count)
            if body.truncate_prompt_tokens is not None:
                token_ids = body.truncated(token_ids, self.engine.info.max_model_len)
        except BaseException:
            ticket.release()
            raise
        parsing = self._parsing(token_ids, tools)
        if parsing.opening != "answer" and self.reasoning is not None and params.structured_output is not None:
            # the constraint holds for the answer only: it starts after the thinking's end tag
            params = dataclasses.replace(params, structured_output=dataclasses.replace(
                params.structured_output, after_token=self.reasoning.end_token_id))
        request_id = new_id(id_prefix)
        stream = self.engine.generate(request_id, token_ids, params, prompt, body.priority, features)
        return ChatRun(request_id, token_ids, stream, parsing, ticket, features)

    def _harmony_params(self, params: Any, tools: Optional[ToolMode], body: ChatCompletionRequest) -> Any:
        """`params` for a harmony turn: ended by harmony's stop tokens; ValueError, naming the field, for what
        the harmony path does not do yet (a forced call or an output constraint: both would have to hold on
        the commentary or final channel only, not over the analysis that comes first)."""
        if tools is not None and tools.forced:
            given = "'required'" if tools.choice == "required" else f"naming function {tools.choice!r}"
            raise ValueError(f"tool_choice {given} is not supported for GPT-OSS's harmony format yet (a forced "
                             f"call would have to start after the model's analysis); use tool_choice 'auto'")
        if params.structured_output is not None:
            raise ValueError(f"{constraint_field(body)} is not supported for GPT-OSS's harmony format yet (the "
                             f"constraint would have to hold on the final channel only, after the model's "
                             f"analysis); leave it unset")
        stops = list(params.stop_token_ids or []) + [t for t in self.harmony.stop_token_ids
                                                     if t not in (params.stop_token_ids or [])]
        return dataclasses.replace(params, stop_token_ids=stops)

    def _parsing(self, prompt_ids: list[int], tools: Optional[ToolMode]) -> TurnParsing:
        if self.harmony is not None:
            names = frozenset(t.function.name for t in tools.tools) if tools is not None else frozenset()
            return TurnParsing(harmony=HarmonyParsing(self.harmony, names))
        opening = self.reasoning.opening(prompt_ids) if self.reasoning is not None else None
        if tools is None:
            return TurnParsing(self.reasoning, opening)
        family = self.forced_family if tools.forced else self.family
        return TurnParsing(self.reasoning, opening, family,
                           MappingProxyType({t.function.name: t.function.parameters or {} for t in tools.tools}))

    async def complete(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """The whole response."""
        if body.use_beam_search:
            return await self._beam_search(body)
        run = await self.start(body)
        final = await self.finish(run)
        choices = []
        for c in final.outputs:
            turn = run.parsing.whole(c.text, c.token_ids)
            message: dict[str, Any] = {"role": "assistant", "content": turn.content}
            if turn.thinking is not None and body.include_reasoning:
                message["reasoning_content"] = turn.thinking
            finish_reason = c.finish_reason
            if turn.calls:
                message["tool_calls"] = [{"id": call_id(), "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}}
                                         for call in turn.calls]
                finish_reason = "tool_calls"
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.token_ids, c.logprobs, body),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {"id": run.response_id, "object": "chat.completion", "created": now(),
                    "model": self.answering(body), "choices": choices,
                    "usage": usage(len(run.prompt_ids), completion_tokens, cached_tokens([final]))}
        if final.kv_transfer_params is not None:
            response["kv_transfer_params"] = final.kv_transfer_params
        return response

    async def finish(self, run: ChatRun) -> RequestOutput:
        """The whole output of `run` (its ticket released at the end)."""
        final: Optional[RequestOutput] = None
        try:
            async for output in run.outputs:
                final = output if final is None else merge_outputs(final, output)
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        finally:
            run.ticket.release()
        assert final is not None
        return final

    async def _beam_search(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """A use_beam_search response: the n best hypotheses of the assistant's reply (engine/beam_search.py)."""
        self.limits.check(body)
        self.check_images(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            if body.tools:
                raise ValueError("beam search cannot honour tools: leave them unset with use_beam_search")
            if self.harmony is not None:  # its hypotheses would come back unread: channels and all as text
                raise ValueError("use_beam_search is not supported for GPT-OSS's harmony format yet")
            params = body.beam_search_params(max_tokens if max_tokens is not None else 16)
            ticket = self.engine.reserve(params.beam_width)
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        try:
            _, token_ids = await asyncio.to_thread(self.prompt, body.messages, body.add_generation_prompt, None,
                                                   body.chat_template_kwargs)
            (result,) = await run_beam_search(self.engine, [token_ids], params, self.adapter_of(body.model))
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        finally:
            ticket.release()
        choices = [{"index": rank, "message": {"role": "assistant", "content": sequence.text}, "logprobs": None,
                    "finish_reason": sequence.finish_reason, "stop_reason": None}
                   for rank, sequence in enumerate(result.sequences[:body.n])]
        completion_tokens = sum(len(s.tokens) for s in result.sequences[:body.n])
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
                "model": self.answering(body), "choices": choices,
                "usage": usage(len(token_ids), completion_tokens)}

    def _logprobs(self, token_ids: list[int], entries: Optional[list[LogprobsDict]],
                  body: ChatCompletionRequest) -> Optional[dict[str, Any]]:
        if not body.logprobs or entries is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, entries):
            text = entry[token_id].decoded_token  # decoded once, by the engine's output processor
            top = [{"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
                   for _, lp in top_entries(entry, body.top_logprobs or 0)]
            content.append({"token": text, "logprob": entry[token_id].logprob, "bytes": list(text.encode()),
                            "top_logprobs": top})
        return {"content": content}

    async def stream(self, body: ChatCompletionRequest) -> AsyncIterator[str]:
        """The SSE events of a streamed response (admission errors are raised before the first one)."""
        run = await self.start(body)
        run.outputs = await self.primed(run)
        return self._events(run, body)

    @staticmethod
    async def primed(run: ChatRun) -> AsyncIterator[RequestOutput]:
        """`run`'s outputs, once the first has come (admission errors raise here, before any byte is
        sent); the ticket is released if that raises."""
        try:
            return await primed(run.outputs, _FIELDS)
        except BaseException:
            run.ticket.release()
            raise

    async def _events(self, run: ChatRun, body: ChatCompletionRequest) -> AsyncIterator[str]:
        created = now()
        tracker = ChoiceTracker()
        turns = {i: run.parsing.stream() for i in range(body.n)}
        response_id, outputs, ticket = run.response_id, run.outputs, run.ticket
        completion_tokens = 0
        last: Optional[RequestOutput] = None

        def chunk(choices: list[dict[str, Any]], usage_: Optional[dict[str, Any]] = None) -> str:
            return stream_chunk(response_id, "chat.completion.chunk", created, self.answering(body), choices, usage_)

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(body.n)])
            async for output in outputs:
                last = output
                choices = []
                for completion in output.outputs:
                    choice = self._delta_choice(body, tracker, completion, turns[completion.index])
                    if choice is not None:
                        completion_tokens += choice.pop("_new_tokens")
                        choices.append(choice)
                if choices:
                    yield chunk(choices)
            if body.include_usage:
                yield chunk([], usage(len(run.prompt_ids), completion_tokens, cached_tokens([last])))
        except STREAM_ERRORS as exc:
            yield sse_error(exc)
        finally:
            ticket.release()
            await outputs.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE

    def _delta_choice(self, body: ChatCompletionRequest, tracker: ChoiceTracker, completion: CompletionOutput,
                      turn: TurnStream) -> Optional[dict[str, Any]]:
        index = completion.index
        token_ids, entries = completion.token_ids, completion.logprobs
        if not tracker.take(index, completion) or not (completion.text or token_ids or completion.finished):
            return None
        thinking, text, calls = turn.push(completion.text, completion.token_ids, completion.finished)
        delta: dict[str, Any] = {}
        if thinking and body.include_reasoning:
            delta["reasoning_content"] = thinking
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [call_delta(call) for call in calls]
        finish_reason = "tool_calls" if completion.finished and turn.called else completion.finish_reason
        return {"index": index, "delta": delta, "logprobs": self._logprobs(token_ids, entries, body),
                "finish_reason": finish_reason, "_new_tokens": len(token_ids)}


def call_delta(call: CallDelta) -> dict[str, Any]:
    """A streamed call piece as OpenAI's `tool_calls` delta: id, type and name on a call's first piece."""
    function: dict[str, Any] = {"arguments": call.arguments}
    piece: dict[str, Any] = {"index": call.index, "function": function}
    if call.id is not None:
        piece.update(id=call.id, type="function")
    if call.name is not None:
        function["name"] = call.name
    return piece
