"""How a linear layer multiplies a W8A8 weight (kernels/w8a8.py: e4m3 or int8 values), chosen once when
its kernels are chosen.

FP8 (e4m3) weights. On the weight's device (CUDA, or CPU tensors where the layers were handed
TritonProducts: Triton's interpreter), activations are quantised per token (per token and block for
block-scaled weights) by one Triton kernel, then:
- per-channel weights, bfloat16 activations, a device with FP8 tensor cores (`fp8_supported`), no batch
  invariance asked: `torch._scaled_mm` with row-wise scales (cuBLASLt/CUTLASS);
- otherwise with FP8 tensor cores: the Triton W8A8 product (layers/triton_w8a8.py), which also takes block
  scales; with batch invariance, one tiling for every row count (`_scaled_mm`'s kernel and reduction
  order follow the row count, so it is not used then);
- below sm89, or when `TOKENMILL_FP8_WEIGHT_ONLY=1` (envs.py): the Triton weight-only product, e4m3
  weights decoded in registers times the unquantised activations.
On the CPU with the native kernels (CpuKernels) or none: the weight is dequantised once to float32 and the
activations are quantised and dequantised per call (the W8A8 arithmetic in float32), multiplied by the
native batch-invariant product where batch invariance is asked, else by `F.linear`; per-channel weights
without batch invariance run `torch._scaled_mm` where this PyTorch has it on CPU.

int8 weights (per channel) multiply W8A8 only on the device products (`multiplies_w8a8`: TritonProducts on
CUDA sm80+, or CPU tensors in the interpreter): activations quantised to int8 per token by one Triton
kernel, then, on CUDA without batch invariance and where its shapes allow (`triton_w8a8.int_mm_takes`: more
than 16 rows, features multiples of 8), `torch._int_mm` (cuBLASLt int8 GEMM) and one Triton kernel applying
the scales; otherwise (few rows, batch invariance, other shapes, CPU tensors) the Triton int8 product. Both
sum in int32, exactly, and scale the sums alike, so they give the same values. Elsewhere (the CPU's native
products, none, or an older GPU) `_ShardedLinear.use_kernel` turns the weight into the packed int8
`QuantizedWeight` the native products take (`W8A8Weight.to_packed_int8`).

Every path equals `w8a8.reference_linear` up to summation order (with `quantize_inputs=False` in the
weight-only case; for int8, to float32 rounding: the integer sums are exact).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from tokenmill import envs
from tokenmill.kernels import w8a8
from tokenmill.kernels.w8a8 import FP8, INT8, W8A8Weight

logger = logging.getLogger(__name__)


def fp8_supported(device: torch.device) -> bool:
    """Whether e4m3 x e4m3 products run on `device`: CUDA compute capability 8.9 or later; CPU tensors
    (Triton's interpreter, and `torch._scaled_mm` where `cpu_scaled_mm` says so)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm() -> bool:
    """Whether this PyTorch runs `torch._scaled_mm` on CPU with row-wise scales (probed once)."""
    try:
        ones = torch.ones(1, 16, dtype=torch.float8_e4m3fn)
        y = torch._scaled_mm(ones, ones.t(), scale_a=torch.ones(1, 1), scale_b=torch.ones(1, 1),
                             out_dtype=torch.float32)
        return float(y) == 16.0
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def int8_supported(device: torch.device) -> bool:
    """Whether the int8 W8A8 products run on `device`: CUDA compute capability 8.0 or later (Triton's
    int8 tl.dot, cuBLASLt's int8 GEMM); CPU tensors (Triton's interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def multiplies_w8a8(weight: W8A8Weight, native: Any) -> bool:
    """Whether `W8A8Kernel` multiplies `weight` with the product kernels `native`: FP8 weights always (the
    module docstring's paths); int8 weights on the device products (`native.on_device`) where
    `int8_supported`, else they become packed int8 weights for the native or reference products."""
    if weight.values is FP8:
        return True
    return getattr(native, "on_device", False) and int8_supported(weight.data.device)


class W8A8Kernel:
    """y = x W^T (+ b) for a W8A8 weight, by the path the module docstring gives for its values, device,
    dtype and `batch_invariant`. `native`: the layers' product kernels (TritonProducts runs on the weight's
    device, CpuKernels provide the batch-invariant dense product for FP8 weights). ValueError for an int8
    weight that `multiplies_w8a8` leaves to the packed int8 products."""

    def __init__(self, weight: W8A8Weight, bias: Optional[torch.Tensor], native: Any,
                 batch_invariant: bool = True) -> None:
        if not multiplies_w8a8(weight, native):
            raise ValueError("int8 W8A8 weights multiply W8A8 on the device products (TritonProducts on CUDA "
                             "sm80+ or CPU tensors); elsewhere they run as packed int8 weights (to_packed_int8)")
        device = weight.data.device
        self.format = weight.format
        self.out_features = weight.shape[0]
        self.batch_invariant = batch_invariant
        self.bias = bias
        self.bias32 = None if bias is None else bias.float().contiguous()
        self.weight_only = weight.values is FP8 and envs.fp8_weight_only()
        self.on_device = device.type == "cuda" or getattr(native, "on_device", False)
        self.weight: Optional[W8A8Weight] = weight
        self.dense: Any = None
        self.scaled_mm = self.int_mm = False
        if weight.values is INT8:
            self.w8a8 = True
            # _int_mm's kernel (and so its reduction order, were the sums not exact) follows the row count
            self.int_mm = device.type == "cuda" and not batch_invariant
            self.path = "torch._int_mm / Triton int8 W8A8" if self.int_mm else "Triton int8 W8A8"
        elif self.on_device:
            self.w8a8 = fp8_supported(device) and not self.weight_only
            # _scaled_mm takes per-channel weights only, its row counts change its reduction order
            self.scaled_mm = self.w8a8 and weight.block is None and not batch_invariant and (
                device.type == "cuda" or cpu_scaled_mm()) and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
            self.path = ("torch._scaled_mm (bfloat16) / Triton W8A8" if self.scaled_mm else
                         "Triton W8A8" if self.w8a8 else "Triton weight-only")
        else:
            self.w8a8 = not self.weight_only
            self.scaled_mm = self.w8a8 and weight.block is None and not batch_invariant and cpu_scaled_mm()
            if not self.scaled_mm:
                from tokenmill.layers.linear_kernels import make_kernel

                # the W8A8 arithmetic in float32: one dequantisation, kept; the native product is invariant
                self.dense = make_kernel(weight.dequantize(torch.float32), self.bias32, False, native,
                                         batch_invariant)
                self.group = weight.activation_group
                self.weight = None
            self.path = "torch._scaled_mm" if self.scaled_mm else "dequantised float32"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        y = self._device(flat) if self.on_device else self._cpu(flat)
        return y.view(*x.shape[:-1], self.out_features)

    def _device(self, flat: torch.Tensor) -> torch.Tensor:
        from tokenmill.layers import triton_w8a8

        weight = self.weight
        if not self.w8a8:
            if flat.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                return triton_w8a8.weight_only_product(flat.float(), weight, self.bias32,
                                                       self.batch_invariant).to(flat.dtype)
            return triton_w8a8.weight_only_product(flat, weight, self.bias32, self.batch_invariant)
        q, scales = triton_w8a8.quantize_activations(flat, weight.activation_group, weight.values)
        if self.int_mm and triton_w8a8.int_mm_takes(flat.shape[0], weight):
            return triton_w8a8.int_mm_product(q, scales, weight, self.bias32, flat.dtype)
        if self.scaled_mm and (flat.dtype == torch.bfloat16 or not flat.is_cuda):
            # row-wise scaling takes a bfloat16 output on CUDA (any dtype on CPU); scale_b is [1, rows]
            return torch._scaled_mm(q, weight.data.t(), scale_a=scales, scale_b=weight.scale.t(),
                                    bias=None if self.bias is None else self.bias.to(flat.dtype),
                                    out_dtype=flat.dtype)
        return triton_w8a8.w8a8_product(q, scales, weight, self.bias32, flat.dtype, self.batch_invariant)

    def _cpu(self, flat: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm:
            q, scales = w8a8.quantize_activations(flat, None)
            return torch._scaled_mm(q, self.weight.data.t(), scale_a=scales, scale_b=self.weight.scale.t(),
                                    bias=None if self.bias is None else self.bias.to(flat.dtype), out_dtype=flat.dtype)
        if self.weight_only:
            return self.dense(flat.float()).to(flat.dtype)
        x = w8a8.dequantize_activations(*w8a8.quantize_activations(flat, self.group), self.group)
        return self.dense(x).to(flat.dtype)
