"""GPTQ and AWQ (GEMM) layers, read as they are written.

- **GPTQ** (`quant_method: gptq`, AutoGPTQ/GPTQModel's layout): `qweight` int32 [in / (32 / bits), out],
  input rows packed low bits first; `qzeros` int32 [groups, out / (32 / bits)], output columns packed the
  same way, stored minus one (checkpoint format `gptq`; `gptq_v2` stores them as they are); `scales`
  [groups, out]; `g_idx` [in] the group of each input row (activation order, `desc_act`), else row //
  group_size (group_size -1: one group). w[o, i] = (q[i, o] - zero[g(i), o]) * scale[g(i), o].
- **AWQ** (`quant_method: awq`, `version: gemm`, AutoAWQ's layout): `qweight` int32 [in, out / 8] and
  `qzeros` int32 [in / group_size, out / 8], output columns packed in the order 0 2 4 6 1 3 5 7 (slot i
  of a word holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]); `scales` [groups, out]; no offset on zeros.

Kept packed, a layer becomes a `QuantizedWeight` (int4 for 4 bits, int8 for 8) with u = q, and per
32 input features scale = s and offset = -s z of their group: exact, since s (float16, as both formats
store it) times an integer below 2^9 needs at most 20 bits, so s u - s z = (u - z) s in float32 (float32
scales would be rounded once more). That needs each 32 input rows to lie in one group: group sizes that
are multiples of 32 (or -1). Activation order (`desc_act`: a `g_idx` that shuffles the groups over the
input rows) is kept packed with the rows sorted by group and the weight's `input_order` naming the input
of each (kernels/quantized.py); the products gather their inputs in that order. A layer whose groups
cannot come in runs of 32 (group size 16) is dequantised to floats instead, and the load log counts such
layers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tokenmill.kernels.quantized import BLOCK
from tokenmill.models.loader.packed_layers import (LayerParts, LoadedWeight, packed_when_in_runs, unpack_cols,
                                                   unpack_rows)

_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i of a packed word holds column 8c + _AWQ_ORDER[i]


class GptqAwqLayers:
    """How one GPTQ or AWQ checkpoint's linear layers are read (quantized_checkpoints.PackedScheme).
    ValueError at construction names a scheme this engine cannot read exactly."""

    def __init__(self, config: dict[str, Any], folder: str) -> None:
        method = str(config.get("quant_method", "")).lower()
        self.method = method
        self.bits = config.get("bits", config.get("w_bit"))
        self.group_size = config.get("group_size", config.get("q_group_size"))
        where = f"{folder}: quantization_config.quant_method {method!r}"
        if method == "gptq":
            if self.bits not in (4, 8):
                raise ValueError(f"{where} with bits {self.bits}: only 4- and 8-bit GPTQ weights are read")
            fmt = config.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"{where} with checkpoint_format {fmt!r}: only gptq and gptq_v2 are read")
            self.zero_offset = 1 if fmt == "gptq" else 0
            self.tensors = LayerParts(_GPTQ_PARTS)
        else:
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm" or self.bits != 4:
                raise ValueError(f"{where} version {version!r} bits {self.bits}: only 4-bit AWQ in the GEMM "
                                 f"layout is read")
            if config.get("zero_point") is False:
                raise ValueError(f"{where} without zero points: only AWQ with zero points is read")
            self.tensors = LayerParts(("qweight", "qzeros", "scales"))
        if not isinstance(self.group_size, int) or (self.group_size < 1 and self.group_size != -1):
            raise ValueError(f"{where} has group_size {self.group_size!r}: a positive integer or -1 is needed")

    def layer_of(self, name: str) -> Optional[str]:
        """The layer prefix of a tensor of a packed layer (`...q_proj` of `...q_proj.qweight`), else None."""
        return self.tensors.layer_of(name)

    @staticmethod
    def unused(name: str) -> bool:
        """Every tensor of a GPTQ or AWQ checkpoint is read."""
        return False

    def complete(self, layer: str, parts: dict[str, torch.Tensor], names: set[str]) -> bool:
        """Whether every part of `layer` in the checkpoint has arrived (`g_idx` is optional)."""
        return self.tensors.complete(layer, parts, names)

    def load(self, layer: str, parts: dict[str, torch.Tensor], keep_packed: bool) -> tuple[LoadedWeight, str]:
        """The layer kept packed (`keep_packed`, where its groups allow: see the module's docstring), else
        its float32 weight [out, in]."""
        q, zeros, scales, groups = self._integers(layer, parts)
        packed = packed_when_in_runs(q.t(), zeros.t(), scales.t(), groups, self.bits) if keep_packed else None
        if packed is not None:
            return packed, f"{self.method} {packed.format} packed"
        weight = ((q - zeros[groups]).float() * scales[groups]).t().contiguous()
        if keep_packed:
            return weight, f"{self.method} dequantised (groups not in runs of {BLOCK} inputs)"
        return weight, f"{self.method} dequantised"

    def _integers(self, layer: str, parts: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [in, out], zero points and float32 scales [groups, out], and each input row's group [in]."""
        missing = [p for p in self.tensors.parts if p != "g_idx" and p not in parts]
        if missing:
            raise ValueError(f"{layer}: the {self.method} layer has no {', '.join(missing)}")
        for name in ("qweight", "qzeros"):
            if parts[name].dtype != torch.int32 or parts[name].dim() != 2:
                raise ValueError(f"{layer}.{name} is {parts[name].dtype} {list(parts[name].shape)}; the {self.method} "
                                 f"format stores int32 [rows, columns]")
        scales = parts["scales"].float()
        if self.method == "gptq":
            q = unpack_rows(parts["qweight"], self.bits)
            zeros = unpack_cols(parts["qzeros"], self.bits)[:, :q.shape[1]] + self.zero_offset
            groups = parts.get("g_idx")
            groups = groups.long() if groups is not None else self._plain_groups(q.shape[0])
        else:
            q = _awq_columns(unpack_cols(parts["qweight"], 4))
            zeros = _awq_columns(unpack_cols(parts["qzeros"], 4))
            groups = self._plain_groups(q.shape[0])
        groups_used = scales.shape[0] if "g_idx" in parts else int(groups.max()) + 1  # every group has rows
        if (groups.numel() != q.shape[0] or int(groups.max()) >= scales.shape[0] or int(groups.min()) < 0
                or groups_used != scales.shape[0] or tuple(zeros.shape) != tuple(scales.shape)
                or scales.shape[1] != q.shape[1]):
            raise ValueError(f"{layer}: the {self.method} tensors do not agree: qweight unpacks to "
                             f"{list(q.shape)} (in, out), scales are {list(scales.shape)}, zero points "
                             f"{list(zeros.shape)}, and the groups of the {groups.numel()} input rows run to "
                             f"{int(groups.max())}")
        return q, zeros, scales, groups

    def _plain_groups(self, rows: int) -> torch.Tensor:
        size = rows if self.group_size == -1 else self.group_size
        return torch.arange(rows) // size


def _awq_columns(slots: torch.Tensor) -> torch.Tensor:
    """Columns in order from AWQ's packed slot order (see the module's docstring)."""
    rows, width = slots.shape
    order = torch.tensor(_AWQ_ORDER)
    columns = torch.empty_like(slots)
    columns.view(rows, width // 8, 8)[:, :, order] = slots.view(rows, width // 8, 8)
    return columns
