"""How a linear layer multiplies, chosen once after the weights are loaded.

`DenseKernel` is `F.linear` over the loaded weight: exact, and what every other kernel is checked
against. `OneDnnPackedKernel` hands the weight to oneDNN once, in its blocked layout, so bfloat16
matmuls on CPUs with AVX512-BF16/AMX skip the per-call weight reorder (measured in
docs/benchmarks.md). A packed kernel owns its reordered copy; the layer drops the original.
`QuantizedKernel` multiplies a weight kept quantised (layers/quantized.py).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F

from tokenmill.layers.quantized import QuantizedWeight, reference_linear

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


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True where `OneDnnPackedKernel` applies: CPU, bfloat16, and a PyTorch built with oneDNN."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def make_kernel(weight: torch.Tensor, bias: Optional[torch.Tensor], packed: bool) -> LinearKernel:
    """The kernel for one weight: oneDNN-packed when `packed`, else dense."""
    return OneDnnPackedKernel(weight, bias) if packed else DenseKernel(weight, bias)


class QuantizedKernel:
    """A quantised weight times float32/bfloat16 inputs on CPU through the native kernel; anywhere else
    (no compiler, CUDA, float16) through `reference_linear`, which dequantises the weight per call."""

    _warned = False

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor], native: Any) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.float().contiguous()
        self.native = native.qlinear_op(weight, self.bias) if native is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        if self.native is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return self.native(x)
        if not QuantizedKernel._warned:
            QuantizedKernel._warned = True
            logger.warning("quantised weights are multiplied by the PyTorch reference (dequantised per call: "
                           "slow); the native kernel needs a CPU, a C compiler and float32/bfloat16")
        return reference_linear(x, self.weight, self.bias)
