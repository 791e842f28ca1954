"""What every packed-checkpoint scheme shares: the weight a layer loads as, the scheme's interface
(quantized_checkpoints.py drives it), the unpacking of int32 words of 4- or 8-bit values, and the
re-laying of grouped integers into the native products' layout."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Union

import torch

from tokenmill.kernels.w8a8 import W8A8Weight
from tokenmill.kernels.quantized import BLOCK, QuantizedWeight, pack_blocks

LoadedWeight = Union[torch.Tensor, QuantizedWeight, W8A8Weight]


class PackedScheme(Protocol):
    """How one checkpoint's packed layers are read."""

    def layer_of(self, name: str) -> Optional[str]:
        """The layer prefix of a tensor of a packed layer (`...q_proj` of `...q_proj.qweight`), else None."""

    def unused(self, name: str) -> bool:
        """Whether the model never reads tensor `name` (e.g. KV-cache scales the cache does not use)."""

    def complete(self, layer: str, parts: dict[str, torch.Tensor], names: set[str]) -> bool:
        """Whether every part of `layer` the checkpoint has (`names`) has arrived."""

    def load(self, layer: str, parts: dict[str, torch.Tensor], keep_packed: bool) -> tuple[LoadedWeight, str]:
        """The layer's weight from its parts (keyed by the name after the layer's prefix), and how it was
        kept (a short phrase for the load log, e.g. "int4 packed")."""


class LayerParts:
    """Which tensors form a checkpoint's packed layers: a layer's parts are named `<layer>.<part>` for the
    part names `parts`; `layers`, where given, are the only prefixes that are layers (a float layer's
    `.weight` is not a part of a packed one)."""

    def __init__(self, parts: Sequence[str], layers: Optional[set[str]] = None) -> None:
        self.parts, self.layers = tuple(parts), layers

    def layer_of(self, name: str) -> Optional[str]:
        """The layer prefix of tensor `name` if it is a part of a packed layer, else None."""
        prefix, _, part = name.rpartition(".")
        return prefix if part in self.parts and (self.layers is None or prefix in self.layers) else None

    def complete(self, layer: str, parts: dict[str, torch.Tensor], names: set[str]) -> bool:
        """Whether every part of `layer` the checkpoint has (`names`) has arrived."""
        return all(part in parts for part in self.parts if f"{layer}.{part}" in names)


def kv_cache_scale(name: str) -> bool:
    """Whether tensor `name` is an attention layer's KV-cache scale (`k_scale`, `v_scale`), which no layer
    reads: a one-byte KV cache scales each row itself (compressed_tensors.py)."""
    return name.endswith((".k_scale", ".v_scale"))


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 / bits values per word along the rows (low bits first) -> [R * 32 / bits, C]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 / bits values per word along the columns (low bits first) -> [R, C * 32 / bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)


def packed_when_in_runs(u: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
                        bits: int) -> Optional[QuantizedWeight]:
    """u [out, in] (0 .. 2^bits - 1), zero points and float32 scales [out, groups], each input's group [in]
    (w = (u - zero) * scale): the int4 (4 bits) or int8 (8 bits) weight with, per 32 inputs, scale s and
    offset -s z of their group; or None where some run of 32 inputs spans two groups even with the inputs
    sorted by group. Groups shuffled over the inputs (activation order) are sorted so: the weight's columns
    are stored in that order and its `input_order` names the input of each. The offset is rounded once,
    from float64: exact where s is half precision (the schemes' docstrings say when)."""
    cols = u.shape[1]
    if cols % BLOCK:
        return None
    order = None
    if not _in_runs(groups):
        order = torch.argsort(groups, stable=True)  # each group's inputs together, in their own order
        groups, u = groups[order], u[:, order]
        if not _in_runs(groups):
            return None
    first = groups.view(-1, BLOCK)[:, 0]
    block_scales = scales[:, first]
    offsets = -(block_scales.double() * zeros[:, first].double()).float()
    packed = pack_blocks("int4" if bits == 4 else "int8", cols, u.to(torch.uint8).contiguous(), block_scales, offsets)
    packed.input_order = order
    return packed


def _in_runs(groups: torch.Tensor) -> bool:
    """Whether each run of 32 inputs lies in one group."""
    runs = groups.view(-1, BLOCK)
    return bool((runs == runs[:, :1]).all())
