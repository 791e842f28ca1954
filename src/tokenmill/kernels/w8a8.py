"""W8A8 weights: one-byte weight values (float8 e4m3, or int8) times activations quantised to the same
type per token: the weight type, its load-time quantisation, the per-token quantisation of activations,
and the float32 reference of the product.

A [rows, cols] weight is one-byte values `data` and float32 scales, w = data * scale. The values' type
(`ValueType`: `FP8` e4m3, largest 448; `INT8`, largest 127) follows `data`'s dtype and decides the
activations' type:

- per output channel: `scale` [rows, 1], `block` None. A checkpoint's per-tensor scale is stored so too
  (the one value repeated), which lets fused q/k/v or gate/up parts of different scales stack by rows.
- per block of `block` columns (FP8 only: DeepSeek's and Qwen3-FP8's 128 x 128 blocks, compressed-tensors'
  block and group strategies): `scale` [rows, ceil(cols / block)], each row holding the scales of its row
  block (stored per row, so rows narrow and stack at any row, not only at block boundaries).

Activations are quantised dynamically, per token (channel weights) or per token and `block` columns
(block weights, DeepSeek's recipe): scale = max |x| / largest over the group, q = x / scale (IEEE float32
division) rounded to nearest even into the value type (e4m3, or an integer in [-127, 127]). The product is
then sum_k (q_x s_x)(q_w s_w) over each group; `reference_linear` computes it in float32 from dequantised
operands (the oracle of the kernels, layers/w8a8_linear.py and layers/triton_w8a8.py). For int8 the sums
sum_k q_x q_w are integers, which the products accumulate exactly in int32 (|q| <= 127: exact for
K < 2^31 / 127^2, about 133,000 columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from tokenmill.kernels.quantized import BLOCK, QuantizedWeight, pack_blocks

FP8_MAX = 448.0  # the largest finite e4m3fn value
INT8_MAX = 127.0  # symmetric: -128 is never produced, so -q is always a value too
# a group whose values are all zero gets this max |x| (so a finite scale and zero values, not 0 / 0)
MIN_AMAX = 1e-12
BLOCK_WIDTHS = (32, 64, 128)  # the column blocks the products take (tl.dot's K tile is one block)


@dataclass(frozen=True)
class ValueType:
    """The one-byte values of a W8A8 product: their dtype, the largest magnitude a scale maps to, and the
    format a projection holding them reports."""

    format: str
    dtype: torch.dtype
    largest: float

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """float32 values already divided by their scale -> this type: clamped to +-largest, rounded to
        nearest even (torch's e4m3 cast rounds so; `torch.round` rounds halves to even)."""
        clamped = scaled.clamp(-self.largest, self.largest)
        return (clamped if self.dtype.is_floating_point else torch.round(clamped)).to(self.dtype)


FP8 = ValueType("fp8", torch.float8_e4m3fn, FP8_MAX)
INT8 = ValueType("int8_w8a8", torch.int8, INT8_MAX)
_VALUE_TYPES = {kind.dtype: kind for kind in (FP8, INT8)}


@dataclass
class W8A8Weight:
    """A [rows, cols] weight of e4m3 or int8 values with per-channel (or, for e4m3, per-block) scales
    (module docstring). Row operations (narrow, index, concatenate) work like a float weight's, so
    checkpoint shards fuse and split alike."""

    data: torch.Tensor  # float8_e4m3fn or int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, 1] (per channel) or [rows, ceil(cols / block)]
    block: Optional[int] = None  # columns per scale; None: one scale per row

    def __post_init__(self) -> None:
        rows, cols = self.data.shape
        groups = 1 if self.block is None else -(-cols // self.block)
        if self.data.dtype not in _VALUE_TYPES or tuple(self.scale.shape) != (rows, groups):
            raise ValueError(f"a W8A8 weight needs float8_e4m3fn or int8 values [{rows}, {cols}] and float32 "
                             f"scales [{rows}, {groups}]; got {self.data.dtype} values and scales "
                             f"{list(self.scale.shape)}")
        if self.block is not None and self.data.dtype == torch.int8:
            raise ValueError(f"int8 W8A8 weights take one scale per output channel, not per {self.block} columns")
        if self.block is not None and self.block not in BLOCK_WIDTHS:
            raise ValueError(f"FP8 weight scales per {self.block} columns are not supported (the FP8 products "
                             f"take blocks of {', '.join(map(str, BLOCK_WIDTHS))} columns)")

    @property
    def values(self) -> ValueType:
        """The type of the values (and of the activations they multiply): `FP8` or `INT8`."""
        return _VALUE_TYPES[self.data.dtype]

    @property
    def format(self) -> str:
        """'fp8' or 'int8_w8a8' (the projection's `quantized_format`)."""
        return self.values.format

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols), as a float weight's."""
        return tuple(self.data.shape)  # type: ignore[return-value]

    def narrow(self, dim: int, start: int, length: int) -> "W8A8Weight":
        """Rows [start, start + length) (dim 0), or columns (dim 1): any for per-channel scales, at whole
        blocks for block scales (the last block may be partial), so a tensor-parallel shard dequantises to
        exactly the same columns of the whole weight."""
        cols = self.data.shape[1]
        if dim == 0:
            return W8A8Weight(self.data.narrow(0, start, length), self.scale.narrow(0, start, length), self.block)
        if (start, length) == (0, cols):
            return self
        if self.block is None:
            return W8A8Weight(self.data.narrow(1, start, length).contiguous(), self.scale, None)
        if start % self.block or (length % self.block and start + length != cols):
            raise ValueError(f"a W8A8 weight with scales per {self.block} columns splits by input features only "
                             f"at multiples of {self.block}; asked for columns {start}..{start + length} of {cols}")
        first, count = start // self.block, -(-length // self.block)
        return W8A8Weight(self.data.narrow(1, start, length).contiguous(),
                          self.scale.narrow(1, first, count).contiguous(), self.block)

    def index_rows(self, index: torch.Tensor) -> "W8A8Weight":
        """The rows picked by `index` (a permutation or a selection)."""
        return W8A8Weight(self.data[index], self.scale[index], self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [rows, cols]: value times its scale in float32, then cast to `dtype`."""
        rows, cols = self.data.shape
        scale = self.scale if self.block is None else self.scale.repeat_interleave(self.block, 1)[:, :cols]
        return (self.data.float() * scale).to(dtype)

    def to(self, device: torch.device) -> "W8A8Weight":
        """The same weight on `device`."""
        return W8A8Weight(self.data.to(device), self.scale.to(device), self.block)

    @property
    def activation_group(self) -> Optional[int]:
        """Columns per activation scale: the weight's block (one scale per token and block), or None (one
        per token)."""
        return self.block

    def to_packed_int8(self) -> QuantizedWeight:
        """An int8 W8A8 weight as the packed int8 `QuantizedWeight` (kernels/quantized.py) the native CPU
        products take: u = v + 128, per 32 columns the row's scale s and offset -128 s (rounded once from
        float64, as compressed-tensors' packed layers are: exact for half-precision scales). ValueError for
        FP8 values or a width that is not a whole number of 32-column blocks."""
        rows, cols = self.data.shape
        if self.values is not INT8 or cols % BLOCK:
            raise ValueError(f"only int8 W8A8 weights of whole {BLOCK}-column blocks become packed int8 weights; "
                             f"this one is {self.data.dtype} [{rows}, {cols}]")
        u = (self.data.to(torch.int16) + 128).to(torch.uint8)
        scale = self.scale.float().expand(rows, cols // BLOCK).to(self.data.device)
        offset = -(scale.double() * 128).float()
        return pack_blocks("int8", cols, u.contiguous(), scale.contiguous(), offset.contiguous())


def cat_rows(parts: Sequence[W8A8Weight]) -> W8A8Weight:
    """Stack W8A8 weights of one width, one value type and one scale layout by rows (fusing q/k/v or
    gate/up)."""
    first = parts[0]
    if any(p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("only W8A8 weights of one width can be fused")
    if any(p.values is not first.values for p in parts):
        raise ValueError(f"W8A8 weights of {' and '.join(sorted({p.format for p in parts}))} values cannot be "
                         "fused into one projection")
    if any(p.block != first.block for p in parts):
        kinds = sorted({"per channel" if p.block is None else f"per {p.block} columns" for p in parts})
        raise ValueError(f"W8A8 weights with scales {' and '.join(kinds)} cannot be fused into one projection")
    if len(parts) == 1:
        return first
    return W8A8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), first.block)


def quantize_fp8(weight: torch.Tensor) -> W8A8Weight:
    """A float [rows, cols] weight quantised per output channel: scale = max |w| / 448 (float32), values
    e4m3(w / scale) rounded to nearest even (an all-zero row keeps scale 0 and zeros)."""
    w = weight.float()
    scale = w.abs().amax(1, keepdim=True) / FP8_MAX
    values = torch.where(scale > 0, w / torch.where(scale > 0, scale, 1.0), 0.0)
    return W8A8Weight(values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), scale.contiguous())


def as_fp8(part: Any) -> W8A8Weight:
    """A loaded weight part as an FP8 weight: itself if it is one; a float tensor, or any weight that
    dequantises (QuantizedWeight, an int8 W8A8Weight), quantised per output channel."""
    if isinstance(part, W8A8Weight) and part.values is FP8:
        return part
    return quantize_fp8(part if isinstance(part, torch.Tensor) else part.dequantize())


def from_checkpoint(values: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]] = None,
                    where: str = "W8A8 weight", zero_point: Optional[torch.Tensor] = None) -> W8A8Weight:
    """A W8A8 weight from a checkpoint's e4m3 or int8 `values` [rows, cols] and its `scale` (w = values *
    scale): one value (per tensor), [rows] or [rows, 1] (per channel), or, for e4m3, with `block` =
    (rows, cols) per scale, [ceil(rows / block rows), ceil(cols / block cols)] (block and group
    strategies). A `zero_point` (w = (values - zero_point) * scale) must be all zeros, which changes
    nothing: asymmetric values have no W8A8 product here. ValueError naming `where` for any other shape,
    dtype or zero point."""
    if values.dtype not in _VALUE_TYPES or values.dim() != 2:
        raise ValueError(f"{where}: the weight is {values.dtype} {list(values.shape)}; W8A8 weights are "
                         "float8_e4m3fn or int8 matrices")
    if zero_point is not None and bool(zero_point.ne(0).any()):
        raise ValueError(f"{where}: its zero points are not all zero; asymmetric weights have no W8A8 product "
                         "(they multiply as packed int8 weights)")
    rows, cols = values.shape
    scale = scale.float()
    if block is not None and values.dtype == torch.int8:
        raise ValueError(f"{where}: int8 W8A8 weights take scales per tensor or per output channel, not per "
                         f"{block[0]} x {block[1]} block")
    if block is None:
        if scale.numel() == 1:
            return W8A8Weight(values.contiguous(), scale.reshape(1, 1).expand(rows, 1).contiguous())
        if scale.numel() == rows and scale.dim() <= 2 and scale.shape[0] == rows:
            return W8A8Weight(values.contiguous(), scale.reshape(rows, 1).contiguous())
        raise ValueError(f"{where}: its scale is {list(scale.shape)}, neither one value nor one per output "
                         f"channel of a [{rows}, {cols}] weight")
    block_rows, block_cols = block
    expected = [-(-rows // block_rows), -(-cols // block_cols)]
    if list(scale.shape) != expected:
        raise ValueError(f"{where}: its scale is {list(scale.shape)}; blocks of {block_rows} x {block_cols} over a "
                         f"[{rows}, {cols}] weight need {expected}")
    if block_cols not in BLOCK_WIDTHS:
        raise ValueError(f"{where}: scales per {block_cols} columns are not supported (the FP8 products take "
                         f"blocks of {', '.join(map(str, BLOCK_WIDTHS))} columns)")
    per_row = scale.repeat_interleave(block_rows, 0)[:rows].contiguous()
    return W8A8Weight(values.contiguous(), per_row, block_cols)


def quantize_activations(x: torch.Tensor, group: Optional[int], values: ValueType = FP8
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, cols] -> (q [m, cols] of `values`' dtype, scales float32 [m, groups]): one scale per row
    (`group` None) or per row and `group` columns; scale = max(max |x|, MIN_AMAX) / largest, q = x / scale
    (IEEE float32 division) clamped and rounded to nearest even (`ValueType.encode`). Row-wise: a row's
    values never depend on another's."""
    m, cols = x.shape
    width = cols if group is None else group
    groups = -(-cols // width)
    blocks = F.pad(x.float(), (0, groups * width - cols)).view(m, groups, width)
    scale = blocks.abs().amax(-1).clamp(min=MIN_AMAX) / values.largest
    q = values.encode(blocks / scale.unsqueeze(-1))
    return q.view(m, -1)[:, :cols], scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: Optional[int]) -> torch.Tensor:
    """The float32 values [m, cols] of activations quantised per row (`group` None) or per row and
    `group` columns (the last group may be partial): q times its group's scale."""
    cols = q.shape[1]
    return q.float() * (scale if group is None else scale.repeat_interleave(group, 1)[:, :cols])


def reference_linear(x: torch.Tensor, weight: W8A8Weight, bias: Optional[torch.Tensor],
                     quantize_inputs: bool = True) -> torch.Tensor:
    """The W8A8 product in float32: x quantised as `quantize_activations` does (unless not
    `quantize_inputs`: the weight-only product), both operands dequantised, multiplied in float32, the
    bias added, cast to x's dtype. The kernels equal it up to summation order."""
    flat = x.reshape(-1, x.shape[-1])
    if quantize_inputs:
        group = weight.activation_group
        flat = dequantize_activations(*quantize_activations(flat, group, weight.values), group)
    y = F.linear(flat.float(), weight.dequantize(), None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], -1)
