"""Which kernels a loaded model runs: one record, chosen once (worker/model_setup.py `choose_kernels`) and
applied once (`DecoderForCausalLM.apply_kernels`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.kernels.cpu_kernels import CpuKernels


@dataclass(frozen=True)
class KernelChoice:
    """The kernels of a model's products, element-wise ops and steps.

    - `packed`: float projections are re-laid for oneDNN or AMX (else multiplied as they are);
    - `native`: the product kernels that multiply quantised weights (and float ones batch-invariant):
      the native CPU kernels (`CpuKernels`), Triton's (`TritonProducts`, layers/triton_products.py), or None for
      PyTorch's products (dequantised on the fly);
    - `batch_invariant`: every product computes a row alike whatever the number of rows;
    - `elementwise`: the ops RMSNorm (+ residual add), SiLU- and GELU-and-mul and RoPE run through — the
      native CPU kernels, Triton's fused ops on CUDA, or None for PyTorch's;
    - `fused_decode`: qualifying steps run every layer in one native call (models/fused_decode.py);
    - `kv_rows`: the KV cache's one-byte row format that call writes and reads ("int8", "fp8"), None for
      the compute dtype.

    Invariant (checked on construction): `fused_decode` only with native element-wise kernels, since the
    one-call step is theirs.
    """

    packed: bool
    native: Optional[Any]
    batch_invariant: bool
    elementwise: Optional[Any] = None
    fused_decode: bool = False
    kv_rows: Optional[str] = None

    def __post_init__(self) -> None:
        if self.fused_decode and not isinstance(self.elementwise, CpuKernels):
            raise ValueError("fused_decode runs on the native CPU kernels: it needs them as the element-wise ops")
