"""POST /v1/completions: prompts in, text out, streamed or whole."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

from tokenmill.engine.admission import Ticket
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import CompletionOutput, LogprobsDict, RequestOutput, merge_outputs
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.request_limits import RequestLimits
from tokenmill.server.serving_beam import run_beam_search
from tokenmill.server.serving_common import (
    SSE_DONE, STREAM_ERRORS, AdapterLookup, APIError, ChoiceTracker, bad_request, merge, new_id, now, primed, sse_error,
    stream_chunk, top_entries, usage, cached_tokens, with_adapter)

_FIELDS = set(CompletionRequest.model_fields)


class CompletionPrompt:
    """One prompt of a completions request, tokenised; or given as input embeddings (`embeds`, a tensor; its
    `token_ids` then placeholders, one per row)."""

    def __init__(self, text: Optional[str], token_ids: list[int], embeds: Any = None) -> None:
        self.text, self.token_ids, self.embeds = text, token_ids, embeds


class EmbedsItem:
    """A prompt of the request's prompt_embeds, still base64."""

    def __init__(self, encoded: str) -> None:
        self.encoded = encoded


def prompt_items(body: CompletionRequest) -> list[Any]:
    """The request's prompts: those of prompt_embeds first (vLLM's order), then prompt's: a string, a list of
    strings, token ids, or a list of token-id lists."""
    prompt, embeds = body.prompt, body.prompt_embeds
    if prompt is None and embeds is None:
        raise APIError(400, "prompt (or prompt_embeds) is required", param="prompt")
    items: list[Any] = [EmbedsItem(e) for e in ([embeds] if isinstance(embeds, str) else embeds or [])]
    if embeds is not None and not items:
        raise APIError(400, "prompt_embeds must not be empty", param="prompt_embeds")
    if items and body.echo:
        raise APIError(400, "echo: a prompt given as embeddings has no text to echo", param="echo")
    if isinstance(prompt, str):
        items.append(prompt)
    elif prompt and all(isinstance(x, int) for x in prompt):
        items.append(prompt)
    elif prompt is not None:
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        items.extend(prompt)
    return items


def tokenize_prompts(items: list[Any], tokenizer: Any) -> list[CompletionPrompt]:
    """Each prompt with its token ids (text prompts tokenised, prompt_embeds decoded)."""
    result = []
    for item in items:
        if isinstance(item, EmbedsItem):
            from tokenmill.engine.prompt_embeds import PLACEHOLDER_ID, decode_prompt_embeds, embeds_length

            try:
                embeds = decode_prompt_embeds(item.encoded)
            except ValueError as exc:
                raise APIError(400, str(exc), param="prompt_embeds") from None
            result.append(CompletionPrompt(None, [PLACEHOLDER_ID] * embeds_length(embeds), embeds))
        elif isinstance(item, str):
            result.append(CompletionPrompt(item, tokenizer(item).input_ids))
        else:
            if not item:
                raise APIError(400, "prompt token id lists must not be empty", param="prompt")
            result.append(CompletionPrompt(None, list(item)))
    return result


class CompletionHandler:
    """Runs a completions request on the engine and shapes the OpenAI response."""

    def __init__(self, engine: AsyncEngine, model_name: str, limits: RequestLimits = RequestLimits(),
                 adapter_of: AdapterLookup = lambda name: None) -> None:
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.adapter_of = adapter_of  # the LoRA adapter a body's `model` names (None: the base model)

    def answering(self, body: Any) -> str:
        """The model a response names: the LoRA adapter the body asked for, else the base model (as vLLM)."""
        adapter = self.adapter_of(body.model)
        return adapter.lora_name if adapter is not None else self.model_name

    async def _start(self, body: CompletionRequest
                     ) -> tuple[str, list[CompletionPrompt], list[AsyncIterator[RequestOutput]], Ticket]:
        """Check the request, hold admission room for it, tokenise its prompts off the event loop and
        start its engine requests. The caller releases the ticket when the response ends."""
        if body.use_beam_search:  # a streamed one: beam search answers whole
            raise APIError(400, "beam search cannot honour stream: leave it unset with use_beam_search",
                           param="stream")
        self.limits.check(body)
        items = prompt_items(body)
        self.limits.check_prompts(len(items))
        want_prompt_logprobs = body.echo and body.logprobs is not None
        try:
            params = with_adapter(body.sampling_params(body.max_tokens, body.logprobs,
                                                       body.logprobs if want_prompt_logprobs else None),
                                  self.adapter_of(body.model))
            ticket = self.engine.reserve(len(items) * body.n)
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        try:
            prompts = await asyncio.to_thread(tokenize_prompts, items, self.engine.tokenizer)
            if body.truncate_prompt_tokens is not None:
                if any(p.embeds is not None for p in prompts):
                    raise ValueError("truncate_prompt_tokens: not with prompt_embeds (truncate the tensor)")
                prompts = [CompletionPrompt(p.text, body.truncated(p.token_ids, self.engine.info.max_model_len))
                           for p in prompts]
        except ValueError as exc:
            ticket.release()
            raise bad_request(exc, _FIELDS) from None
        except BaseException:
            ticket.release()
            raise
        request_id = new_id("cmpl")
        streams = [self.engine.generate(f"{request_id}-{i}", p.token_ids if p.embeds is None else [], params,
                                        p.text, body.priority, prompt_embeds=p.embeds)
                   for i, p in enumerate(prompts)]
        return request_id, prompts, streams, ticket

    async def complete(self, body: CompletionRequest) -> dict[str, Any]:
        """The whole response."""
        if body.use_beam_search:
            return await self._beam_search(body)
        response_id, prompts, streams, ticket = await self._start(body)
        final: dict[int, RequestOutput] = {}
        try:
            async for index, output in merge(streams):
                final[index] = merge_outputs(final[index], output) if index in final else output
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        finally:
            ticket.release()
        choices = []
        completion_tokens = 0
        for index, prompt in enumerate(prompts):
            output = final[index]
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                choices.append(self._choice(body, prompt, output, completion, index * body.n + completion.index))
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        response = {"id": response_id, "object": "text_completion", "created": now(), "model": self.answering(body),
                    "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens(final.values()))}
        transfer = final[0].kv_transfer_params
        if transfer is not None:
            response["kv_transfer_params"] = transfer
        return response

    async def _beam_search(self, body: CompletionRequest) -> dict[str, Any]:
        """A use_beam_search response: for each prompt, its n best hypotheses (engine/beam_search.py)."""
        self.limits.check(body)
        if body.prompt_embeds is not None:
            raise APIError(400, "use_beam_search: not with prompt_embeds", param="prompt_embeds")
        items = prompt_items(body)
        self.limits.check_prompts(len(items))
        try:
            params = body.beam_search_params(body.max_tokens if body.max_tokens is not None else 16)
            ticket = self.engine.reserve(len(items) * params.beam_width)
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        try:
            prompts = await asyncio.to_thread(tokenize_prompts, items, self.engine.tokenizer)
            results = await run_beam_search(self.engine, [p.token_ids for p in prompts], params,
                                            self.adapter_of(body.model))
        except ValueError as exc:
            raise bad_request(exc, _FIELDS) from None
        finally:
            ticket.release()
        choices, completion_tokens = [], 0
        for index, result in enumerate(results):
            for rank, sequence in enumerate(result.sequences[:body.n]):
                completion_tokens += len(sequence.tokens)
                choices.append({"index": index * body.n + rank, "text": sequence.text, "logprobs": None,
                                "finish_reason": sequence.finish_reason, "stop_reason": None})
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": self.answering(body),
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def _choice(self, body: CompletionRequest, prompt: CompletionPrompt, output: RequestOutput,
                completion: CompletionOutput, index: int) -> dict[str, Any]:
        text = completion.text
        logprobs = None
        if body.echo:
            text = self._prompt_text(prompt) + text
        if body.logprobs is not None:
            entries: list[Optional[LogprobsDict]] = list(completion.logprobs or [])
            token_ids = list(completion.token_ids)
            if body.echo:
                entries = list(output.prompt_logprobs or [None] * len(prompt.token_ids)) + entries
                token_ids = list(prompt.token_ids) + token_ids
            logprobs = self._logprobs(token_ids, entries, body.logprobs)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    def _prompt_text(self, prompt: CompletionPrompt) -> str:
        return prompt.text if prompt.text is not None else self.engine.tokenizer.decode(prompt.token_ids)

    def _logprobs(self, token_ids: list[int], entries: list[Optional[LogprobsDict]], count: int,
                  offset: int = 0) -> dict[str, Any]:
        tokenizer = self.engine.tokenizer
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            # the engine already decoded every scored token; only the first prompt token has no entry
            text = tokenizer.decode([token_id]) if entry is None else entry[token_id].decoded_token
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(entry[token_id].logprob)
            top = {lp.decoded_token: lp.logprob for _, lp in top_entries(entry, count)}
            top.setdefault(text, entry[token_id].logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    async def stream(self, body: CompletionRequest) -> AsyncIterator[str]:
        """The SSE events of a streamed response (admission errors are raised before the first one)."""
        response_id, prompts, streams, ticket = await self._start(body)
        try:
            outputs = await primed(merge(streams), _FIELDS)
        except BaseException:
            ticket.release()
            raise
        return self._events(response_id, body, prompts, outputs, ticket)

    async def _events(self, response_id: str, body: CompletionRequest, prompts: list[CompletionPrompt],
                      outputs: AsyncIterator[tuple[int, RequestOutput]], ticket: Ticket) -> AsyncIterator[str]:
        created = now()
        tracker = ChoiceTracker()
        completion_tokens = 0
        echoed: set[int] = set()
        text_offsets: dict[int, int] = {}  # where each choice's next token starts in its whole text
        last: dict[int, RequestOutput] = {}  # each prompt's latest output

        def chunk(choices: list[dict[str, Any]], usage_: Optional[dict[str, Any]] = None) -> str:
            return stream_chunk(response_id, "text_completion", created, self.answering(body), choices, usage_)

        try:
            async for prompt_index, output in outputs:
                last[prompt_index] = output
                choices = []
                for completion in output.outputs:
                    index = prompt_index * body.n + completion.index
                    if not tracker.take(index, completion):
                        continue
                    text, token_ids, entries = completion.text, completion.token_ids, completion.logprobs
                    completion_tokens += len(token_ids)
                    prefix = ""
                    if body.echo and index not in echoed:
                        echoed.add(index)
                        prefix = self._prompt_text(prompts[prompt_index])
                    if not (text or prefix or token_ids or completion.finished):
                        continue
                    logprobs = None
                    if body.logprobs is not None:
                        start = text_offsets.get(index, len(prefix))
                        logprobs = self._logprobs(token_ids, list(entries or []), body.logprobs, start)
                        text_offsets[index] = start + sum(len(t) for t in logprobs["tokens"])
                    choices.append({"index": index, "text": prefix + text, "logprobs": logprobs,
                                    "finish_reason": completion.finish_reason,
                                    "stop_reason": completion.stop_reason})
                if choices:
                    yield chunk(choices)
            if body.include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                yield chunk([], usage(prompt_tokens, completion_tokens, cached_tokens(last.values())))
        except STREAM_ERRORS as exc:
            yield sse_error(exc)
        finally:
            ticket.release()
            await outputs.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE
