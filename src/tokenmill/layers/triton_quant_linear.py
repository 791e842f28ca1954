"""Weight-only quantised products on Triton: x [..., cols] (float32, bfloat16 or float16) times a packed
int4 or int8 weight (kernels/quantized.py's `QuantizedWeight`), dequantised tile by tile in registers and
multiplied with `tl.dot`, accumulating in float32. The float weight never reaches memory.

Layout (made once, at construction; the source weight is then dropped): K-major, as GPTQ's `qweight`,
so that the threads of a program, which cover consecutive output features, load consecutive words.
- `words` int32 [Kp * bits / 32, Np]: word (r, n) holds the values u of output n for stored input
  columns 8r .. 8r + 7 (int4, column 8r + j in bits 4j .. 4j + 3) or 4r .. 4r + 3 (int8, bits 8j ..).
- `scale`, `offset` [Kp / 32, Np] in the source's dtype (float16 or float32): w = scale * u + offset
  per 32 stored columns; `sub_scale` int8 [Kp / 16, Np] where the source has one (w *= sub per 16).
- `input_order` int32 [cols] where the source is in activation order: stored column p multiplies input
  feature input_order[p], so the kernel gathers the input's features by it.
Kp is the stored width rounded up to `_K_ALIGN`, Np the output features rounded up to `_N_ALIGN`, both
with zero scales and offsets (zero weights), so that the K loop and the weight loads need no masks.
Bytes per weight: int4 with float16 scales 0.5 + 4 / 32 = 0.625; int8 1.125 (float32 scales: + 0.125).

Tilings (`Tiling`): few rows (decode, up to `_DECODE_ROWS`) take BLOCK_M 16 and a fixed split of the K
loop over programs, so that narrow layers still fill the GPU; more rows take larger tiles and no split.
The split of a weight depends only on its shape (N, K) and the device's processor count, never on M.
A split product writes float32 partial sums [split, M, N] that `_reduce_splits_kernel` adds in split
order; no atomics, so results are deterministic. `batch_invariant`: one tiling (the decode one, with
its split) for every row count, so each output row is the same sequence of tile products whatever the
number of rows: bit-identical rows at any M.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.kernels.quantized import BLOCK, SUB_BLOCK, QuantizedWeight
from tokenmill.kernels.triton_interpreter import prepare_interpreter

prepare_interpreter()  # (under the interpreter: a row's dot the same wherever it sits in its tile, cheaper launches)

INTERPRETED = envs.triton_interpreted()  # Triton decided it when imported, just above

_K_ALIGN = 128  # the largest BLOCK_K of any tiling
_N_ALIGN = 128  # the largest BLOCK_N of any tiling
_DECODE_ROWS = 16  # rows up to which (without batch invariance) the decode tiling runs
_SPLIT_ROWS = 256  # rows per launch of a split product: bounds its float32 partials to 256 x N x split
_REDUCE_BLOCK = 1024
_DEFAULT_PROCESSORS = 132  # off CUDA (the interpreter): an H100's count, so that tests split as a GPU would
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Tiling:
    """One kernel configuration: output tile BLOCK_M x BLOCK_N, BLOCK_K inputs per step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    may_split: bool  # whether the K loop may be split over programs (for few rows)


DECODE = Tiling(16, 64, 128, 4, 4, may_split=True)
PREFILL = Tiling(64, 128, 64, 4, 3, may_split=False)


@triton.jit
def _quant_linear_kernel(x_ptr, words_ptr, scale_ptr, offset_ptr, sub_ptr, order_ptr, bias_ptr, out_ptr,
                         M, N, K, stride_xm, stride_xk, stride_om, stride_os, words_stride, tiles_per_split,
                         BITS: tl.constexpr, HAS_SUB: tl.constexpr, HAS_ORDER: tl.constexpr,
                         HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k x[m, order[k]] w[n, k] over this program's split of the K tiles (program axis 2),
    w dequantised in registers. PARTIAL: float32 partial sums to out + split * stride_os, else the result
    (+ bias) in out's dtype. UPCAST (the interpreter, whose 16-bit products are wrong and whose casts to
    bfloat16 truncate): 16-bit inputs are multiplied in float32 by the float32 weight, where the GPU
    rounds the weight to the input's dtype for its 16-bit product."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # the scales' group: 16 columns where sub-scales refine each 32-column block, else the block
    GROUP: tl.constexpr = 16 if HAS_SUB else 32
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // PER_WORD  # words per group and output
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    shifts = tl.arange(0, PER_WORD) * BITS
    group_rows = tl.arange(0, GROUPS)
    word_rows = group_rows[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [GROUPS, WORDS]
    row_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_tile = split * tiles_per_split
    for tile in range(first_tile, first_tile + tiles_per_split):
        k0 = tile * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        if HAS_ORDER:
            cols = tl.load(order_ptr + offs_k, mask=in_k, other=0)
        else:
            cols = offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
                    mask=row_mask & in_k[None, :], other=0.0)
        # [GROUPS, WORDS, BLOCK_N] words, consecutive outputs in consecutive addresses
        words = tl.load(words_ptr + (k0 // PER_WORD + word_rows)[:, :, None] * words_stride
                        + offs_n[None, None, :])
        u = (words[:, :, None, :] >> shifts[None, None, :, None]) & MASK  # [GROUPS, WORDS, PER_WORD, N]
        group_index = k0 // GROUP + group_rows
        block_index = (group_index * GROUP) // 32
        scale = tl.load(scale_ptr + block_index[:, None] * words_stride + offs_n[None, :]).to(tl.float32)
        offset = tl.load(offset_ptr + block_index[:, None] * words_stride + offs_n[None, :]).to(tl.float32)
        w = u.to(tl.float32) * scale[:, None, None, :] + offset[:, None, None, :]
        if HAS_SUB:
            sub = tl.load(sub_ptr + group_index[:, None] * words_stride + offs_n[None, :]).to(tl.float32)
            w = w * sub[:, None, None, :]
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))  # row k = stored column k0 + k
        if UPCAST:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out_mask = row_mask & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if PARTIAL:
        tl.store(out_ptrs + split * stride_os, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_splits_kernel(out_ptr, partial_ptr, bias_ptr, total, N, splits, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
    """out = sum over s = 0, 1, ... of partial[s] (+ bias), in that order: [M, N] contiguous."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(partial_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_PROCESSORS


def k_splits(n_blocks: int, k_tiles: int, processors: int) -> int:
    """How many programs share the K loop of one output tile: doubled while the grid has fewer than two
    programs per processor and the tiles still divide evenly. A function of the weight's shape only."""
    splits = 1
    while n_blocks * splits < 2 * processors and k_tiles % (2 * splits) == 0:
        splits *= 2
    return splits


class TritonQuantizedProduct:
    """x [..., cols] -> x W^T (+ bias) in x's dtype for one packed `QuantizedWeight`, on the weight's device
    (CUDA, or CPU tensors in Triton's interpreter). See the module docstring for the layout and tilings."""

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor], batch_invariant: bool) -> None:
        if weight.format not in ("int4", "int8"):
            raise ValueError(f"the Triton quantised product takes int4 or int8 weights, got {weight.format!r}")
        if weight.scale.dtype not in (torch.float16, torch.float32) or weight.offset.dtype != weight.scale.dtype:
            raise ValueError("the Triton quantised product takes float16 or float32 scales and offsets of one dtype")
        self.format = weight.format
        self.rows, self.cols = weight.shape
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (self.rows,)):
            raise ValueError("the Triton quantised product takes a float32 bias of one value per output")
        self.bias = None if bias is None else bias.contiguous()
        self.batch_invariant = batch_invariant
        self.bits = 4 if weight.format == "int4" else 8
        self.device = weight.data.device
        self.words, self.scale, self.offset, self.sub_scale = _repack(weight)
        self.input_order = None if weight.input_order is None else weight.input_order.to(torch.int32).contiguous()
        self.padded_k, self.padded_n = self.scale.shape[0] * BLOCK, self.scale.shape[1]
        processors = _processors(self.device)
        self.splits = {tiling: (k_splits(self.padded_n // tiling.block_n, self.padded_k // tiling.block_k, processors)
                                if tiling.may_split else 1) for tiling in (DECODE, PREFILL)}

    def tiling(self, m: int) -> Tiling:
        """The tiling for m input rows: the decode one for every m where batch-invariant."""
        return DECODE if self.batch_invariant or m <= _DECODE_ROWS else PREFILL

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply (any leading dimensions)."""
        if x.shape[-1] != self.cols:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes {self.cols}")
        if x.dtype not in _DTYPES:
            raise ValueError(f"the Triton quantised product takes float32, bfloat16 or float16 inputs, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"this quantised weight is on {self.device}; it cannot multiply a tensor on {x.device}")
        flat = x.reshape(-1, self.cols)
        m = flat.shape[0]
        out = torch.empty((m, self.rows), dtype=x.dtype, device=x.device)
        if m:
            tiling = self.tiling(m)
            splits = self.splits[tiling]
            step = _SPLIT_ROWS if splits > 1 else m  # row chunks only bound the partials: rows are independent
            for first in range(0, m, step):
                self._launch(flat[first:first + step], out[first:first + step], tiling, splits)
        return out.view(*x.shape[:-1], self.rows)

    def _launch(self, x: torch.Tensor, out: torch.Tensor, tiling: Tiling, splits: int) -> None:
        m = x.shape[0]
        tiles_per_split = self.padded_k // tiling.block_k // splits
        grid = (triton.cdiv(m, tiling.block_m), self.padded_n // tiling.block_n, splits)
        partial = None if splits == 1 else torch.empty((splits, m, self.rows), dtype=torch.float32, device=x.device)
        target = out if partial is None else partial
        placeholder = self.words  # for pointers a kernel does not read (its flag is off)
        upcast = INTERPRETED and x.dtype != torch.float32
        _quant_linear_kernel[grid](
            x, self.words, self.scale, self.offset,
            placeholder if self.sub_scale is None else self.sub_scale,
            placeholder if self.input_order is None else self.input_order,
            placeholder if self.bias is None else self.bias, target,
            m, self.rows, self.cols, x.stride(0), x.stride(1), target.stride(-2),
            0 if partial is None else partial.stride(0), self.padded_n, tiles_per_split,
            BITS=self.bits, HAS_SUB=self.sub_scale is not None, HAS_ORDER=self.input_order is not None,
            HAS_BIAS=self.bias is not None, PARTIAL=partial is not None, UPCAST=upcast,
            IEEE=x.dtype == torch.float32 or upcast,
            BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
            num_warps=tiling.num_warps, num_stages=tiling.num_stages)
        if partial is not None:
            total = m * self.rows
            if out.stride(0) != self.rows:
                raise AssertionError("the output rows are contiguous")  # out is a row range of a fresh [m, rows]
            _reduce_splits_kernel[(triton.cdiv(total, _REDUCE_BLOCK),)](
                out, partial, placeholder if self.bias is None else self.bias, total, self.rows, splits,
                HAS_BIAS=self.bias is not None, BLOCK=_REDUCE_BLOCK)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantised to `dtype` [*ids.shape, cols], valued as `QuantizedWeight.dequantize`
        values them: an embedding lookup in the packed table (a tied quantised embedding)."""
        flat = ids.reshape(-1).to(torch.int64)
        words = self.words.index_select(1, flat)  # [Kp * bits / 32, T]
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32, device=words.device)
        u = ((words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << self.bits) - 1)).reshape(-1, flat.numel())
        scale = self.scale.index_select(1, flat).float().repeat_interleave(BLOCK, 0)
        offset = self.offset.index_select(1, flat).float().repeat_interleave(BLOCK, 0)
        w = u.float() * scale + offset
        if self.sub_scale is not None:
            w = w * self.sub_scale.index_select(1, flat).float().repeat_interleave(SUB_BLOCK, 0)
        stored = w[:self.cols].t()
        if self.input_order is not None:
            rows = torch.empty_like(stored)
            rows[:, self.input_order.long()] = stored
            stored = rows
        return stored.to(dtype).reshape(*ids.shape, self.cols)


def _repack(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(words, scale, offset, sub_scale) in the K-major layout of the module docstring."""
    rows = weight.data.shape[0]
    u = weight.unsigned_values()  # [rows, stored width], uint8
    padded_k = _round_up(u.shape[1], _K_ALIGN)
    padded_n = _round_up(rows, _N_ALIGN)
    grow_k, grow_n = padded_k - u.shape[1], padded_n - rows
    u = F.pad(u, (0, grow_k, 0, grow_n)).t().to(torch.int64)  # [padded_k, padded_n]
    bits = 4 if weight.format == "int4" else 8
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=u.device)
    words = (u.view(-1, per_word, padded_n) << shifts.view(1, -1, 1)).sum(1)  # disjoint bits: the sum is an or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits, signed

    def k_major(values: torch.Tensor, per: int) -> torch.Tensor:
        return F.pad(values, (0, grow_k // per, 0, grow_n)).t().contiguous()

    sub = None if weight.sub_scale is None else k_major(weight.sub_scale, SUB_BLOCK)
    return words.contiguous(), k_major(weight.scale, BLOCK), k_major(weight.offset, BLOCK), sub
