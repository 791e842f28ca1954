"""The matrix products of the CUDA path in Triton, offered to the linear layers through the same methods
the native CPU kernels offer them (`CpuKernels`): `qlinear_op` multiplies a weight kept packed
(kernels/quantized.py's layout, repacked once for the Triton kernel) and `dense_pack` / `dense_linear`
multiply a float weight with a reduction order that depends on the weight's shape only, never on the
number of rows (batch invariance). `choose_kernels` (worker/model_setup.py) hands this object to the
layers where `--linear-kernel` is triton, or auto on CUDA; on CPU tensors the kernels run in Triton's
interpreter (tests only). Triton is imported only when a product is built."""

from __future__ import annotations

from typing import Any, Optional

import torch


class TritonProducts:
    """The Triton products for linear layers (see the module docstring)."""

    amx = False  # as CpuKernels' flag: no AMX tile product here
    on_device = True  # its products run on the weight's own device (CUDA, or CPU in the interpreter)

    def qlinear_op(self, weight: Any, bias: Optional[torch.Tensor], batch_invariant: bool = True) -> Any:
        """The product with a packed `QuantizedWeight` (x [m, cols] float -> [m, rows] in x's dtype)."""
        from tokenmill.layers.triton_quant_linear import TritonQuantizedProduct

        return TritonQuantizedProduct(weight, bias, batch_invariant)

    def dense_pack(self, weight: torch.Tensor) -> Any:
        """A float weight [n, k] in the layout `dense_linear` reads."""
        from tokenmill.layers.triton_matmul import pack_weight

        return pack_weight(weight)

    def dense_linear(self, x: torch.Tensor, packed: Any, out_features: int,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [m, k] times a weight from `dense_pack` (+ a float32 bias), each output row computed the same
        way whatever m is."""
        from tokenmill.layers.triton_matmul import invariant_linear

        return invariant_linear(x, packed, out_features, bias)
