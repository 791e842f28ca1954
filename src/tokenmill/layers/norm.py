"""RMSNorm: torch's fused kernel, bit-identical in float32 to Hugging Face's Llama formula."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension.

    `weight_offset` is added to the checkpoint's weight as it loads (Gemma stores weight - 1 and scales
    by 1 + weight), so every path, native kernel included, multiplies by `weight` alone."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.weight_offset = weight_offset
        self.kernels: Any = None  # CpuKernels when the fused native kernel is used

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        """Store the checkpoint's weight (plus the offset, added in float32)."""
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"weight shape mismatch: checkpoint {tuple(loaded.shape)}, model expects "
                             f"{tuple(param.shape)} for a norm")
        param.data.copy_(loaded.float() + self.weight_offset if self.weight_offset else loaded)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """norm(x); or, given a residual stream, (norm(x + residual), x + residual)."""
        if self.kernels is not None and x.dim() == 2 and x.is_contiguous():
            if residual is None:
                return self.kernels.add_rms_norm(x, None, self.weight, self.eps)
            residual = residual.contiguous()
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps), residual  # residual += x
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, computed in float32 and returned in x's dtype, no weight
    (Llama 4's q/k "L2 norm", transformers' Llama4TextL2Norm). Row by row: a row's result never depends on the
    others'."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
