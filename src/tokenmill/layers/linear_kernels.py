"""How a linear layer multiplies, chosen once after the weights are loaded.

`DenseKernel` is `F.linear` over the loaded weight: exact, and what every other kernel is checked
against. `OneDnnPackedKernel` hands the weight to oneDNN once, in its blocked layout, so bfloat16
matmuls on CPUs with AVX512-BF16/AMX skip the per-call weight reorder (measured in
docs/benchmarks.md). `AmxPackedKernel` adds tokenmill's own AMX product for the row counts where it
beats oneDNN's. A packed kernel owns its reordered copies; the layer drops the original.
`Float32ComputeKernel` stands in for the packed kernels where the CPU has no native bfloat16 matmul.
`QuantizedKernel` multiplies a weight kept quantised (kernels/quantized.py).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu_kernels import AMX_FEATURE_TILE, scratch_buffer
from tokenmill.kernels.isa import onednn_bf16_packing
from tokenmill.kernels import quantized
from tokenmill.kernels.quantized import QuantizedWeight, reference_linear

logger = logging.getLogger(__name__)

# oneDNN's packing takes a batch-size hint: that of a decode batch (16 and 2048 measured the same).
_PACKING_BATCH_HINT = 16


class LinearKernel(Protocol):
    """y = x W^T (+ b) for x [..., in_features]."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseKernel:
    """`F.linear` on a plain weight tensor."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply."""
        return F.linear(x, self.weight, self.bias)


class OneDnnPackedKernel:
    """oneDNN matmul over a weight reordered once into oneDNN's blocked layout (CPU, bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKING_BATCH_HINT)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


class AmxPackedKernel:
    """Below `quantized.AMX_BELOW_ROWS` input rows, the native AMX product (kernels/amx_kernels.c) over a copy of
    the weight in AMX tile layout; from there on, oneDNN's packed matmul (measured crossover,
    docs/benchmarks.md). CPU, bfloat16, input features a multiple of 32."""

    amx = True  # as QLinearOp's flag: few-row products run on AMX tiles

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], native: Any,
                 batch_invariant: bool = True) -> None:
        self.native = native
        # the tiles at every row count: a row's sums run in one order whatever shares the product
        self.batch_invariant = batch_invariant
        self.out_features, self.in_features = weight.shape
        self.amx_weight = native.amx_pack(weight)
        self.amx_bias = None if bias is None else bias.float().contiguous()
        self.amx_bias_pointer = None if bias is None else self.amx_bias.data_ptr()
        self.many_rows = OneDnnPackedKernel(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        flat = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16 or (flat.shape[0] >= quantized.AMX_BELOW_ROWS and not self.batch_invariant):
            return self.many_rows(x)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        y = self.native.amx_linear(flat, self.amx_weight, self.out_features, self.amx_bias)
        return y.view(*x.shape[:-1], self.out_features)


class Float32ComputeKernel:
    """Bfloat16 products for CPUs without a native bfloat16 matmul, where PyTorch emulates one: below
    `WIDEN_FROM_ROWS` input rows that emulated product (it reads the weight at 2 bytes a value, which is
    what a memory-bound product of few rows costs); from there on the weight is widened to float32 a
    cache-sized tile at a time and multiplied in float32 (3-7x faster than the emulation at 16-256 rows,
    docs/benchmarks.md), the result rounded once to bfloat16. Either way the products of bfloat16 values
    are exact and summed in float32: a native bfloat16 matmul's arithmetic in another summation order."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.bias32 = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] < WIDEN_FROM_ROWS or x.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        rows, cols = self.weight.shape
        tile = max(1, WIDENED_TILE_BYTES // (cols * 4))
        wide = flat.float()
        parts = []
        for first in range(0, rows, tile):
            count = min(tile, rows - first)
            scratch = scratch_buffer(count * cols, torch.float32).view(count, cols)
            scratch.copy_(self.weight[first:first + count])
            bias = None if self.bias32 is None else self.bias32[first:first + count]
            parts.append(F.linear(wide, scratch, bias).to(torch.bfloat16))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out.view(*x.shape[:-1], rows)


class InvariantDenseKernel:
    """Float weights multiplied by the native batch-invariant product (kernels/dense_kernels.c): each
    output is one chain of fused multiply-adds in input-feature order, so a row's result does not depend
    on how many rows share the product, as it does with BLAS. Inputs of the weight's dtype, CPU."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], native: Any) -> None:
        self.native = native
        self.out_features = weight.shape[0]
        self.packed = native.dense_pack(weight)
        # the bias is added in float32 as the bias of a bfloat16 F.linear is, from its bfloat16 value
        self.bias32 = None if bias is None else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        if x.dtype != self.packed.dtype:
            return self(x.to(self.packed.dtype)).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        y = self.native.dense_linear(flat, self.packed, self.out_features, self.bias32)
        return y.view(*x.shape[:-1], self.out_features)


# measured on an AVX2 machine, 4 SmolLM2 layers (`tokenmill bench linears --dtype bfloat16`)
WIDEN_FROM_ROWS = 8
WIDENED_TILE_BYTES = 8 << 20


def packing_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """True where `make_kernel(packed=True)` has a faster product than `F.linear`: bfloat16 on CPU
    (oneDNN's packed weights where the CPU allows them, else `Float32ComputeKernel`)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True where `OneDnnPackedKernel` applies: CPU, bfloat16, a PyTorch built with oneDNN, and a CPU
    whose features oneDNN's packed bfloat16 weights need (`isa.onednn_bf16_packing`). Elsewhere bfloat16
    weights stay plain tensors for `F.linear`, which every CPU runs."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and onednn_bf16_packing())


def make_kernel(weight: torch.Tensor, bias: Optional[torch.Tensor], packed: bool, native: Any = None,
                batch_invariant: bool = False) -> LinearKernel:
    """The kernel for one weight. `batch_invariant` with product kernels `native` (CpuKernels for a
    float32 or bfloat16 CPU weight, or TritonProducts for a float weight on its own device): the AMX
    product at every row count where it applies, else `InvariantDenseKernel`. Otherwise: dense unless `packed`; packed, with the AMX product too where
    `native` has AMX and the input width suits it, or computed in float32 where oneDNN cannot pack
    bfloat16 weights on this CPU."""
    on_device = getattr(native, "on_device", False)  # Triton's products take float16 too; the CPU's do not
    if batch_invariant and native is not None and (weight.device.type == "cpu" or on_device) \
            and weight.dtype in ((torch.float32, torch.bfloat16, torch.float16) if on_device
                                 else (torch.float32, torch.bfloat16)):
        if packed and native.amx and weight.shape[1] % AMX_FEATURE_TILE == 0 \
                and onednn_packing_available(weight.dtype, weight.device):
            return AmxPackedKernel(weight, bias, native, batch_invariant=True)
        return InvariantDenseKernel(weight, bias, native)
    if not packed:
        return DenseKernel(weight, bias)
    if not onednn_packing_available(weight.dtype, weight.device):
        return Float32ComputeKernel(weight, bias)
    if native is not None and native.amx and weight.shape[1] % AMX_FEATURE_TILE == 0:
        return AmxPackedKernel(weight, bias, native, batch_invariant=False)
    return OneDnnPackedKernel(weight, bias)


def dequantizes_once(device: torch.device, native: Any) -> bool:
    """Whether a quantised weight on `device` is dequantised once and multiplied as a dense weight: off
    the CPU where no product kernels (`native`: TritonProducts) are given (`F.linear`, cuBLAS)."""
    return device.type != "cpu" and native is None


class QuantizedKernel:
    """A quantised weight times float inputs through the product kernels `native` (CpuKernels on CPU
    for float32/bfloat16 inputs, other dtypes multiplied in float32; TritonProducts on the weight's
    device), which keep their own copy of the weight in their layout; on CPU without them (no compiler)
    through `reference_linear`, which dequantises the weight per call. Off the CPU without them
    (`dequantizes_once`) the weight is dequantised on the first call, to that call's dtype, and
    multiplied as a dense weight from then on (the packed copy is dropped)."""

    _warned = False
    _dequantized_logged = False

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor], native: Any,
                 batch_invariant: bool = True) -> None:
        self.format = weight.format
        self.bias = None if bias is None else bias.float().contiguous()
        self.dense: Optional[DenseKernel] = None
        self.dequantize_once = dequantizes_once(weight.data.device, native)
        self.native = native.qlinear_op(weight, self.bias, batch_invariant) if native is not None else None
        self.on_device = getattr(native, "on_device", False)
        self.weight = weight if self.native is None else None  # the reference's copy, only where it runs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        if self.native is not None:
            if self.on_device:
                return self.native(x)
            if x.device.type != "cpu":
                raise ValueError("this quantised weight was prepared for the native CPU kernels; "
                                 f"it cannot multiply a tensor on {x.device}")
            if x.dtype in (torch.float32, torch.bfloat16):
                return self.native(x)
            return self.native(x.float()).to(x.dtype)
        if self.dequantize_once:
            dense = self._dense(x.dtype)
            if x.dtype != dense.weight.dtype:
                return dense(x.to(dense.weight.dtype)).to(x.dtype)
            return dense(x)
        if not QuantizedKernel._warned:
            QuantizedKernel._warned = True
            logger.warning("quantised weights are multiplied by the PyTorch reference (dequantised per call: "
                           "slow); the native kernel needs a CPU and a C compiler")
        return reference_linear(x, self.weight, self.bias)

    def _dense(self, dtype: torch.dtype) -> DenseKernel:
        """The dense kernel, made from the quantised weight on the first call."""
        if self.dense is None:
            if self.weight.data.is_cuda and torch.cuda.is_current_stream_capturing():
                # captured, the dequantisation would only run at replay, leaving the weight unwritten
                raise RuntimeError("a quantised weight must multiply once eagerly before CUDA graph capture")
            weight = self.weight.dequantize(dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            self.dense, self.weight = DenseKernel(weight, bias), None
            if not QuantizedKernel._dequantized_logged:
                QuantizedKernel._dequantized_logged = True
                logger.info("quantised weights dequantised once to %s on %s (no packed product given: "
                            "--linear-kernel dense)", str(dtype).removeprefix("torch."), weight.device.type)
        return self.dense
