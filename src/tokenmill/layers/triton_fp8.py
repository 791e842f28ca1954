"""The FP8 products in Triton (kernels/fp8.py says what they compute): the per-token quantisation of
activations, the W8A8 product (e4m3 x e4m3 on tensor cores, sm89+) and the weight-only product (e4m3
weights decoded in registers times 16-bit or float32 activations; any GPU). Imported only where a Triton
FP8 path is chosen (layers/fp8_linear.py); on CPU tensors they run in Triton's interpreter (tests).

Both products walk K in steps of one weight block (BLOCK_K = the weight's block, or 128 for per-channel
weights), a row's partial sums added in K order into a float32 accumulator; block scales multiply each
step's tile product, per-channel and per-token scales the finished sum. The tiling comes from `tiles`:
with `batch_invariant` one tiling for every row count, so a row's arithmetic is the same whatever else
shares the product; otherwise the tile height follows the row count.

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
from tokenmill.kernels.fp8 import FP8_MAX, MIN_AMAX, Fp8Weight

_CHANNEL_BLOCK_K = 128  # K step of per-channel weights
_QUANT_CHUNK = 1024  # columns per pass of the activation quantiser over a per-token group


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
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, cols, group, stride_x, stride_q, stride_s,
                          FP8_LIMIT: tl.constexpr, MIN_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, g): the scale of columns [g * group, (g + 1) * group) of the row and their e4m3 bytes."""
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
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_MAX), FP8_LIMIT)
    tl.store(s_ptr + row * stride_s + g, scale)
    for first in range(start, end, BLOCK):
        cols_here = first + offsets
        mask = cols_here < end
        x = tl.load(x_ptr + row * stride_x + cols_here, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_ptr + row * stride_q + cols_here, _e4m3_bits(v).to(tl.uint8), mask=mask)


def quantize_activations(x: torch.Tensor, group: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8.quantize_activations in one kernel: x [m, cols] -> (q float8_e4m3fn [m, cols], scales
    float32 [m, groups]), bit for bit the same values."""
    m, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    width = cols if group is None else group
    groups = -(-cols // width)
    q = torch.empty(m, cols, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m, groups)](x, q, scales, cols, width, x.stride(0), q.stride(0), scales.stride(0),
                                           FP8_LIMIT=FP8_MAX, MIN_MAX=MIN_AMAX,
                                           BLOCK=min(_QUANT_CHUNK, triton.next_power_of_2(width)))
    return q.view(torch.float8_e4m3fn), scales


@triton.jit
def _decoded_e4m3(b, dtype: tl.constexpr):
    """e4m3fn bytes (uint8) -> their values / 256 in `dtype`, exactly: the byte's exponent and mantissa
    moved into a float16's fields read as float16 is the value times 2^-8 (e4m3 bias 7, float16 bias 15),
    subnormals included (they land on float16 subnormals)."""
    h = b.to(tl.int16)
    half = ((h & 0x7F) << 7) | ((h & 0x80) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32).to(dtype)


@triton.jit
def _fp8_product_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                        stride_xm, stride_xs, stride_wn, stride_ws, stride_om,
                        W8A8: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] with the scales of module docstring. W8A8: x is e4m3 bytes with
    scales xs per row (and block when GROUPED); else x is in DOT_DTYPE and unscaled. The weight is e4m3
    bytes, its scales ws per row (and block when GROUPED)."""
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0)
        if W8A8:
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
    if not GROUPED:
        acc = acc * tl.load(ws_ptr + cols * stride_ws, mask=col_ok, other=0.0)[None, :]
        if W8A8:
            acc = acc * tl.load(xs_ptr + rows * stride_xs, mask=row_ok, other=0.0)[:, None]
    if not W8A8:
        acc = acc * 256.0  # the decoded weights are the e4m3 values / 256
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


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


def w8a8_product(q: torch.Tensor, q_scales: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
                 out_dtype: torch.dtype, batch_invariant: bool) -> torch.Tensor:
    """Quantised activations (q float8_e4m3fn [m, cols], scales from `quantize_activations` with the weight's
    activation group) times the FP8 weight -> [m, rows] in `out_dtype`, a float32 bias added."""
    return _launch(q.view(torch.uint8), q_scales, weight, bias, out_dtype, True, batch_invariant)


def weight_only_product(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
                        batch_invariant: bool) -> torch.Tensor:
    """x [m, cols] (bfloat16, float16 or float32, unquantised) times the FP8 weight decoded in registers
    -> [m, rows] in x's dtype, a float32 bias added. float32 inputs multiply in full float32 (no TF32)."""
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"the FP8 weight-only product takes bfloat16, float16 or float32 inputs, got {x.dtype}")
    return _launch(x, None, weight, bias, x.dtype, False, batch_invariant)


def _launch(x: torch.Tensor, x_scales: Optional[torch.Tensor], weight: Fp8Weight, bias: Optional[torch.Tensor],
            out_dtype: torch.dtype, w8a8: bool, batch_invariant: bool) -> torch.Tensor:
    m, cols = x.shape
    rows = weight.data.shape[0]
    if cols != weight.data.shape[1]:
        raise ValueError(f"input of {cols} features for an FP8 weight of {weight.data.shape[1]}")
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
    _fp8_product_kernel[grid](
        x, scales, weight.data.view(torch.uint8), weight.scale, bias if bias is not None else weight.scale, out,
        m, rows, cols, x.stride(0), scales.stride(0), weight.data.stride(0), weight.scale.stride(0), out.stride(0),
        W8A8=w8a8, GROUPED=weight.block is not None, HAS_BIAS=bias is not None,
        DOT_DTYPE=tl.float32 if upcast else _DOT_DTYPES.get(x.dtype, tl.float16),
        PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return out
