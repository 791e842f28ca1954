"""The W8A8 products in Triton (kernels/w8a8.py says what they compute): the per-token quantisation of
activations to e4m3 or int8, the W8A8 product (e4m3 x e4m3 on tensor cores, sm89+; int8 x int8, sm80+),
the weight-only product (e4m3 weights decoded in registers times 16-bit or float32 activations; any GPU),
and the scaling of `torch._int_mm`'s int32 sums. Imported only where a Triton W8A8 path is chosen
(layers/w8a8_linear.py); on CPU tensors they run in Triton's interpreter (tests).

Both products walk K in steps of one weight block (BLOCK_K = the weight's block, or 128 for per-channel
weights), a row's partial sums added in K order into an accumulator (float32; int32 for int8 values, where
the sums are exact); block scales multiply each step's tile product, per-channel and per-token scales the
finished sum (`_scaled_sums`, which also scales `torch._int_mm`'s sums, so both int8 paths give the same
values). The tiling comes from `tiles`: with `batch_invariant` one tiling for every row count, so a row's
arithmetic is the same whatever else shares the product; otherwise the tile height follows the row count.

e4m3 bits are encoded and decoded with integer operations rather than Triton's float8 conversions:
Triton 3.9's interpreter drops the carry when fp32 -> e4m3 rounding crosses a binade (31.6 -> 16.0) and
GPUs below sm89 have no e4m3 conversion; the integer forms are exact and the same on every target.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.kernels.triton_interpreter import prepare_interpreter
from tokenmill.kernels.w8a8 import FP8, INT8, MIN_AMAX, ValueType, W8A8Weight

prepare_interpreter()  # (under the interpreter: a row's dot the same wherever it sits in its tile, cheaper launches)

_CHANNEL_BLOCK_K = 128  # K step of per-channel weights
_QUANT_CHUNK = 1024  # columns per pass of the activation quantiser over a per-token group
# 1.5 * 2^23 and its float32 bits: v + it, for |v| < 2^22, lies in [2^23, 2^24), where float32's step is 1,
# so the addition rounds v to an integer (to nearest even) and the low bits of the sum hold it
_ROUNDING_MAGIC = tl.constexpr(12582912.0)  # constexpr: compiled kernels read no other globals
_ROUNDING_MAGIC_BITS = tl.constexpr(0x4B400000)


@triton.jit
def _e4m3_bits(v):
    """fp32 v in [-448, 448] -> its e4m3fn encoding (int32 0..255), rounded to nearest even. The fp32
    significand (implicit bit included) is rounded at e4m3's quantum: 2^(e - 3) for normals, 2^-9 below
    2^-6; a normal's encoding is ((e + 7) << 3) + n - 8 for the rounded significand n in 8..16 (16 carries
    into the exponent by itself), a subnormal's is n."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23  # biased by 127; e4m3 normals from 121 (2^-6)
    significand = (magnitude & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exponent, 20), 25)  # 25 and beyond: below half of 2^-9, rounds to 0
    one = tl.full(shift.shape, 1, tl.int32)
    n = (significand + (one << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    encoded = tl.where(exponent >= 121, ((exponent - 120) << 3) + n - 8, n)
    return sign | encoded


@triton.jit
def _rounded_int(v):
    """fp32 v with |v| < 2^22 -> the nearest integer (int32), halves to even, as `torch.round`."""
    return (v + _ROUNDING_MAGIC).to(tl.int32, bitcast=True) - _ROUNDING_MAGIC_BITS


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, cols, group, stride_x, stride_q, stride_s,
                          LIMIT: tl.constexpr, MIN_MAX: tl.constexpr, INT8: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, g): the scale of columns [g * group, (g + 1) * group) of the row and their bytes: e4m3
    encodings, or int8 values (`INT8`)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, cols)
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for first in range(start, end, BLOCK):
        cols_here = first + offsets
        x = tl.load(x_ptr + row * stride_x + cols_here, mask=cols_here < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_MAX), LIMIT)
    tl.store(s_ptr + row * stride_s + g, scale)
    for first in range(start, end, BLOCK):
        cols_here = first + offsets
        mask = cols_here < end
        x = tl.load(x_ptr + row * stride_x + cols_here, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -LIMIT), LIMIT)
        if INT8:
            encoded = _rounded_int(v)
        else:
            encoded = _e4m3_bits(v)
        tl.store(q_ptr + row * stride_q + cols_here, encoded.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_activations(x: torch.Tensor, group: Optional[int], values: ValueType = FP8
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/w8a8.quantize_activations in one kernel: x [m, cols] -> (q [m, cols] of `values`' dtype,
    scales float32 [m, groups]), bit for bit the same values."""
    m, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    width = cols if group is None else group
    groups = -(-cols // width)
    q = torch.empty(m, cols, dtype=torch.int8 if values is INT8 else torch.uint8, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m, groups)](x, q, scales, cols, width, x.stride(0), q.stride(0), scales.stride(0),
                                           LIMIT=values.largest, MIN_MAX=MIN_AMAX, INT8=values is INT8,
                                           BLOCK=min(_QUANT_CHUNK, triton.next_power_of_2(width)))
    return q.view(values.dtype), scales


@triton.jit
def _decoded_e4m3(b, dtype: tl.constexpr):
    """e4m3fn bytes (uint8) -> their values / 256 in `dtype`, exactly: the byte's exponent and mantissa
    moved into a float16's fields read as float16 is the value times 2^-8 (e4m3 bias 7, float16 bias 15),
    subnormals included (they land on float16 subnormals)."""
    h = b.to(tl.int16)
    half = ((h & 0x7F) << 7) | ((h & 0x80) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32).to(dtype)


@triton.jit
def _scaled_sums(acc, rows, cols, row_ok, col_ok, xs_ptr, ws_ptr, bias_ptr, stride_xs, stride_ws,
                 ROW_SCALES: tl.constexpr, COL_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A tile of finished sums (float32, or exact int32) times its columns' weight scales, then its rows'
    activation scales (in that order, each product rounded to float32), plus the float32 bias."""
    out = acc.to(tl.float32)
    if COL_SCALES:
        out = out * tl.load(ws_ptr + cols * stride_ws, mask=col_ok, other=0.0)[None, :]
    if ROW_SCALES:
        out = out * tl.load(xs_ptr + rows * stride_xs, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    return out


@triton.jit
def _w8a8_product_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                         stride_xm, stride_xs, stride_wn, stride_ws, stride_om,
                         W8A8: tl.constexpr, INT8: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] with the scales of module docstring. W8A8: x is e4m3 bytes, or
    int8 values (`INT8`), with scales xs per row (and block when GROUPED); else x is in DOT_DTYPE and
    unscaled. The weight is e4m3 bytes (int8 values with `INT8`), its scales ws per row (and block when
    GROUPED)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # column tiles in bands of GROUP_M row tiles: a band's programs share weight tiles in L2
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_height = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_height
    pid_n = (pid % (GROUP_M * tiles_n)) // band_height
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if INT8 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0)
        if INT8:
            part = tl.dot(x, w)  # int32: exact sums
        elif W8A8:
            part = tl.dot(x.to(tl.float8e4nv, bitcast=True), w.to(tl.float8e4nv, bitcast=True))
        else:
            part = tl.dot(x.to(DOT_DTYPE), _decoded_e4m3(w, DOT_DTYPE), input_precision=PRECISION)
        if GROUPED:
            g = k0 // BLOCK_K
            w_scale = tl.load(ws_ptr + cols * stride_ws + g, mask=col_ok, other=0.0)
            if W8A8:
                x_scale = tl.load(xs_ptr + rows * stride_xs + g, mask=row_ok, other=0.0)
                acc += part * x_scale[:, None] * w_scale[None, :]
            else:
                acc += part * w_scale[None, :]
        else:
            acc += part
    if not W8A8:
        acc = acc * 256.0  # the decoded weights are the e4m3 values / 256
    out = _scaled_sums(acc, rows, cols, row_ok, col_ok, xs_ptr, ws_ptr, bias_ptr, stride_xs, stride_ws,
                       ROW_SCALES=W8A8 and not GROUPED, COL_SCALES=not GROUPED, HAS_BIAS=HAS_BIAS)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _scale_sums_kernel(acc_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, stride_am, stride_xs, stride_ws,
                       stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = `_scaled_sums` of int32 sums acc [M, N] (`torch._int_mm`'s), one tile a program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    acc = tl.load(acc_ptr + rows[:, None] * stride_am + cols[None, :], mask=mask, other=0)
    out = _scaled_sums(acc, rows, cols, row_ok, col_ok, xs_ptr, ws_ptr, bias_ptr, stride_xs, stride_ws,
                       ROW_SCALES=True, COL_SCALES=True, HAS_BIAS=HAS_BIAS)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


class Tiling(NamedTuple):
    """One launch shape of the products."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# invariant: the batch-invariant tiling is one constant, so a row's reduction never depends on the row count
INVARIANT_TILING = Tiling(64, 64, 4, 3)


def tiles(rows: int, batch_invariant: bool) -> Tiling:
    """The tiling for a product of `rows` input rows: `INVARIANT_TILING` whatever the count when
    `batch_invariant`, else tiles no taller than needed (decode) up to 128 x 128 (prefill)."""
    if batch_invariant:
        return INVARIANT_TILING
    if rows <= 16:
        return Tiling(16, 64, 4, 4)
    if rows <= 64:
        return Tiling(64, 64, 4, 3)
    return Tiling(128, 128, 8, 3)


_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def w8a8_product(q: torch.Tensor, q_scales: torch.Tensor, weight: W8A8Weight, bias: Optional[torch.Tensor],
                 out_dtype: torch.dtype, batch_invariant: bool) -> torch.Tensor:
    """Quantised activations (q [m, cols] of the weight's value type, scales from `quantize_activations`
    with the weight's activation group) times the W8A8 weight -> [m, rows] in `out_dtype`, a float32 bias
    added."""
    if q.dtype != weight.values.dtype:
        raise ValueError(f"{q.dtype} activations for a weight of {weight.data.dtype} values")
    return _launch(q if weight.values is INT8 else q.view(torch.uint8), q_scales, weight, bias, out_dtype, True,
                   batch_invariant)


def int_mm_takes(rows: int, weight: W8A8Weight) -> bool:
    """Whether `torch._int_mm` takes a product of `rows` input rows with `weight` on CUDA: int8 values,
    more than 16 rows, input and output features multiples of 8 (cuBLASLt's int8 GEMM)."""
    out_features, in_features = weight.shape
    return weight.values is INT8 and rows > 16 and in_features % 8 == 0 and out_features % 8 == 0


_EPILOGUE_TILE = (32, 128)


def int_mm_product(q: torch.Tensor, q_scales: torch.Tensor, weight: W8A8Weight, bias: Optional[torch.Tensor],
                   out_dtype: torch.dtype) -> torch.Tensor:
    """`w8a8_product` for int8 values through `torch._int_mm` (cuBLASLt's int8 GEMM, int32 sums; the
    weight passed as its transpose, the column-major operand the GEMM wants): the exact int32 sums scaled
    as the Triton product scales them, so the same values. Shapes as `int_mm_takes` says on CUDA."""
    m = q.shape[0]
    rows = weight.shape[0]
    acc = torch._int_mm(q if q.stride(1) == 1 else q.contiguous(), weight.data.t())
    out = torch.empty(m, rows, dtype=out_dtype, device=q.device)
    block_m, block_n = _EPILOGUE_TILE
    grid = (triton.cdiv(m, block_m), triton.cdiv(rows, block_n))
    _scale_sums_kernel[grid](acc, q_scales, weight.scale, bias if bias is not None else weight.scale, out, m, rows,
                             acc.stride(0), q_scales.stride(0), weight.scale.stride(0), out.stride(0),
                             HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n)
    return out


def weight_only_product(x: torch.Tensor, weight: W8A8Weight, bias: Optional[torch.Tensor],
                        batch_invariant: bool) -> torch.Tensor:
    """x [m, cols] (bfloat16, float16 or float32, unquantised) times the FP8 weight decoded in registers
    -> [m, rows] in x's dtype, a float32 bias added. float32 inputs multiply in full float32 (no TF32)."""
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"the FP8 weight-only product takes bfloat16, float16 or float32 inputs, got {x.dtype}")
    if weight.values is not FP8:
        raise ValueError(f"the weight-only product decodes e4m3 weights, not {weight.data.dtype}")
    return _launch(x, None, weight, bias, x.dtype, False, batch_invariant)


def _launch(x: torch.Tensor, x_scales: Optional[torch.Tensor], weight: W8A8Weight, bias: Optional[torch.Tensor],
            out_dtype: torch.dtype, w8a8: bool, batch_invariant: bool) -> torch.Tensor:
    m, cols = x.shape
    rows = weight.data.shape[0]
    if cols != weight.data.shape[1]:
        raise ValueError(f"input of {cols} features for a W8A8 weight of {weight.data.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, rows, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    tiling = tiles(m, batch_invariant)
    # the interpreter multiplies 16-bit floats wrongly: it takes them in float32 (exact products)
    upcast = envs.triton_interpreted() and x.dtype in (torch.bfloat16, torch.float16)
    block_k = weight.block or _CHANNEL_BLOCK_K
    grid = (triton.cdiv(m, tiling.block_m) * triton.cdiv(rows, tiling.block_n),)
    scales = x_scales if x_scales is not None else weight.scale  # a placeholder pointer when unused
    int8 = weight.values is INT8
    _w8a8_product_kernel[grid](
        x, scales, weight.data if int8 else weight.data.view(torch.uint8), weight.scale, bias if bias is not None else weight.scale, out,
        m, rows, cols, x.stride(0), scales.stride(0), weight.data.stride(0), weight.scale.stride(0), out.stride(0),
        W8A8=w8a8, INT8=int8, GROUPED=weight.block is not None, HAS_BIAS=bias is not None,
        DOT_DTYPE=tl.float32 if upcast else _DOT_DTYPES.get(x.dtype, tl.float16),
        PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return out
