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
    finish_reason: Optional[str] = None  # 'stop' | 'length' | 'abort'
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
