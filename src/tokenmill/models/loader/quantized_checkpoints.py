"""Checkpoints whose config.json has a `quantization_config`: GPTQ and AWQ (GEMM) folders, read as they
are written and dequantised exactly at load, layer by layer; every other scheme refused by name.

- **GPTQ** (`quant_method: gptq`, AutoGPTQ/GPTQModel's layout): `qweight` int32 [in / (32 / bits), out],
  input rows packed low bits first; `qzeros` int32 [groups, out / (32 / bits)], output columns packed the
  same way, stored minus one (checkpoint format `gptq`; `gptq_v2` stores them as they are); `scales`
  [groups, out]; `g_idx` [in] the group of each input row (activation order, `desc_act`), else row //
  group_size (group_size -1: one group). w[o, i] = (q[i, o] - zero[g(i), o]) * scale[g(i), o].
- **AWQ** (`quant_method: awq`, `version: gemm`, AutoAWQ's layout): `qweight` int32 [in, out / 8] and
  `qzeros` int32 [in / group_size, out / 8], output columns packed in the order 0 2 4 6 1 3 5 7 (slot i
  of a word holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]); `scales` [groups, out]; no offset on zeros.

The products are then the float ones of the dequantised weights (in float32 they equal, bit for bit, a
float checkpoint of those weights). Keeping the packed integers on the native int4/int8 products is
not built yet: `--quantization int4`/`int8` re-quantises the dequantised weights per 32-weight block
(not exact), and `auto` runs them as floats.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i of a packed word holds column 8c + _AWQ_ORDER[i]


def quantization_config(folder: str) -> Optional[dict[str, Any]]:
    """The checkpoint's quantization_config (None for a float checkpoint)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    value = config.get("quantization_config")
    return value if isinstance(value, dict) else None


class PackedLinears:
    """How one quantised checkpoint's linear layers are read: which tensor names form a layer, and the
    float weight each layer's tensors dequantise to. ValueError at construction names a scheme this
    engine cannot read exactly."""

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
            self.parts = _GPTQ_PARTS
        elif method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm" or self.bits != 4:
                raise ValueError(f"{where} version {version!r} bits {self.bits}: only 4-bit AWQ in the GEMM "
                                 f"layout is read")
            if config.get("zero_point") is False:
                raise ValueError(f"{where} without zero points: only AWQ with zero points is read")
            self.parts = ("qweight", "qzeros", "scales")
        else:
            raise ValueError(f"{where} is not supported (supported: gptq, awq); dequantise the checkpoint or use "
                             f"a GGUF file")
        if not isinstance(self.group_size, int) or (self.group_size < 1 and self.group_size != -1):
            raise ValueError(f"{where} has group_size {self.group_size!r}: a positive integer or -1 is needed")

    def layer_of(self, name: str) -> Optional[str]:
        """The layer prefix of a tensor of a packed layer (`...q_proj` of `...q_proj.qweight`), else None."""
        prefix, _, part = name.rpartition(".")
        return prefix if part in self.parts else None

    def dequantize(self, prefix: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight [out, in] of layer `prefix` from its packed tensors (keyed by part)."""
        missing = [p for p in self.parts if p != "g_idx" and p not in tensors]
        if missing:
            raise ValueError(f"{prefix}: the {self.method} layer has no {', '.join(missing)}")
        scales = tensors["scales"].float()
        if self.method == "gptq":
            q = _unpack_rows(tensors["qweight"], self.bits)  # [in, out]
            zeros = _unpack_cols(tensors["qzeros"], self.bits)[:, :q.shape[1]] + self.zero_offset
            groups = tensors.get("g_idx")
            groups = groups.long() if groups is not None else self._plain_groups(q.shape[0])
        else:
            q = _awq_columns(_unpack_cols(tensors["qweight"], 4))
            zeros = _awq_columns(_unpack_cols(tensors["qzeros"], 4))
            groups = self._plain_groups(q.shape[0])
        if groups.numel() != q.shape[0] or int(groups.max()) >= scales.shape[0]:
            raise ValueError(f"{prefix}: its groups do not match its {scales.shape[0]} rows of scales")
        weight = (q - zeros[groups]).float() * scales[groups]
        return weight.t().contiguous()

    def _plain_groups(self, rows: int) -> torch.Tensor:
        size = rows if self.group_size == -1 else self.group_size
        return torch.arange(rows) // size


def dequantizing_stream(packed: PackedLinears, names: set[str],
                        stream: Callable[[set[str]], Iterator[tuple[str, torch.Tensor]]]
                        ) -> tuple[set[str], Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """The tensor names a model sees (each packed layer's parts become `<layer>.weight`) and a stream that
    yields them: other tensors as stored, each packed layer dequantised once all its parts have arrived."""
    layers = {packed.layer_of(name) for name in names} - {None}
    visible = {name for name in names if packed.layer_of(name) is None} | {f"{layer}.weight" for layer in layers}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in stream(names):
            layer = packed.layer_of(name)
            if layer is None:
                yield name, tensor
                continue
            parts = pending.setdefault(layer, {})
            parts[name.rpartition(".")[2]] = tensor
            if all(part in parts for part in packed.parts if f"{layer}.{part}" in names):
                yield f"{layer}.weight", packed.dequantize(layer, pending.pop(layer))
        for layer, parts in pending.items():
            yield f"{layer}.weight", packed.dequantize(layer, parts)

    return visible, tensors


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 / bits values per word along the rows (low bits first) -> [R * 32 / bits, C]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 / bits values per word along the columns (low bits first) -> [R, C * 32 / bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)


def _awq_columns(slots: torch.Tensor) -> torch.Tensor:
    """Columns in order from AWQ's packed slot order (see the module's docstring)."""
    rows, width = slots.shape
    order = torch.tensor(_AWQ_ORDER)
    columns = torch.empty_like(slots)
    columns.view(rows, width // 8, 8)[:, :, order] = slots.view(rows, width // 8, 8)
    return columns
