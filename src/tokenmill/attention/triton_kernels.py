"""Triton kernels of the `triton_paged` backend: KV writes by slot, one unified attention kernel for a
mixed batch, a split-KV decode kernel, and the fused norm and activation kernels of the CUDA path.

Imported only by `attention/triton_paged.py` and `layers/triton_fused.py`, never on a CPU-only start.
Whether the kernels are compiled or interpreted (`TRITON_INTERPRET=1`: CPU tensors, the tests) is
decided by Triton when this module is imported; `INTERPRETED` records it.

Cache layout (the reference backend's): [planes, blocks, kv_heads, block_size, head_dim]; keys in plane 0,
values in the last plane. Strides are passed, so any layout with these dimensions works. One-byte caches
(KV_ROWS int8 / fp8: rows of head_dim + 4 bytes, kv_quant.py's layout) are written by
triton_kv_rows.kv_write_rows_kernel and read through triton_kv_rows.row_tiles.

Invariant (batch invariance of attention): a query row's arithmetic depends only on its own query,
its context and the constexpr tile sizes. KV tiles are aligned to absolute positions (tile j covers
keys [j * TILE, (j + 1) * TILE)), every row of a program walks the same tiles, and a tile that is fully
masked for a row leaves that row's (max, sum, accumulator) bitwise unchanged. So a query computes the
same bits as a one-token decode at its position, whatever else shares its program or its step. The
split-KV decode kernel reduces in another order and is used only when batch invariance is off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.attention.triton_kv_rows import FLOAT_ROWS, FP8_ROWS, row_tiles
from tokenmill.kernels.triton_interpreter import prepare_interpreter

prepare_interpreter()  # (under the interpreter: a row's dot the same wherever it sits in its tile, cheaper launches)

INTERPRETED = envs.triton_interpreted()


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    c_stride_plane, c_stride_block, c_stride_head, c_stride_pos,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                    WRITE_V: tl.constexpr):
    """Program (token, kv head): copy its k (and v) row into the cache at its slot; slot < 0 (a padding
    row of a captured graph) writes nothing."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (dims < HEAD_DIM) & ((tl.zeros([HEAD_DIM_P], tl.int64) + slot) >= 0)
    safe_slot = tl.where(slot >= 0, slot, 0)
    dst = cache_ptr + (safe_slot // BLOCK_SIZE) * c_stride_block + head * c_stride_head \
        + (safe_slot % BLOCK_SIZE) * c_stride_pos + dims
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dims, mask=mask)
    tl.store(dst, k, mask=mask)
    if WRITE_V:
        v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dims, mask=mask)
        tl.store(dst + c_stride_plane, v, mask=mask)


@triton.jit
def _sequence_of(query_start_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold global query block `q_block`: sequence s owns blocks from
    query_start[s] // BLOCK_Q + s on (an upper bound of the blocks before it, so the grid is known
    from the token and sequence counts alone)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, cache_ptr, block_table_ptr, kv_head, query_pos,
                  first_tile, end_tile, kv_end, scale, softcap, window, chunk,
                  c_stride_plane, c_stride_block, c_stride_head, c_stride_pos,
                  V_PLANE: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, USE_WINDOW: tl.constexpr,
                  USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, KV_ROWS: tl.constexpr,
                  USE_CHUNK: tl.constexpr):
    """Online softmax of the rows of q over key tiles [first_tile, end_tile) (keys < kv_end, causal at
    each row's query_pos, within `window` when USE_WINDOW, from the start of the row's `chunk` of positions when
    USE_CHUNK: Llama 4's chunked local attention), over a cache of KV_ROWS (FLOAT_ROWS: q's
    dtype; else one-byte rows, widened to q's dtype with their scales applied to the scores and to the
    softmax weights). Returns (acc, m_i, l_i)."""
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    for tile in range(first_tile, end_tile):
        keys = tile * TILE + tl.arange(0, TILE)
        key_valid = keys < kv_end
        physical = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        if KV_ROWS == FLOAT_ROWS:
            base = cache_ptr + physical * c_stride_block + kv_head * c_stride_head + (keys % BLOCK_SIZE) * c_stride_pos
            k = tl.load(base[None, :] + dims[:, None], mask=dim_mask[:, None] & key_valid[None, :], other=0.0)
            v = tl.load(base[:, None] + V_PLANE * c_stride_plane + dims[None, :],
                        mask=key_valid[:, None] & dim_mask[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            score_scale = scale
        else:
            k, k_scale, v, v_scale = row_tiles(cache_ptr, physical, kv_head, keys, key_valid, dims, dim_mask, q.dtype,
                                               c_stride_plane, c_stride_block, c_stride_head, c_stride_pos, V_PLANE,
                                               BLOCK_SIZE, HEAD_DIM, KV_ROWS == FP8_ROWS)
            score_scale = (k_scale * scale)[None, :]  # a key's scale multiplies its column of q . k
        if IEEE:  # float32 products exact (no TF32): greedy ids can match HF float32
            s = tl.dot(q, k, input_precision="ieee") * score_scale
        else:
            s = tl.dot(q, k) * score_scale
        if USE_SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
        allowed = key_valid[None, :] & (keys[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (keys[None, :] > query_pos[:, None] - window)
        if USE_CHUNK:
            allowed = allowed & (keys[None, :] >= query_pos[:, None] // chunk * chunk)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at zero
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        weights = p
        if KV_ROWS != FLOAT_ROWS:
            weights = p * v_scale[None, :]  # a value's scale multiplies its row's softmax weight
        if IEEE:
            pv = tl.dot(weights.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(weights.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fold_sink(acc, m_i, l_i, sink):
    """An online softmax's (acc, l) with one more logit per row, `sink` (GPT-OSS's attention sink), that joins the
    denominator and takes no value: both rescaled to max(m, sink), then exp(sink - that) added to l. The same
    operations for a row wherever it comes (batch invariance holds)."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)  # m_i -inf (no key seen): 0, and acc is 0 already
    return acc * alpha[:, None], l_i * alpha + tl.exp(sink - m_new)


@triton.jit
def unified_attention_kernel(out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, sinks_ptr,
                             num_seqs, scale, softcap, window, chunk,
                             q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride,
                             c_stride_plane, c_stride_block, c_stride_head, c_stride_pos,
                             V_PLANE: tl.constexpr, QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr,
                             BLOCK_M: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, USE_WINDOW: tl.constexpr,
                             USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                             KV_ROWS: tl.constexpr, USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr):
    """Program (query block, kv head): BLOCK_Q consecutive queries of one sequence times the
    QUERIES_PER_KV query heads of the kv head, as BLOCK_M rows, attended causally over the sequence's
    block table. Prefill chunks, prefix hits, decode and speculative rows alike: a query at absolute
    position p sees keys [0, p] (within the window, and from the start of its chunk). A sequence of context length 0 (graph padding)
    writes zeros. USE_SINKS: each row's softmax denominator gains exp(sinks[head]) (`_fold_sink`)."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _sequence_of(query_start_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len  # absolute position of the sequence's first query
        rows = tl.arange(0, BLOCK_M)
        local_query = local_block * BLOCK_Q + rows // QUERIES_PER_KV
        head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (local_query < q_len)
        query_pos = first_pos + local_query
        dims = tl.arange(0, HEAD_DIM_P)
        dim_mask = dims < HEAD_DIM
        token = (q_start + local_query).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                    mask=row_valid[:, None] & dim_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        kv_end = tl.minimum(first_pos + (local_block + 1) * BLOCK_Q, seq_len)
        first_tile = 0
        if USE_WINDOW:
            first_tile = tl.maximum(first_pos + local_block * BLOCK_Q - window + 1, 0) // TILE
        if USE_CHUNK:  # the block's first query sees the fewest keys: none before its chunk's start
            first_tile = tl.maximum(first_tile, (first_pos + local_block * BLOCK_Q) // chunk * chunk // TILE)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, cache_ptr, block_tables_ptr + seq.to(tl.int64) * bt_stride,
                                      kv_head, query_pos, first_tile, tl.cdiv(kv_end, TILE), kv_end, scale, softcap,
                                      window, chunk, c_stride_plane, c_stride_block, c_stride_head, c_stride_pos,
                                      V_PLANE, TILE, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, USE_WINDOW, USE_SOFTCAP,
                                      UPCAST, IEEE, KV_ROWS, USE_CHUNK)
        if USE_SINKS:
            acc, l_i = _fold_sink(acc, m_i, l_i, tl.load(sinks_ptr + head, mask=row_valid, other=0.0))
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_mask[None, :])


@triton.jit
def split_decode_kernel(partial_ptr, lse_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
                        scale, softcap, window, chunk,
                        q_stride_t, q_stride_h, bt_stride,
                        c_stride_plane, c_stride_block, c_stride_head, c_stride_pos,
                        NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        V_PLANE: tl.constexpr, QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr,
                        TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HEAD_DIM_P: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr, KV_ROWS: tl.constexpr, USE_CHUNK: tl.constexpr):
    """Program (sequence, kv head, split) of a decode-only batch (token i is sequence i's one query):
    attends over its split's share of the sequence's key tiles (a ceil(tiles / NUM_SPLITS) run; past
    the end a split is empty) and writes the normalised partial output and its
    log-sum-exp (-inf for an empty split) for `merge_splits_kernel`."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * QUERIES_PER_KV + rows
    row_valid = rows < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                mask=row_valid[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    query_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    first_tile = 0
    if USE_WINDOW:
        first_tile = tl.maximum(seq_len - window, 0) // TILE
    if USE_CHUNK:
        first_tile = tl.maximum(first_tile, (seq_len - 1) // chunk * chunk // TILE)
    end_tile = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(end_tile - first_tile, NUM_SPLITS)
    start = first_tile + split * tiles_per_split
    end = tl.minimum(start + tiles_per_split, end_tile)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, cache_ptr, block_tables_ptr + seq.to(tl.int64) * bt_stride,
                                  kv_head, query_pos, start, end, seq_len, scale, softcap, window, chunk,
                                  c_stride_plane, c_stride_block, c_stride_head, c_stride_pos,
                                  V_PLANE, TILE, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, USE_WINDOW, USE_SOFTCAP,
                                  UPCAST, IEEE, KV_ROWS, USE_CHUNK)
    seen = l_i > 0
    result = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    index = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split  # [seq, head, split]
    tl.store(partial_ptr + index[:, None] * HEAD_DIM_P + dims[None, :], result, mask=row_valid[:, None])
    tl.store(lse_ptr + index, lse, mask=row_valid)


@triton.jit
def merge_splits_kernel(out_ptr, partial_ptr, lse_ptr, sinks_ptr, o_stride_t, o_stride_h,
                        NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, USE_SINKS: tl.constexpr):
    """Program (sequence, head): the splits' partial outputs weighted by their share of the softmax (with
    USE_SINKS, the head's sink logit a share of its own that takes no value)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    split_valid = splits < NUM_SPLITS
    index = (seq * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(lse_ptr + index, mask=split_valid, other=float("-inf"))
    top = tl.max(lse, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top)
    total = tl.sum(weights, 0)
    if USE_SINKS:
        total += tl.exp(sink - top)
    dims = tl.arange(0, HEAD_DIM_P)
    parts = tl.load(partial_ptr + index[:, None] * HEAD_DIM_P + dims[None, :], mask=split_valid[:, None], other=0.0)
    result = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * o_stride_t + head * o_stride_h + dims, result.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def add_rms_norm_kernel(out_ptr, residual_ptr, x_ptr, weight_ptr, eps, width,
                        x_stride, r_stride, o_stride, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row): residual += x (when HAS_RESIDUAL, in place), out = rms_norm(residual or x) * weight,
    in float32 and rounded once to the output's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x + tl.load(residual_ptr + row * r_stride + cols, mask=mask, other=0.0))
        tl.store(residual_ptr + row * r_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / width
    normed = xf * (1.0 / tl.sqrt(variance + eps))
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * o_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def act_and_mul_kernel(out_ptr, x_ptr, width, x_stride, o_stride, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column block): out = act(x[:, :width]) * x[:, width:], act SiLU or tanh-GELU."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))  # 0.5 * g * (1 + tanh(inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * o_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, x_stride_t, x_stride_h, table_stride, num_heads,
                HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    """Program (token): rotate the halves of every head of the token's x in place by its row of the
    float32 cos/sin tables ([positions, 2 * HALF]): x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2. One
    program a token (not a head): a head's 2 * HALF values are too little work for a program."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HALF_P)
    dim_mask = dims < HALF
    mask = (heads < num_heads)[:, None] & dim_mask[None, :]
    row = x_ptr + token * x_stride_t + heads[:, None] * x_stride_h + dims[None, :]
    x1 = tl.load(row, mask=mask, other=0.0)
    x2 = tl.load(row + HALF, mask=mask, other=0.0)
    table = position * table_stride
    cos1 = tl.load(cos_ptr + table + dims, mask=dim_mask, other=0.0)[None, :]
    cos2 = tl.load(cos_ptr + table + HALF + dims, mask=dim_mask, other=0.0)[None, :]
    sin1 = tl.load(sin_ptr + table + dims, mask=dim_mask, other=0.0)[None, :]
    sin2 = tl.load(sin_ptr + table + HALF + dims, mask=dim_mask, other=0.0)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(row, (x1f * cos1 - x2f * sin1).to(x1.dtype), mask=mask)
    tl.store(row + HALF, (x2f * cos2 + x1f * sin2).to(x1.dtype), mask=mask)
