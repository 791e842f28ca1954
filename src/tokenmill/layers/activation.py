"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU on a fused [gate | up] input: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split the last dimension in half and gate the second half with the first."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
