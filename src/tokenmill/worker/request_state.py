"""The runner's own per-request state, rebuilt from the step contract's diffs (no torch).

A runner (in this process or in a worker process) sees each request once in full (`NewRequestData`)
and afterwards only what changed (`CachedRequestData`). `RequestStates.apply` keeps its copy of every
live request's tokens and block table and turns the step's chunks into `BatchItem`s to compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.request import tokens_in_range
from tokenmill.sampling_params import SamplingParams

# The id a placeholder chunk carries on the host: the token the previous step sampled for the request, which
# only the device holds yet (async scheduling, core/scheduler.py); the runner fills it in on the device.
PLACEHOLDER = -1


@dataclass(slots=True)
class RequestState:
    """What the runner knows of one live request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    images: tuple[ImageFeature, ...] = ()

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) of prompt + output."""
        return tokens_in_range(self.prompt_token_ids, self.output_token_ids, start, end)


@dataclass(slots=True)
class BatchItem:
    """One request's chunk as the runner computes it: `token_ids` at positions start .. start+len-1.

    `prompt_token_ids` and `output_token_ids` are the request's tokens so far (read only: penalties
    and min_tokens use them); a `placeholder` chunk's token is not among them yet. When `sample` is true
    the runner samples the next token from the chunk's last position; `spec_token_ids` are the proposals
    at the end of `token_ids` to verify.
    """

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[list[int]]  # per KV cache group
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)
    images: tuple[ImageFeature, ...] = ()  # the request's images (their placeholders lie in the prompt)
    # the chunk is one token, the one the previous step sampled: `token_ids` is [PLACEHOLDER] (see above)
    placeholder: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens computed for this request in this step."""
        return len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the runner must return log-probabilities for this chunk's prompt positions."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.start < len(self.prompt_token_ids))


class RequestStates:
    """Every live request's state on the runner side, kept in step with the scheduler by `apply`."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def apply(self, schedule: SchedulerOutput) -> list[BatchItem]:
        """Bring the states up to date with `schedule` (in the contract's order) and return its chunks
        as batch items, in batch order."""
        for request_id in schedule.finished_request_ids:
            self.states.pop(request_id, None)
        for new in schedule.new_requests:
            self.states[new.request_id] = RequestState(new.request_id, list(new.prompt_token_ids),
                                                       list(new.output_token_ids), new.sampling_params,
                                                       [list(t) for t in new.block_ids], new.images)
        for diff in schedule.cached_requests:
            state = self.states.get(diff.request_id)
            if state is None:
                raise RuntimeError(f"step contract broken: request {diff.request_id!r} changed but the runner "
                                   f"never saw it")
            state.output_token_ids.extend(diff.new_token_ids)
            for table, start, new_blocks in zip(state.block_ids, diff.block_ids_start, diff.new_block_ids):
                del table[start:]
                table.extend(new_blocks)
        items = []
        for chunk in schedule.scheduled:
            state = self.states[chunk.request_id]
            spec = chunk.spec_token_ids
            real_end = chunk.start + chunk.num_tokens - len(spec)
            known = len(state.prompt_token_ids) + len(state.output_token_ids)
            # Invariant (core/scheduler.py): a chunk past the known tokens is one token, the placeholder
            placeholder = real_end > known
            if placeholder and (real_end != known + 1 or chunk.num_tokens != 1):
                raise RuntimeError(f"step contract broken: request {chunk.request_id!r} computes [{chunk.start}, "
                                   f"{real_end}) but the runner knows {known} tokens")
            token_ids = [PLACEHOLDER] if placeholder else state.token_ids_range(chunk.start, real_end) + spec
            items.append(BatchItem(chunk.request_id, token_ids, chunk.start, state.block_ids, chunk.sample,
                                   state.sampling_params, state.prompt_token_ids, state.output_token_ids, spec,
                                   state.images, placeholder))
        return items
