"""RMSNorm: torch's fused kernel, bit-identical in float32 to Hugging Face's Llama formula."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.kernels: Any = None  # CpuKernels when the fused native kernel is used

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
