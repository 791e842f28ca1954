"""What users get back, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

# One position's log-probabilities: {token_id: Logprob}, the chosen token first, then the top-N.
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    """A token's log-probability, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One sample of a request.

    While the request runs, `text` holds back any tail that could still become a stop string,
    so streamed text never contains (part of) one.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[LogprobsDict]] = None
    finish_reason: Optional[str] = None  # 'stop' | 'length' | 'abort' | 'error'
    stop_reason: Union[None, int, str] = None

    @property
    def finished(self) -> bool:
        """True once this sample is done."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request (time.monotonic() seconds; None = not yet)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache when first scheduled
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and every sample so far."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: Optional[list[Optional[LogprobsDict]]] = None
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None  # set when the request failed (finished, every sample 'error')
    delta: bool = False  # True: outputs and prompt_logprobs hold only what is new since the last output
    kv_transfer_params: Optional[dict] = None  # a finished prefill-server request's: where its KV blocks are


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output saying what `older` and then `newer` said: `newer` itself when cumulative, else the
    two deltas joined (text, token ids and logprobs concatenated per sample; `newer`'s state)."""
    if not newer.delta:
        return newer
    samples = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        first = samples.get(c.index)
        if first is None:
            samples[c.index] = c
            continue
        logprobs = None if c.logprobs is None else (first.logprobs or []) + c.logprobs
        samples[c.index] = CompletionOutput(c.index, first.text + c.text, first.token_ids + c.token_ids,
                                            c.cumulative_logprob, logprobs, c.finish_reason or first.finish_reason,
                                            c.stop_reason if c.finish_reason else first.stop_reason)
    prompt_logprobs = older.prompt_logprobs
    if newer.prompt_logprobs:
        prompt_logprobs = (prompt_logprobs or []) + newer.prompt_logprobs
    return RequestOutput(newer.request_id, newer.prompt, newer.prompt_token_ids,
                         [samples[i] for i in sorted(samples)], newer.finished, prompt_logprobs,
                         newer.metrics, newer.error, True, newer.kv_transfer_params)


@dataclass
class EmbeddingOutput:
    """One input's vector."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt, shaped like vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    """One pair's similarity."""

    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one (text_1, text_2) pair, shaped like vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
