"""Turns scheduler updates into RequestOutputs: detokenise, match stop strings, gather logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.core.sched_output import RequestUpdate, TokenLogprobs
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.stop_strings import find_stop_string, partial_stop_suffix
from tokenmill.outputs import CompletionOutput, Logprob, LogprobsDict, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list[LogprobsDict]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    sent_text: int = 0  # delta outputs: how much of the text and tokens earlier outputs carried
    sent_tokens: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[LogprobsDict]]] = None
    error: Optional[str] = None  # why the request failed; then every sample is finished
    sent_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


def sample_request_id(request_id: str, index: int) -> str:
    """Internal id of sample `index` of an n>1 request (sample 0 keeps the request's own id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class OutputProcessor:
    """Keeps the user-visible state of every live request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self._sample_of: dict[str, tuple[str, int]] = {}

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
            params: SamplingParams, arrival_time: float) -> None:
        """Start tracking a request and its n samples."""
        samples = []
        for index in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            sample = _Sample(index, detok)
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            samples.append(sample)
            self._sample_of[sample_request_id(request_id, index)] = (request_id, index)
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params, samples,
                              RequestMetrics(arrival_time))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.states[request_id] = state

    def internal_ids(self, request_id: str) -> list[str]:
        """Scheduler ids of all samples of a request."""
        state = self.states.get(request_id)
        return [] if state is None else [sample_request_id(request_id, i) for i in range(len(state.samples))]

    def drop(self, request_id: str) -> None:
        """Stop tracking a request (after abort)."""
        for internal in self.internal_ids(request_id):
            self._sample_of.pop(internal, None)
        self.states.pop(request_id, None)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one step's updates. Returns (outputs of touched requests, internal ids stopped by a stop
        string, internal ids still live whose request failed: the scheduler must end them).

        A request whose update carries an error, or whose own output processing raises, fails as a
        whole (every sample); the other requests are unaffected."""
        touched: dict[str, _RequestState] = {}
        stopped: list[str] = []
        failed: list[str] = []
        now = time.monotonic()
        for update in updates:
            owner = self._sample_of.get(update.request_id)
            if owner is None:
                continue
            state = self.states[owner[0]]
            sample = state.samples[owner[1]]
            touched[state.request_id] = state
            metrics = state.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = update.first_scheduled_time
            if metrics.num_cached_tokens is None:
                metrics.num_cached_tokens = update.num_cached_tokens
            if update.new_token_ids:
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
            if update.error is not None:
                state.error = state.error or update.error
                continue
            try:
                self._apply(state, sample, update, stopped)
            except Exception as exc:
                state.error = state.error or f"{type(exc).__name__}: {exc}"
        for state in touched.values():
            if state.error is not None:
                failed.extend(self._fail(state))
            if state.finished:
                state.metrics.finished_time = now
        outputs = [self._output(state) for state in touched.values()]
        for state in touched.values():
            if state.finished:
                self.drop(state.request_id)
        return outputs, [rid for rid in stopped if rid not in failed], failed

    def _apply(self, state: _RequestState, sample: _Sample, update: RequestUpdate, stopped: list[str]) -> None:
        if update.new_prompt_logprobs and sample.index == 0:
            self._add_prompt_logprobs(state, update)
        for token, entry in zip(update.new_token_ids, update.new_logprobs or [None] * len(update.new_token_ids)):
            if sample.finish_reason is not None:
                break
            if self._append_token(state, sample, token, entry):
                stopped.append(update.request_id)
        if update.finish_reason is not None and sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = update.finish_reason, update.stop_reason

    @staticmethod
    def _fail(state: _RequestState) -> list[str]:
        """Finish every sample of a failed request; returns the internal ids of those still live."""
        live = [sample_request_id(state.request_id, s.index) for s in state.samples if s.finish_reason is None]
        for sample in state.samples:
            sample.finish_reason, sample.stop_reason = "error", None
        return live

    def _append_token(self, state: _RequestState, sample: _Sample, token: int,
                      entry: Optional[TokenLogprobs]) -> bool:
        sample.token_ids.append(token)
        if entry is not None and sample.logprobs is not None:
            sample.logprobs.append(self._logprobs_dict(entry))
            sample.cumulative_logprob += entry.logprob
        delta = sample.detokenizer.push(token)
        sample.text += delta
        stops = state.params.stop_strings
        if not stops or not delta:
            return False
        match = find_stop_string(sample.text, len(delta), stops)
        if match is None:
            return False
        index, stop = match
        end = index + len(stop) if state.params.include_stop_str_in_output else index
        sample.text = sample.text[:end]
        sample.finish_reason, sample.stop_reason = "stop", stop
        return True

    def _add_prompt_logprobs(self, state: _RequestState, update: RequestUpdate) -> None:
        assert state.prompt_logprobs is not None
        for offset, entry in enumerate(update.new_prompt_logprobs):
            position = update.prompt_logprobs_start + offset
            if position == len(state.prompt_logprobs):  # positions already seen (recompute) are skipped
                state.prompt_logprobs.append(self._logprobs_dict(entry))

    def _logprobs_dict(self, entry: TokenLogprobs) -> LogprobsDict:
        result = {entry.token_id: Logprob(entry.logprob, entry.rank, self._token_text(entry.token_id))}
        for rank, (token, logprob) in enumerate(entry.top, start=1):
            if token not in result:
                result[token] = Logprob(logprob, rank, self._token_text(token))
        return result

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _output(self, state: _RequestState) -> RequestOutput:
        """The request's output: everything so far, or (output_kind "delta") only what is new. While it
        runs, text that could still become a stop string is held back (never sent, then taken back)."""
        delta = state.params.output_kind == "delta"
        completions = []
        for s in state.samples:
            text = s.text
            if s.finish_reason is None and state.params.stop_strings:
                held = partial_stop_suffix(text, state.params.stop_strings)
                text = text[:len(text) - held]
            token_ids, logprobs = s.token_ids, s.logprobs
            if delta:
                text, s.sent_text = text[s.sent_text:], max(s.sent_text, len(text))
                token_ids, logprobs = token_ids[s.sent_tokens:], None if logprobs is None else logprobs[s.sent_tokens:]
                s.sent_tokens = len(s.token_ids)
            else:
                token_ids, logprobs = list(token_ids), None if logprobs is None else list(logprobs)
            completions.append(CompletionOutput(s.index, text, token_ids, s.cumulative_logprob, logprobs,
                                                s.finish_reason, s.stop_reason))
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None:
            start = state.sent_prompt_logprobs if delta else 0
            prompt_logprobs = prompt_logprobs[start:]
            state.sent_prompt_logprobs = len(state.prompt_logprobs)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             state.finished, prompt_logprobs, state.metrics, state.error, delta)
