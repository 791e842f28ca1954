"""The one request model: prompt + output tokens, and how many of them the KV cache holds."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import Optional, Union

from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.sampling_params import SamplingParams

_arrival_counter = itertools.count()


@dataclass(frozen=True)
class TenantShare:
    """The tenant a request is served for, and its weight: the scheduler shares its token budget between tenants
    in proportion to their weights (core/fair_share.py)."""

    name: str
    weight: float = 1.0


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request's own step work failed; the rest of the batch went on

    @property
    def finished(self) -> bool:
        """True for every finished state."""
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


def tokens_in_range(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Token ids in [start, end) of prompt + output, without concatenating the two."""
    n_prompt = len(prompt)
    if end <= n_prompt:
        return prompt[start:end]
    if start >= n_prompt:
        return output[start - n_prompt:end - n_prompt]
    return prompt[start:] + output[:end - n_prompt]


class Request:
    """A sequence the engine is generating for.

    Invariant: 0 <= num_computed_tokens <= num_tokens. Each step the scheduler grants tokens so that
    num_computed_tokens catches up with num_tokens; when it does, the runner samples one more token
    (so a running request normally has num_computed_tokens == num_tokens - 1 between steps).
    Prefill, chunked prefill, decode and recompute after preemption (reset to 0) are the same arithmetic.

    Speculative tokens are proposals appended after the sequence for one step: the scheduler computes
    them with the rest, the runner keeps the leading ones the target agrees with, and
    num_computed_tokens falls back past the rejected ones (whose KV slots are then released).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: Optional[float] = None,
        num_samples_to_fork: int = 0,
        images: tuple[ImageFeature, ...] = (),
        background: bool = False,
        tenant: Optional[TenantShare] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.images = images  # in prompt order; their placeholders lie in the prompt
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.background = background  # a batch job's line: queued below every interactive request
        self.tenant = tenant  # who it is served for: the scheduler shares the engine between tenants
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = next(_arrival_counter)
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []  # proposals for the next step only; never part of num_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: Union[None, int, str] = None
        self.num_preemptions = 0
        self.first_scheduled_time: Optional[float] = None
        self.num_cached_tokens: Optional[int] = None  # prefix-cache hit at first scheduling (not after preemption)
        self.num_times_passed_over = 0  # by the lpm policy, which must not starve anyone
        # n>1: samples 1..n-1 are forked from this request once its prompt is computed.
        self.num_samples_to_fork = num_samples_to_fork
        # prefill/decode disaggregation: where to write the prompt's full blocks once they are computed,
        # and how many were (None until the step that completes the prompt is scheduled)
        self.kv_export_path: Optional[str] = None
        self.kv_exported_blocks: Optional[int] = None

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length: what num_computed_tokens catches up with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request will ever hold in the KV cache."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def needs_last_token(self) -> bool:
        """Whether the runner needs this request's last token on the host before it samples the next one: a
        grammar's mask or penalties read it, min_tokens counts it while it matters, and an n>1 parent forks
        its samples from it. Async scheduling schedules such a request only once its last token is known."""
        params = self.sampling_params
        return (params.structured_output is not None or params.uses_penalties or self.num_samples_to_fork > 0
                or len(self.output_token_ids) < params.min_tokens)

    @property
    def priority_key(self) -> tuple[bool, int, int]:
        """Sort key: smaller is served first: interactive before background (batch) work whatever the policy, then
        vLLM's convention (lower priority value wins, then FCFS)."""
        return (self.background, self.priority, self.arrival_seq)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) of prompt + output."""
        return tokens_in_range(self.prompt_token_ids, self.output_token_ids, start, end)

    def check_stop_token(self, token_id: int) -> bool:
        """Record and return whether `token_id` (just appended) ends the request by token rules.

        EOS and stop_token_ids count only once min_tokens are generated; max_tokens always counts.
        """
        params = self.sampling_params
        num_out = len(self.output_token_ids)
        if num_out > params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
            if token_id in params.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
                return True
        if num_out >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def fork(self, child_id: str, sampling_params: SamplingParams, num_computed_tokens: int) -> "Request":
        """A new sample of the same prompt that starts with `num_computed_tokens` already cached."""
        child = Request(child_id, self.prompt_token_ids, sampling_params, self.max_tokens,
                        self.eos_token_ids, self.priority, self.arrival_time, images=self.images,
                        background=self.background, tenant=self.tenant)
        child.arrival_seq = self.arrival_seq
        child.num_computed_tokens = num_computed_tokens
        child.status = RequestStatus.RUNNING
        return child

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
