"""The per-row inputs of one sampling call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One request to sample for: its controls, its own generator (when seeded) and its tokens so far."""

    params: SamplingParams
    generator: Optional[torch.Generator]
    prompt_token_ids: Sequence[int]  # a list, or an int64 array (the runner's input batch row)
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...]


def padded_ids(lists: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Stack ragged id lists (or int arrays) into [len(lists), max_len] padded with `pad` (at least one
    column)."""
    width = max(1, max((len(x) for x in lists), default=0))
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for row, ids in enumerate(lists):
        if len(ids):
            out[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    return out.to(device)
