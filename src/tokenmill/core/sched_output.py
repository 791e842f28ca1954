"""The contract between scheduler and runner: what to compute this step, and what came back.

Everything here is plain data that pickles cheaply, so a step can cross a process boundary (the
multi-process executor sends it to worker processes). A request's prompt, sampling parameters and
blocks cross once, in `NewRequestData`; afterwards only what changed crosses, in `CachedRequestData`.
The runner keeps its own per-request rows (`worker/input_batch.py`) built from these; the
scheduler keeps its own. Nothing else passes between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.core.kv_connector import KVCopies
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or has forgotten): everything it needs, once.

    `output_token_ids` is non-empty for a forked sample's parent state or a request the runner had
    dropped; a request resumed after preemption is not new (see CachedRequestData).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # one block table per KV cache group (core/kv_spec.py)
    images: tuple[ImageFeature, ...] = ()  # the prompt's images (a vision-language model's), in order


@dataclass(slots=True)
class CachedRequestData:
    """What changed for a request the runner knows since it last saw it.

    `new_token_ids` are output tokens appended since (the tokens the previous step kept).
    The runner's block table of group g becomes table[:block_ids_start[g]] + new_block_ids[g]: growth
    appends, a rollback past rejected proposals truncates, and a request resumed after preemption
    replaces the whole table (block_ids_start[g] == 0). A windowed group's leading entries whose blocks
    were given back stay as they were: no query reads them.
    """

    request_id: str
    new_token_ids: list[int]
    new_block_ids: list[list[int]]
    block_ids_start: list[int]


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: compute `num_tokens` tokens at positions start .. start+num_tokens-1.

    When `sample` is true this chunk reaches the end of the sequence and the runner samples the next
    token from the logits of its last position. `spec_token_ids` are speculative proposals: the last
    len(spec_token_ids) of the chunk's tokens, placed after the sequence's real tokens; the runner
    verifies them at the chunk's last len(spec_token_ids) + 1 positions (`sample` is then true).
    """

    request_id: str
    start: int
    num_tokens: int
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class GrammarMasks:
    """Token bitmasks of the step's constrained rows (xgrammar's layout: int32 words, bit t = token t
    allowed). `rows[request_id] = (first, count)`: bitmask rows first .. first+count-1 mask that
    request's sampled positions in order (its position after proposals[:i] is row first + i); the
    positions past `count` (after a forbidden proposal or a completed grammar) are not masked."""

    bitmask: Any  # torch.int32 [rows, ceil(vocab / 32)]
    rows: dict[str, tuple[int, int]]


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs for one forward pass: a flattened, unpadded token batch.

    Order of application: forget `finished_request_ids`, add `new_requests`, apply `cached_requests`,
    do the `kv_copies` (every connector's copies out of the pool, then into it: core/kv_connector.py),
    compute `scheduled` in order, then do the copies of blocks this step computed.
    `spec_probs[request_id]` is the [len(proposals), vocab] distribution a draft drew a sampling
    request's proposals from (absent for deterministic proposals); `grammar` masks constrained rows.
    The scheduler writes all of it: `spec_probs`, `grammar` and `lora_unloads` through the parts it was
    given (core/scheduler.py's `StepAttachment`), before `schedule` returns; nobody writes it after.
    """

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    # the step's block copies, one entry per connector with any, in the scheduler's connector order
    kv_copies: list[KVCopies] = field(default_factory=list)
    spec_probs: dict[str, Any] = field(default_factory=dict)
    grammar: Optional[GrammarMasks] = None
    # LoRA adapters (their lora_int_id) the engine stopped serving: the runner frees them before the step; an
    # adapter is loaded where a request first uses it (its SamplingParams.lora_request says from where)
    lora_unloads: list[int] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing is to be computed."""
        return not self.scheduled

    def has_work(self) -> bool:
        """Whether the runner has anything to do for this step: tokens to compute, requests to add, update
        or forget, blocks to copy (tier, swap, transfer) or adapters to unload."""
        return bool(self.scheduled or self.new_requests or self.cached_requests or self.finished_request_ids
                    or self.kv_copies or self.lora_unloads)

    def copies(self, connector: str) -> Optional[KVCopies]:
        """The step's copies of `connector` (core/kv_connector.py's names), None when it has none."""
        return next((c for c in self.kv_copies if c.connector == connector), None)


@dataclass(slots=True)
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
    `completed` names requests whose output grammar completed (the engine cuts their tokens there).
    `encoder_images` and `encoder_seconds` count the step's vision-encoder work.
    `prompt_logprobs[rid]` covers the chunk's positions in order; entry j scores the token at
    position start + j + 1 (the first prompt token has no logprob and is never included).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    encoder_images: int = 0  # images the vision encoder encoded in this step (cache misses)
    encoder_seconds: float = 0.0  # and the time it took
    graphed: bool = False  # the forward pass replayed a CUDA graph (worker/cuda_graphs.py, mixed_graphs.py)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """Mark `request_id` failed (dropping what the step had recorded for it)."""
        for entries in (self.sampled_token_ids, self.logprobs, self.prompt_logprobs):
            entries.pop(request_id, None)
        self.completed.discard(request_id)
        self.failed[request_id] = f"{type(exc).__name__}: {exc}"


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
    num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache at first scheduling
    num_draft_tokens: int = 0  # speculative tokens verified this step
    num_accepted_tokens: int = 0  # of those, the ones the target accepted
