"""Gated activations."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU on a fused [gate | up] input: silu(gate) * up."""

    kernels: Any = None  # CpuKernels when the fused native kernel is used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split the last dimension in half and gate the second half with the first."""
        if self.kernels is not None and x.dim() == 2 and x.is_contiguous():
            return self.kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU on a fused [gate | up] input: gelu_tanh(gate) * up (Gemma)."""

    kernels: Any = None  # CpuKernels when the fused native kernel is used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split the last dimension in half and gate the second half with the first."""
        if self.kernels is not None and x.dim() == 2 and x.is_contiguous():
            return self.kernels.gelu_tanh_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
