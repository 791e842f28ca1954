"""The fused element-wise kernels of the CUDA path, in Triton: RMSNorm with the residual add, SiLU- and
GELU-and-mul, and RoPE in place. Same methods as the native CPU kernels (CpuKernels), so the model routes
its norms, activations and rotary embeddings through either (`KernelChoice.elementwise`, models/kernel_choice.py).
Used for 16-bit dtypes only: float32 keeps PyTorch's ops, whose results the HF comparisons pin down."""

from __future__ import annotations

from typing import Optional

import torch
from triton import next_power_of_2

from tokenmill.attention.triton_kernels import act_and_mul_kernel, add_rms_norm_kernel, rope_kernel

_ACT_BLOCK = 1024


class TritonFusedOps:
    """add_rms_norm, silu_mul, gelu_tanh_mul and rope on Triton kernels (see CpuKernels for each contract)."""

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """norm(x) or, with a residual, residual += x in place and norm(residual). x: [T, hidden] contiguous."""
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            raise ValueError("add_rms_norm needs contiguous tensors")
        out = torch.empty_like(x)
        if x.shape[0]:
            width = x.shape[1]
            add_rms_norm_kernel[(x.shape[0],)](out, x if residual is None else residual, x, weight, eps, width,
                                               x.stride(0), (x if residual is None else residual).stride(0),
                                               out.stride(0), HAS_RESIDUAL=residual is not None,
                                               BLOCK=next_power_of_2(width))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a contiguous [T, 2 * inner] input."""
        return self._gated(gate_up, gelu=False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (GeGLU) of a contiguous [T, 2 * inner] input."""
        return self._gated(gate_up, gelu=True)

    @staticmethod
    def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        if not gate_up.is_contiguous():
            raise ValueError("a gated activation needs a contiguous input")
        inner = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], inner)
        if gate_up.shape[0]:
            grid = (gate_up.shape[0], -(-inner // _ACT_BLOCK))
            act_and_mul_kernel[grid](out, gate_up, inner, gate_up.stride(0), out.stride(0), GELU=gelu,
                                     BLOCK=min(_ACT_BLOCK, next_power_of_2(inner)))
        return out

    @staticmethod
    def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, heads, head_dim] (heads contiguous, rows strided) in place by the float32
        [max_positions, head_dim] tables."""
        head_dim = x.shape[2]
        if x.stride(2) != 1 or x.stride(1) != head_dim or cos.dtype != torch.float32 or not cos.is_contiguous() \
                or not sin.is_contiguous():
            raise ValueError("rope needs contiguous heads and contiguous float32 tables")
        if x.shape[0]:
            rope_kernel[(x.shape[0],)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), x.shape[1],
                                       HALF=head_dim // 2, HALF_P=next_power_of_2(head_dim // 2),
                                       HEADS_P=next_power_of_2(x.shape[1]))
