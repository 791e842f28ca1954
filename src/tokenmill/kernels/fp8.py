"""FP8 weights (float8 e4m3, W8A8): the weight type, its load-time quantisation, the per-token
quantisation of activations, and the float32 reference of the product.

A [rows, cols] weight is e4m3 values `data` and float32 scales, w = data * scale:

- per output channel: `scale` [rows, 1], `block` None. A checkpoint's per-tensor scale is stored so too
  (the one value repeated), which lets fused q/k/v or gate/up parts of different scales stack by rows.
- per block of `block` columns (DeepSeek's and Qwen3-FP8's 128 x 128 blocks, compressed-tensors' block and
  group strategies): `scale` [rows, ceil(cols / block)], each row holding the scales of its row block
  (stored per row, so rows narrow and stack at any row, not only at block boundaries).

Activations are quantised dynamically, per token (channel weights) or per token and `block` columns
(block weights, DeepSeek's recipe): scale = max |x| / 448 over the group, q = e4m3(x / scale) rounded
to nearest even, the division and rounding as IEEE float32 does them. The product is then
sum_k (q_x s_x)(q_w s_w) over each group; `reference_linear` computes it in float32 from dequantised
operands (the oracle of the kernels, layers/fp8_linear.py and layers/triton_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # the largest finite e4m3fn value
# a group whose values are all zero gets this max |x| (so a finite scale and zero values, not 0 / 0)
MIN_AMAX = 1e-12
BLOCK_WIDTHS = (32, 64, 128)  # the column blocks the products take (tl.dot's K tile is one block)


@dataclass
class Fp8Weight:
    """A [rows, cols] e4m3 weight with per-channel or per-block scales (module docstring). Row operations
    (narrow, index, concatenate) work like a float weight's, so checkpoint shards fuse and split alike."""

    data: torch.Tensor  # float8_e4m3fn [rows, cols]
    scale: torch.Tensor  # float32 [rows, 1] (per channel) or [rows, ceil(cols / block)]
    block: Optional[int] = None  # columns per scale; None: one scale per row

    format = "fp8"

    def __post_init__(self) -> None:
        rows, cols = self.data.shape
        groups = 1 if self.block is None else -(-cols // self.block)
        if self.data.dtype != torch.float8_e4m3fn or tuple(self.scale.shape) != (rows, groups):
            raise ValueError(f"an FP8 weight needs float8_e4m3fn values [{rows}, {cols}] and float32 scales "
                             f"[{rows}, {groups}]; got {self.data.dtype} values and scales {list(self.scale.shape)}")
        if self.block is not None and self.block not in BLOCK_WIDTHS:
            raise ValueError(f"FP8 weight scales per {self.block} columns are not supported (the FP8 products "
                             f"take blocks of {', '.join(map(str, BLOCK_WIDTHS))} columns)")

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols), as a float weight's."""
        return tuple(self.data.shape)  # type: ignore[return-value]

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        """Rows [start, start + length) (dim 0), or columns (dim 1): any for per-channel scales, at whole
        blocks for block scales (the last block may be partial), so a tensor-parallel shard dequantises to
        exactly the same columns of the whole weight."""
        cols = self.data.shape[1]
        if dim == 0:
            return Fp8Weight(self.data.narrow(0, start, length), self.scale.narrow(0, start, length), self.block)
        if (start, length) == (0, cols):
            return self
        if self.block is None:
            return Fp8Weight(self.data.narrow(1, start, length).contiguous(), self.scale, None)
        if start % self.block or (length % self.block and start + length != cols):
            raise ValueError(f"an FP8 weight with scales per {self.block} columns splits by input features only "
                             f"at multiples of {self.block}; asked for columns {start}..{start + length} of {cols}")
        first, count = start // self.block, -(-length // self.block)
        return Fp8Weight(self.data.narrow(1, start, length).contiguous(), self.scale.narrow(1, first, count).contiguous(),
                         self.block)

    def index_rows(self, index: torch.Tensor) -> "Fp8Weight":
        """The rows picked by `index` (a permutation or a selection)."""
        return Fp8Weight(self.data[index], self.scale[index], self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [rows, cols]: e4m3 value times its scale in float32, then cast to `dtype`."""
        rows, cols = self.data.shape
        scale = self.scale if self.block is None else self.scale.repeat_interleave(self.block, 1)[:, :cols]
        return (self.data.float() * scale).to(dtype)

    def to(self, device: torch.device) -> "Fp8Weight":
        """The same weight on `device`."""
        return Fp8Weight(self.data.to(device), self.scale.to(device), self.block)

    @property
    def activation_group(self) -> Optional[int]:
        """Columns per activation scale: the weight's block (one scale per token and block), or None (one
        per token)."""
        return self.block


def cat_rows(parts: Sequence[Fp8Weight]) -> Fp8Weight:
    """Stack FP8 weights of one width and one scale layout by rows (fusing q/k/v or gate/up)."""
    first = parts[0]
    if any(p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("only FP8 weights of one width can be fused")
    if any(p.block != first.block for p in parts):
        kinds = sorted({"per channel" if p.block is None else f"per {p.block} columns" for p in parts})
        raise ValueError(f"FP8 weights with scales {' and '.join(kinds)} cannot be fused into one projection")
    if len(parts) == 1:
        return first
    return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), first.block)


def quantize(weight: torch.Tensor) -> Fp8Weight:
    """A float [rows, cols] weight quantised per output channel: scale = max |w| / 448 (float32), values
    e4m3(w / scale) rounded to nearest even (an all-zero row keeps scale 0 and zeros)."""
    w = weight.float()
    scale = w.abs().amax(1, keepdim=True) / FP8_MAX
    values = torch.where(scale > 0, w / torch.where(scale > 0, scale, 1.0), 0.0)
    return Fp8Weight(values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), scale.contiguous())


def as_fp8(part: Any) -> Fp8Weight:
    """A loaded weight part as an FP8 weight: itself if it is one; a float tensor, or any weight that
    dequantises (QuantizedWeight), quantised per output channel."""
    if isinstance(part, Fp8Weight):
        return part
    return quantize(part if isinstance(part, torch.Tensor) else part.dequantize())


def from_checkpoint(values: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]] = None,
                    where: str = "FP8 weight") -> Fp8Weight:
    """An FP8 weight from a checkpoint's e4m3 `values` [rows, cols] and its `scale` (w = values * scale):
    one value (per tensor), [rows] or [rows, 1] (per channel), or with `block` = (rows, cols) per scale,
    [ceil(rows / block rows), ceil(cols / block cols)] (block and group strategies). ValueError naming
    `where` for any other shape or dtype."""
    if values.dtype != torch.float8_e4m3fn or values.dim() != 2:
        raise ValueError(f"{where}: the weight is {values.dtype} {list(values.shape)}; FP8 weights are "
                         "float8_e4m3fn matrices")
    rows, cols = values.shape
    scale = scale.float()
    if block is None:
        if scale.numel() == 1:
            return Fp8Weight(values.contiguous(), scale.reshape(1, 1).expand(rows, 1).contiguous())
        if scale.numel() == rows and scale.dim() <= 2 and scale.shape[0] == rows:
            return Fp8Weight(values.contiguous(), scale.reshape(rows, 1).contiguous())
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
    return Fp8Weight(values.contiguous(), per_row, block_cols)


def quantize_activations(x: torch.Tensor, group: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, cols] -> (q float8_e4m3fn [m, cols], scales float32 [m, groups]): one scale per row (`group`
    None) or per row and `group` columns; scale = max(max |x|, MIN_AMAX) / 448, q = e4m3(x / scale)
    (IEEE float32 division, rounded to nearest even). Row-wise: a row's values never depend on another's."""
    m, cols = x.shape
    width = cols if group is None else group
    groups = -(-cols // width)
    blocks = F.pad(x.float(), (0, groups * width - cols)).view(m, groups, width)
    scale = blocks.abs().amax(-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :cols], scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: Optional[int]) -> torch.Tensor:
    """The float32 values [m, cols] of activations quantised per row (`group` None) or per row and
    `group` columns (the last group may be partial): q times its group's scale."""
    cols = q.shape[1]
    return q.float() * (scale if group is None else scale.repeat_interleave(group, 1)[:, :cols])


def reference_linear(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
                     quantize_inputs: bool = True) -> torch.Tensor:
    """The FP8 product in float32: x quantised as `quantize_activations` does (unless not
    `quantize_inputs`: the weight-only product), both operands dequantised, multiplied in float32, the
    bias added, cast to x's dtype. The kernels equal it up to summation order."""
    flat = x.reshape(-1, x.shape[-1])
    if quantize_inputs:
        group = weight.activation_group
        flat = dequantize_activations(*quantize_activations(flat, group), group)
    y = F.linear(flat.float(), weight.dequantize(), None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], -1)
