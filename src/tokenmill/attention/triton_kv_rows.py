"""One-byte KV rows (--kv-cache-dtype int8 / fp8, the layout of attention/kv_quant.py) in Triton: the kernel
that quantises a step's K and V into the cache, and the tile loads the attention kernels (triton_kernels.py)
read them with, widened in registers.

Layout (kv_quant.py's, unchanged, so the prefix cache, the second tier, swap and transfers move the same
blocks): per (plane, block, kv head) a tile of block_size x (head_dim + 4) bytes; keys transposed (byte
d * block_size + position, then the block_size float32 scales), values as rows (head_dim bytes, then the
row's float32 scale). A scale is read and written through a float32 pointer, so a tile's scales must sit on
4-byte boundaries: head_dim a multiple of 4 (`check_row_layout`).

Invariant (bit-equality with kv_quant.quantize, which the reference backend and the CPU writer follow, so a
token's bytes never depend on which path wrote them; tests/kernels/test_triton_kv_rows.py):
- scale = max |x| / 127 (int8) or / 448 (fp8) and x / scale are IEEE-rounded divisions (`div_rn`: a GPU's
  `/` may be approximate), in float32 whatever the compute dtype;
- int8 rounds half to even (torch.round) through floor and a comparison, no rounding intrinsic;
- e4m3 is encoded from the float's bits as c10's fp8e4m3fn_from_fp32_value does (ties to even, the
  mantissa's carry into the exponent, subnormals), not by Triton's cast: the interpreter's cast rounds
  ties away from zero and drops that carry.

Widening: an int8 value converts exactly to float16, bfloat16 and float32. An e4m3 byte becomes the float16
with its sign and its 7 other bits shifted up by 7: the same value times 2^-8 (the exponent biases, 7 and
15, differ by 8), subnormals included, exact in every compute dtype; the 2^8 joins the row's scale. A
key's scale multiplies its column of scores and a value's scale the softmax weights of its row, so the
tiles fed to tl.dot are the widened bytes themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.kv_quant import SCALE_BYTES, is_quantized, row_format, row_width

WRITE_ROWS = 16  # (token, kv head) rows a program of the write kernel quantises: few programs for a prefill
# KV_ROWS of the attention kernels: what a cache's rows hold (constexpr: the kernels compare against them)
FLOAT_ROWS, INT8_ROWS, FP8_ROWS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
E4M3_WIDENING = tl.constexpr(256.0)  # an e4m3 byte widened through float16's exponent is its value / 2^8


def kv_rows_code(kv_cache: torch.Tensor) -> int:
    """FLOAT_ROWS, INT8_ROWS or FP8_ROWS: the rows of `kv_cache`, by its dtype."""
    if not is_quantized(kv_cache):
        return FLOAT_ROWS.value
    return INT8_ROWS.value if row_format(kv_cache) == "int8" else FP8_ROWS.value


def check_row_layout(head_dim: int, planes: int) -> None:
    """ValueError unless the Triton kernels read and write one-byte rows of `head_dim` in a cache of
    `planes` planes: a key and a value plane (MLA's key-only latent caches are not quantised), and head_dim
    a multiple of 4 (the float32 scales are loaded in place, on 4-byte boundaries)."""
    if planes != 2:
        raise ValueError("a one-byte (int8/fp8) KV cache on the triton_paged backend needs a key and a value "
                         "plane: MLA latent (key-only) caches are not quantised; use kv_cache_dtype auto")
    if head_dim % SCALE_BYTES:
        raise ValueError(f"a one-byte (int8/fp8) KV cache on the triton_paged backend needs head_dim a multiple "
                         f"of 4 (its float32 scales are read in place), not {head_dim}; use kv_cache_dtype auto "
                         "or --attention-backend torch_ref")


def check_cache_rows(kv_cache: torch.Tensor, head_dim: int) -> None:
    """ValueError unless `kv_cache` holds one-byte rows of `head_dim` that the kernels take."""
    check_row_layout(head_dim, kv_cache.shape[0])
    if kv_cache.shape[-1] != row_width(head_dim):
        raise ValueError(f"a one-byte KV cache of head_dim {head_dim} has rows of {row_width(head_dim)} bytes, "
                         f"not {kv_cache.shape[-1]}")


def write_kv_rows(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise k, v [T, KVH, D] into the one-byte rows of `kv_cache` at `slots` (-1: writes nothing)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("write_kv_rows needs contiguous head dimensions")
    kv_write_rows_kernel[(triton.cdiv(num_tokens * num_kv_heads, WRITE_ROWS),)](
        k, v, kv_cache, slots, num_tokens * num_kv_heads, num_kv_heads, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        ROWS=WRITE_ROWS, BLOCK_SIZE=kv_cache.shape[3], HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim), FP8=kv_rows_code(kv_cache) == FP8_ROWS.value)


@triton.jit
def _round_half_even(x):
    """float32 x (|x| < 2^22) rounded to the nearest integer, ties to even (torch.round)."""
    below = tl.floor(x)
    rest = x - below
    odd = (below - 2.0 * tl.floor(below * 0.5)) != 0.0
    return tl.where((rest > 0.5) | ((rest == 0.5) & odd), below + 1.0, below)


@triton.jit
def _e4m3_bits(x):
    """float32 x (|x| <= 448, e4m3's largest) -> the nearest e4m3, ties to even, as int32 bits 0..255."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # below 2^-6 (e4m3's smallest normal): adding 2^14, whose float32 ulp is 2^-9 (e4m3's subnormal step),
    # rounds the magnitude to a multiple of 2^-9, which the sum's low mantissa bits then count
    subnormal = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # else drop 20 of float32's 23 mantissa bits rounding half to even (a carry moves into the exponent),
    # and rebias the exponent from 127 to 7
    odd = (magnitude >> 20) & 1
    normal = (magnitude - (120 << 23) + 0x7FFFF + odd) >> 20
    code = tl.where(magnitude < (121 << 23), subnormal, normal)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _quantized_rows(x, FP8: tl.constexpr):
    """float32 rows [ROWS, HEAD_DIM_P] (0 past head_dim) -> (their one-byte values: int8, or e4m3 bits as
    uint8; their float32 scales [ROWS]), each row alone, as kv_quant.quantize computes them."""
    if FP8:
        scale = tl.math.div_rn(tl.max(tl.abs(x), 1), 448.0)
    else:
        scale = tl.math.div_rn(tl.max(tl.abs(x), 1), 127.0)
    positive = scale > 0
    y = tl.where(positive[:, None], tl.math.div_rn(x, tl.where(positive, scale, 1.0)[:, None]), 0.0)
    if FP8:
        values = _e4m3_bits(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.uint8)
    else:
        values = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
    return values, scale


@triton.jit
def kv_write_rows_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, num_rows, num_kv_heads,
                         k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                         c_stride_plane, c_stride_block, c_stride_head, c_stride_pos,
                         ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P: tl.constexpr, FP8: tl.constexpr):
    """Program: ROWS consecutive (token, kv head) rows of the step; quantises each k and v row alone (one
    scale a row) into the tiles at its token's slot, the key transposed. A token of slot < 0 (a padding
    row of a captured graph) writes nothing."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    token = rows // num_kv_heads
    head = rows % num_kv_heads
    slot = tl.load(slot_ptr + token, mask=rows < num_rows, other=-1).to(tl.int64)
    kept = slot >= 0
    safe_slot = tl.where(kept, slot, 0)
    position = safe_slot % BLOCK_SIZE
    tile = cache_ptr + (safe_slot // BLOCK_SIZE) * c_stride_block + head * c_stride_head
    dims = tl.arange(0, HEAD_DIM_P)
    mask = kept[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token[:, None] * k_stride_t + head[:, None] * k_stride_h + dims[None, :], mask=mask,
                other=0.0).to(tl.float32)
    values, scale = _quantized_rows(k, FP8)
    tl.store(tile[:, None] + dims[None, :] * BLOCK_SIZE + position[:, None], values, mask=mask)
    tl.store((tile + HEAD_DIM * BLOCK_SIZE + 4 * position).to(tl.pointer_type(tl.float32)), scale, mask=kept)
    v = tl.load(v_ptr + token[:, None] * v_stride_t + head[:, None] * v_stride_h + dims[None, :], mask=mask,
                other=0.0).to(tl.float32)
    values, scale = _quantized_rows(v, FP8)
    row = tile + c_stride_plane + position * c_stride_pos
    tl.store(row[:, None] + dims[None, :], values, mask=mask)
    tl.store((row + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=kept)


@triton.jit
def _widened(raw, dtype: tl.constexpr, FP8: tl.constexpr):
    """One-byte values as `dtype`, exactly: int8 as they are, e4m3 bits as their value / 2^8."""
    if FP8:
        b = raw.to(tl.int32)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True).to(dtype)
    else:
        return raw.to(dtype)


@triton.jit
def row_tiles(cache_ptr, physical, kv_head, keys, key_valid, dims, dim_mask, dtype: tl.constexpr,
              c_stride_plane, c_stride_block, c_stride_head, c_stride_pos, V_PLANE: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """A tile of keys (`keys`, their blocks `physical`) of one-byte rows: (keys [HEAD_DIM_P, TILE] and values
    [TILE, HEAD_DIM_P] widened to `dtype`; the keys' and values' scales [TILE], 2^8 included for e4m3).
    Keys past `key_valid` load as zero with scale zero."""
    tile = cache_ptr + physical * c_stride_block + kv_head * c_stride_head
    position = keys % BLOCK_SIZE
    k = tl.load(tile[None, :] + dims[:, None] * BLOCK_SIZE + position[None, :],
                mask=dim_mask[:, None] & key_valid[None, :], other=0)
    k_scale = tl.load((tile + HEAD_DIM * BLOCK_SIZE + 4 * position).to(tl.pointer_type(tl.float32)),
                      mask=key_valid, other=0.0)
    row = tile + V_PLANE * c_stride_plane + position * c_stride_pos
    v = tl.load(row[:, None] + dims[None, :], mask=key_valid[:, None] & dim_mask[None, :], other=0)
    v_scale = tl.load((row + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=key_valid, other=0.0)
    if FP8:
        k_scale = k_scale * E4M3_WIDENING
        v_scale = v_scale * E4M3_WIDENING
    return _widened(k, dtype, FP8), k_scale, _widened(v, dtype, FP8), v_scale
