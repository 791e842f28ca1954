"""The contract between scheduler and runner: what to compute this step, and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenmill.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions start .. start+len-1.

    `prompt_token_ids` and `output_token_ids` are read-only views of the request (the runner uses
    them for penalties). When `sample` is true this chunk reaches the end of the sequence and the
    runner samples the next token from the logits of its last position.

    `spec_token_ids` are speculative proposals: the last len(spec_token_ids) entries of `token_ids`,
    placed after the sequence's real tokens. The runner verifies them against the target's logits at
    the chunk's last len(spec_token_ids) + 1 positions (`sample` is then always true).
    """

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed for this request in this step."""
        return len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the runner must return log-probabilities for this chunk's prompt positions."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.start < len(self.prompt_token_ids))


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one forward pass: a flattened, unpadded token batch.

    `finished_request_ids` names requests gone since the last step, so the runner drops their state.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    # Second KV tier copies, done before the forward pass in this order: saves, then loads.
    kv_saves: list[tuple[int, int]] = field(default_factory=list)  # (pool block, tier slot)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)  # (tier slot, pool block)

    @property
    def total_num_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing is to be computed."""
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Log-probability of one chosen token, its rank, and the top-N alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, keyed by request id.

    `sampled_token_ids[rid]` lists the tokens the step adds to the sequence: the accepted speculative
    tokens (a prefix of the proposals) and then one token the target sampled, so a request without
    proposals gets exactly one. `logprobs[rid]`, when asked for, has one entry per token.
    `failed[rid]` says why the step's work for that request raised (its sampling, grammar or logprobs):
    the request ends with an error and has no other entry; the rest of the batch is unaffected.
    `prompt_logprobs[rid]` covers the chunk's positions in order; entry j scores the token at
    position start + j + 1 (the first prompt token has no logprob and is never included).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)  # requests whose output grammar is complete
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine to turn into user-visible output."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    error: Optional[str] = None  # why the request failed (finish_reason "error")
    first_scheduled_time: Optional[float] = None
    num_draft_tokens: int = 0  # speculative tokens verified this step
    num_accepted_tokens: int = 0  # of those, the ones the target accepted
