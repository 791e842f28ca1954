"""Weight-only quantised weights, kept packed in memory and multiplied without dequantising them.

One layout serves every quantised format while a model loads (checkpoint shards fuse and permute by
rows in it): a [rows, cols] weight in 32-column blocks, each with a scale and offset,
`w = scale * u + offset` for an unsigned byte value u. The native kernels repack it once into their
own cell layout (kernels/quant_cells.h) and keep only that.
Scales and offsets are float16 when every one of them is exactly a float16 (GGUF's own Q8_0/Q4_0/Q4_1
scales are, and load-time quantisation rounds its scales to float16 first), else float32 (Q4_K's
products of two scales). Rows are padded to a multiple of 64 columns with blocks of scale 0 and offset 0.

- int8: u in 0..255, one per byte; offset = -128 * scale. GGUF Q8_0, and the five-bit Q5_0, Q5_1 and Q5_K
  (u = the five-bit value, per 32-weight sub-block), convert exactly; float weights quantise
  symmetrically (absmax / 127 per block). An int8 weight may also carry a signed 8-bit sub-scale per
  16 columns (`sub_scale`), which multiplies the block's value: w = sub * (scale * u + offset). GGUF
  Q6_K converts exactly so (u = the six-bit value, scale = the super-block's d, offset = -32 d, sub =
  the 16-weight scale), as llama.cpp's Q6_K dot product computes it.
- int4: u in 0..15, two per byte: the 32 bytes of block pair p hold block 2p in their low nibbles and
  block 2p + 1 in their high nibbles. GGUF Q4_0 (offset = -8 * scale), Q4_1 and Q4_K (per 32-weight
  sub-block) convert exactly; float weights quantise asymmetrically (min/max per block, llama.cpp's Q4_1).
- activation order (GPTQ `desc_act`, compressed-tensors `weight_g_idx`): a checkpoint whose groups are
  shuffled over the input features is stored with its columns permuted so that each group's inputs are
  contiguous, and `input_order` says which input feature each stored column multiplies: stored column p
  holds input `input_order[p]`, so y = x[..., input_order] times the stored weight. Products gather the
  input's features in that order; `dequantize` gives the weight in the inputs' own order.

A product with few input rows (decode) quantises its input per 32-value block to int8 (absmax / 127,
round half to even) and takes integer dot products, as llama.cpp does; with more rows the weight is
dequantised to the compute dtype and multiplied as a float weight, where one dequantisation serves many
rows. How few is `int8_product_below`: `DEQUANTIZE_FROM_ROWS` rows, or `AMX_FROM_ROWS` where the
native kernels multiply bfloat16 on AMX tiles, which dequantise a few columns at a time into tiles that
never reach memory (below `AMX_BELOW_ROWS` rows; whole weights are dequantised from there).
`reference_linear` is the same arithmetic in PyTorch, the oracle of the native kernels and their
stand-in where they cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

BLOCK = 32
# measured crossovers of the ways to multiply (`tokenmill bench linears`, docs/benchmarks.md)
DEQUANTIZE_FROM_ROWS = 24
AMX_FROM_ROWS = 16
AMX_BELOW_ROWS = 768
FORMATS = ("int8", "int4")
T = GGMLQuantizationType
# GGUF encodings that convert into this layout without loss, and the format they become
EXACT_GGUF_FORMATS = {T.Q8_0: "int8", T.Q5_0: "int8", T.Q5_1: "int8", T.Q5_K: "int8", T.Q6_K: "int8",
                      T.Q4_0: "int4", T.Q4_1: "int4", T.Q4_K: "int4"}
SUB_BLOCK = 16  # columns per sub-scale


def padded_cols(cols: int) -> int:
    """Columns rounded up to the 64 the kernel consumes per step."""
    return (cols + 2 * BLOCK - 1) // (2 * BLOCK) * (2 * BLOCK)


@dataclass
class QuantizedWeight:
    """A [rows, cols] weight in the packed layout above. Row operations (narrow, index, concatenate)
    work like a float weight's, so checkpoint shards fuse and permute the same way."""

    format: str
    cols: int
    data: torch.Tensor  # uint8 [rows, padded_cols] (int8) or [rows, padded_cols / 2] (int4)
    scale: torch.Tensor  # float16 or float32 [rows, padded_cols / 32]
    offset: torch.Tensor  # same dtype and shape as scale
    sub_scale: Optional[torch.Tensor] = None  # int8 [rows, padded_cols / 16], int8 format only; None: all 1
    input_order: Optional[torch.Tensor] = None  # int64 [cols]: the input feature of each stored column; None: in order

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols), as a float weight's."""
        return (self.data.shape[0], self.cols)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """Rows [start, start + length) (dim 0), or columns (dim 1) at whole 32-column blocks: the
        values, scales and offsets are taken as they are (a tensor-parallel shard dequantises exactly
        to the same columns of the whole weight)."""
        if dim == 1 and (start, length) == (0, self.cols):
            return self
        if dim == 0:
            return self.index_rows(torch.arange(start, start + length))
        if start % BLOCK or length % BLOCK:
            raise ValueError(f"a quantised weight splits by input features only at multiples of {BLOCK} "
                             f"columns; asked for columns {start}..{start + length} of {self.cols}")
        if self.input_order is not None:
            return self._narrow_ordered(start, length)
        first, count = start // BLOCK, length // BLOCK
        sub = None if self.sub_scale is None else self.sub_scale[:, start // SUB_BLOCK:(start + length) // SUB_BLOCK]
        return pack_blocks(self.format, length, self.unsigned_values()[:, start:start + length],
                             self.scale[:, first:first + count], self.offset[:, first:first + count], sub)

    def _narrow_ordered(self, start: int, length: int) -> "QuantizedWeight":
        """Input features [start, start + length) of a weight in activation order: the stored columns that
        hold them, in stored order, which must again come in runs of 32 sharing one block's scale."""
        positions = torch.nonzero((self.input_order >= start) & (self.input_order < start + length)).flatten()
        blocks = (positions // BLOCK).view(-1, BLOCK)
        if self.sub_scale is not None or not bool((blocks == blocks[:, :1]).all()):
            raise ValueError(f"input features {start}..{start + length} of a weight in activation order (GPTQ "
                             f"desc_act / g_idx) do not keep its groups in runs of {BLOCK}: such a weight cannot "
                             f"be split by input features (row-parallel tensor parallelism); serve it on one rank")
        first = blocks[:, 0]
        order = self.input_order[positions] - start
        narrowed = pack_blocks(self.format, length, self.unsigned_values()[:, positions], self.scale[:, first],
                               self.offset[:, first])
        if not torch.equal(order, torch.arange(length, device=order.device)):
            narrowed.input_order = order
        return narrowed

    def index_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The rows picked by `index` (a permutation or a selection)."""
        return QuantizedWeight(self.format, self.cols, self.data[index], self.scale[index], self.offset[index],
                               None if self.sub_scale is None else self.sub_scale[index], self.input_order)

    def unsigned_values(self) -> torch.Tensor:
        """u as uint8 [rows, padded_cols]."""
        if self.format == "int8":
            return self.data
        rows = self.data.shape[0]
        pairs = self.data.view(rows, -1, BLOCK)
        return torch.stack((pairs & 0x0F, pairs >> 4), dim=2).reshape(rows, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [rows, cols], its columns in the inputs' order."""
        stored = self.dequantize_stored(dtype)
        if self.input_order is None:
            return stored
        weight = torch.empty_like(stored)
        weight[:, self.input_order] = stored
        return weight

    def dequantize_stored(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [rows, cols] with its columns as stored (permuted by `input_order`, if any)."""
        rows = self.data.shape[0]
        u = self.unsigned_values().view(rows, -1, BLOCK).float()
        w = u * self.scale.float().unsqueeze(-1) + self.offset.float().unsqueeze(-1)
        if self.sub_scale is not None:
            w = w.view(rows, -1, SUB_BLOCK) * self.sub_scale.float().unsqueeze(-1)
        return w.reshape(rows, -1)[:, :self.cols].to(dtype)

    def to(self, device: torch.device) -> "QuantizedWeight":
        """The same weight on `device`."""
        return QuantizedWeight(self.format, self.cols, self.data.to(device), self.scale.to(device),
                               self.offset.to(device), None if self.sub_scale is None else self.sub_scale.to(device),
                               None if self.input_order is None else self.input_order.to(device))

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantised: an embedding lookup that keeps the table packed."""
        return self.index_rows(ids).dequantize(dtype)

    def to_format(self, fmt: str) -> "QuantizedWeight":
        """Self when already in `fmt`; int4 as int8 exactly (the same u, scales and offsets); else
        requantised through float32."""
        if fmt == self.format:
            return self
        if (self.format, fmt) == ("int4", "int8"):
            return QuantizedWeight(fmt, self.cols, self.unsigned_values().contiguous(), self.scale, self.offset,
                                   input_order=self.input_order)
        return quantize(self.dequantize(), fmt)

    def sub_scales(self) -> torch.Tensor:
        """The sub-scales, ones where the weight has none: int8 [rows, padded_cols / 16]."""
        if self.sub_scale is not None:
            return self.sub_scale
        return torch.ones(self.data.shape[0], self.scale.shape[1] * (BLOCK // SUB_BLOCK), dtype=torch.int8)


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format and width by rows (fusing q/k/v or gate/up); parts without sub-scales
    get ones when another part has them. Parts in activation order must share one input order (as the
    projections of one input do: GPTQ orders a layer's inputs by their activations)."""
    first = parts[0]
    if any(p.format != first.format or p.cols != first.cols for p in parts):
        raise ValueError("only weights of one format and width can be fused")
    if any(not _same_order(p.input_order, first.input_order) for p in parts):
        raise ValueError("fused projections (q/k/v or gate/up) in activation order (GPTQ desc_act / g_idx) must "
                         "share one order of their input features; these parts order them differently")
    scale_dtype = torch.float16 if all(p.scale.dtype == torch.float16 for p in parts) else torch.float32
    sub = None
    if any(p.sub_scale is not None for p in parts):
        sub = torch.cat([p.sub_scales() for p in parts])
    return QuantizedWeight(first.format, first.cols, torch.cat([p.data for p in parts]),
                           torch.cat([p.scale.to(scale_dtype) for p in parts]),
                           torch.cat([p.offset.to(scale_dtype) for p in parts]), sub, first.input_order)


def _same_order(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _pack(fmt: str, cols: int, u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
          sub_scale: Optional[torch.Tensor] = None) -> QuantizedWeight:
    """From u [rows, padded_cols] (uint8), per-block scale/offset [rows, padded_cols / 32] and, for int8,
    optional sub-scales [rows, padded_cols / 16]."""
    rows = u.shape[0]
    if fmt == "int4":
        if sub_scale is not None:
            raise ValueError("sub-scales go with int8 weights only")
        pairs = u.view(rows, -1, 2, BLOCK)
        u = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(rows, -1)
    scale, offset = scale.float(), offset.float()
    if _exact_in_half(scale) and _exact_in_half(offset):
        scale, offset = scale.half(), offset.half()
    if sub_scale is not None:
        sub_scale = sub_scale.to(torch.int8).contiguous()
    return QuantizedWeight(fmt, cols, u.contiguous(), scale.contiguous(), offset.contiguous(), sub_scale)


def _exact_in_half(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def _half_rounded(values: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to the nearest float16 (kept finite)."""
    return values.clamp(-65504, 65504).half().float()


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, and 0 where a block's scale is 0 (an all-zero block quantises to zeros)."""
    return torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))


def _check_cols(cols: int) -> None:
    if cols % BLOCK:
        raise ValueError(f"quantised weights need a multiple of {BLOCK} input features, got {cols}")


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Quantise a float [rows, cols] weight per 32-column block (int8: absmax; int4: min/max)."""
    if fmt not in FORMATS:
        raise ValueError(f"quantisation format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    rows, cols = weight.shape
    _check_cols(cols)
    w = F.pad(weight.float(), (0, padded_cols(cols) - cols)).view(rows, -1, BLOCK)
    if fmt == "int8":
        scale = _half_rounded(w.abs().amax(-1) / 127)
        u = (torch.round(w * _reciprocal(scale).unsqueeze(-1)).clamp(-127, 127) + 128).to(torch.uint8)
        return _pack(fmt, cols, u.reshape(rows, -1), scale, -128 * scale)
    low, high = _half_rounded(w.amin(-1)), w.amax(-1)
    scale = _half_rounded((high - low) / 15)
    u = torch.round((w - low.unsqueeze(-1)) * _reciprocal(scale).unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return _pack(fmt, cols, u.reshape(rows, -1), scale, low)


def from_gguf(tensor_type: GGMLQuantizationType, raw: np.ndarray, cols: int) -> QuantizedWeight:
    """Convert GGUF blocks (raw uint8 [rows, bytes per row]) of an `EXACT_GGUF_FORMATS` type, exactly:
    every value dequantises to gguf's (for Q6_K, sub * (d u - 32 d) is exact until its one rounding,
    as gguf's (d sub) (u - 32) is)."""
    _check_cols(cols)
    rows = raw.shape[0]
    if tensor_type == T.Q8_0:
        blocks = raw.reshape(rows, -1, 34)
        scale = _half_fields(blocks[..., 0:2]).reshape(rows, -1)
        u = torch.from_numpy((blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
        return pack_blocks("int8", cols, u.reshape(rows, -1), scale, -128 * scale)
    if tensor_type in (T.Q4_0, T.Q4_1):
        size = 18 if tensor_type == T.Q4_0 else 20
        blocks = raw.reshape(rows, -1, size)
        scale = _half_fields(blocks[..., 0:2]).reshape(rows, -1)
        offset = -8 * scale if tensor_type == T.Q4_0 else _half_fields(blocks[..., 2:4]).reshape(rows, -1)
        nibbles = blocks[..., size - 16:]  # byte i: element i (low nibble) and i + 16 (high)
        u = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)
        return pack_blocks("int4", cols, torch.from_numpy(u.reshape(rows, -1)), scale, offset)
    if tensor_type == T.Q4_K:
        blocks = raw.reshape(rows, -1, 144)  # 256 weights: d, dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
        d, dmin = _half_fields(blocks[..., 0:2]), _half_fields(blocks[..., 2:4])
        sc, mins = _q4_k_scales_and_mins(blocks[..., 4:16])
        scale = (d * torch.from_numpy(sc).float()).reshape(rows, -1)
        offset = -(dmin * torch.from_numpy(mins).float()).reshape(rows, -1)
        nibbles = blocks[..., 16:].reshape(rows, -1, 4, 32)  # chunk c: sub-block 2c low, 2c + 1 high
        u = np.stack((nibbles & 0x0F, nibbles >> 4), axis=3)
        return pack_blocks("int4", cols, torch.from_numpy(u.reshape(rows, -1)), scale, offset)
    if tensor_type in (T.Q5_0, T.Q5_1):
        size = 22 if tensor_type == T.Q5_0 else 24
        blocks = raw.reshape(rows, -1, size)
        scale = _half_fields(blocks[..., 0:2]).reshape(rows, -1)
        offset = -16 * scale if tensor_type == T.Q5_0 else _half_fields(blocks[..., 2:4]).reshape(rows, -1)
        high_bits = np.unpackbits(blocks[..., size - 20:size - 16], axis=-1, bitorder="little")  # bit j: element j
        nibbles = blocks[..., size - 16:]
        u = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1) | (high_bits << 4)
        return pack_blocks("int8", cols, torch.from_numpy(u.reshape(rows, -1)), scale, offset)
    if tensor_type == T.Q5_K:
        blocks = raw.reshape(rows, -1, 176)  # 256 weights: d, dmin, 12 bytes of scales/mins, 32 of high bits, 128 of nibbles
        d, dmin = _half_fields(blocks[..., 0:2]), _half_fields(blocks[..., 2:4])
        sc, mins = _q4_k_scales_and_mins(blocks[..., 4:16])
        scale = (d * torch.from_numpy(sc).float()).reshape(rows, -1)
        offset = -(dmin * torch.from_numpy(mins).float()).reshape(rows, -1)
        high = blocks[..., 16:48]  # bit s of byte l: the fifth bit of element l of sub-block s
        nibbles = blocks[..., 48:].reshape(rows, -1, 4, 32)  # chunk c: sub-block 2c low, 2c + 1 high
        low = np.stack((nibbles & 0x0F, nibbles >> 4), axis=3).reshape(rows, -1, 8, 32)
        fifth = (high[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        u = low | (fifth << 4)
        return pack_blocks("int8", cols, torch.from_numpy(u.reshape(rows, -1)), scale, offset)
    if tensor_type == T.Q6_K:
        return _q6_k(raw, cols)
    raise ValueError(f"GGUF type {tensor_type.name} does not convert exactly; "
                     f"exact: {', '.join(t.name for t in EXACT_GGUF_FORMATS)}")


def _half_fields(fields: np.ndarray) -> torch.Tensor:
    """float16 fields stored as byte pairs (uint8 [..., 2]) -> float32 [..., 1]."""
    return torch.from_numpy(np.ascontiguousarray(fields).view(np.float16).astype(np.float32))


def _q6_k(raw: np.ndarray, cols: int) -> QuantizedWeight:
    """Q6_K super-blocks of 256 weights: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales
    (one per 16 weights, in order), then d. Each half of 128 weights reads 64 nibble bytes and 32 bit-pair
    bytes: weights 32j + l (j < 4, l < 32) take nibble byte l (j even) or 32 + l (j odd), low nibble for
    j < 2, and bits 2j, 2j + 1 of bit-pair byte l (llama.cpp's dequantize_row_q6_K)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 210)
    d = _half_fields(blocks[..., 208:210])  # [rows, super-blocks, 1]
    nibbles = blocks[..., :128].reshape(rows, -1, 2, 2, 32)  # half, byte run (l or 32 + l), l
    pairs = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = np.stack((nibbles[:, :, :, 0] & 0x0F, nibbles[:, :, :, 1] & 0x0F,
                    nibbles[:, :, :, 0] >> 4, nibbles[:, :, :, 1] >> 4), axis=3)  # [rows, sb, half, j, l]
    high = (pairs >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
    u = torch.from_numpy((low | (high << 4)).reshape(rows, -1))
    sub = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1))
    scale = d.expand(rows, d.shape[1], 256 // BLOCK).reshape(rows, -1)
    return pack_blocks("int8", cols, u, scale, -32 * scale, sub)


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K super-block (llama.cpp's get_scale_min_k4)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mins = np.concatenate((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return scales, mins


def pack_blocks(fmt: str, cols: int, u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                sub_scale: Optional[torch.Tensor] = None) -> QuantizedWeight:
    """A weight in `fmt` from u [rows, cols] (uint8), scale and offset [rows, cols / 32] (w = scale u +
    offset per 32 columns) and, for int8, optional sub-scales [rows, cols / 16]; padded to whole steps."""
    extra = padded_cols(cols) - cols
    if extra:
        u = F.pad(u, (0, extra))
        scale, offset = F.pad(scale, (0, extra // BLOCK)), F.pad(offset, (0, extra // BLOCK))
        if sub_scale is not None:
            sub_scale = F.pad(sub_scale, (0, extra // SUB_BLOCK))
    return _pack(fmt, cols, u, scale, offset, sub_scale)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, cols] -> (q as float32 [m, padded_cols] in [-127, 127], dx [m, padded_cols / 32]):
    x ~ dx * q per 32-value block, as the native kernel quantises it."""
    m, cols = x.shape
    blocks = F.pad(x.float(), (0, padded_cols(cols) - cols)).view(m, -1, BLOCK)
    dx = blocks.abs().amax(-1) / 127
    q = torch.round(blocks * _reciprocal(dx).unsqueeze(-1)).clamp(-127, 127)
    return q.reshape(m, -1), dx


def int8_product_below(amx: bool) -> int:
    """Input rows below which a product quantises its input and takes int8 dot products; `amx`: the
    native kernels run this product on AMX tiles."""
    return AMX_FROM_ROWS if amx else DEQUANTIZE_FROM_ROWS


def reference_linear(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor],
                     int8_below: Optional[int] = None) -> torch.Tensor:
    """The quantised product in PyTorch. Fewer rows than `int8_below` (default
    `int8_product_below(False)`): input quantised per block, then a float32 matmul with the dequantised
    weight; more: the weight dequantised to x's dtype, then x W^T. Equals the native kernels up to
    summation order. A weight in activation order multiplies the input's features in its stored order,
    as the native kernels do."""
    flat = x.reshape(-1, x.shape[-1])
    if weight.input_order is not None:
        flat = flat[:, weight.input_order]
    if flat.shape[0] >= (int8_product_below(False) if int8_below is None else int8_below):
        y = F.linear(flat, weight.dequantize_stored(x.dtype), None if bias is None else bias.to(x.dtype))
        return y.view(*x.shape[:-1], -1)
    q, dx = quantize_activations(flat)
    x_hat = (q.view(q.shape[0], -1, BLOCK) * dx.unsqueeze(-1)).reshape(q.shape[0], -1)[:, :weight.cols]
    y = F.linear(x_hat, weight.dequantize_stored(), None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], -1)
