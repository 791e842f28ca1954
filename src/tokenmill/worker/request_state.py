"""A step's batch items: one request's chunk as the runner computes it (no torch).

The runner's own rows of every live request, from which it builds them, live in `worker/input_batch.py`
(`InputBatch`); the draft model and probes build their items directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.sampling_params import SamplingParams

# The id a placeholder chunk carries on the host: the token the previous step sampled for the request, which
# only the device holds yet (async scheduling, core/scheduler.py); the runner fills it in on the device.
PLACEHOLDER = -1


@dataclass(slots=True)
class BatchItem:
    """One request's chunk as the runner computes it: `token_ids` at positions start .. start+len-1.

    `prompt_token_ids` and `output_token_ids` are the request's tokens so far (read only: penalties
    and min_tokens use them); a `placeholder` chunk's token is not among them yet. When `sample` is true
    the runner samples the next token from the chunk's last position; `spec_token_ids` are the proposals
    at the end of `token_ids` to verify.

    Items from `InputBatch.apply` hold numpy arrays where lists are typed: `block_ids` are int32 rows of
    the step's own copy of the tables (valid for good), `prompt_token_ids` and `output_token_ids` int64
    views of the request's row in the input batch, valid until the next step is applied.
    """

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: Sequence[Sequence[int]]  # per KV cache group
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
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

