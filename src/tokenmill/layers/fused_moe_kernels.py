"""The Triton kernels of the fused mixture of experts (layers/fused_moe.py): routing, sorting the (token, choice)
slots by expert, and the grouped product of every expert's rows with its weight.

Slots: slot s = t * top_k + j is token t's j-th choice. Sorted slots: each local expert's slots in token order,
its run padded with the sentinel `num_slots` to a whole number of BLOCK_M-row blocks, the experts' runs one
after another. `block_expert[b]` names block b's expert (-1: a block past the last run, which does nothing).
Every buffer's size depends on the step's token count only, never on the routing (CUDA graphs replay it).

Imported only where a Triton path runs (it imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton_interpreter import prepare_interpreter

prepare_interpreter()  # (under the interpreter: a row's dot the same wherever it sits in its tile, cheaper launches)


@triton.jit
def route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, scale,
                      TOP_K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, NORMALIZE: tl.constexpr):
    """One token per program: softmax over its logits in float32, the TOP_K largest probabilities in
    descending order (ties: the lower expert id), renormalised to sum 1 when NORMALIZE, times `scale`."""
    token = tl.program_id(0)
    experts = tl.arange(0, E_P)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, 0))
    probs = exps / tl.sum(exps, 0)
    remaining = tl.where(valid, probs, -1.0)  # probabilities are >= 0: padding is never picked
    ranks = tl.arange(0, K_P)
    chosen_weights = tl.zeros([K_P], dtype=tl.float32)
    chosen_ids = tl.zeros([K_P], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(remaining, 0, tie_break_left=True)
        chosen_weights = tl.where(ranks == j, tl.max(remaining, 0), chosen_weights)
        chosen_ids = tl.where(ranks == j, best, chosen_ids)
        remaining = tl.where(experts == best, -2.0, remaining)
    if NORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, 0)
    chosen_weights = chosen_weights * scale
    kept = ranks < TOP_K
    tl.store(weights_ptr + token * TOP_K + ranks, chosen_weights, mask=kept)
    tl.store(ids_ptr + token * TOP_K + ranks, chosen_ids.to(tl.int64), mask=kept)


@triton.jit
def route_grouped_sigmoid_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, scale,
                                 TOP_K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, GROUPS: tl.constexpr,
                                 G_P: tl.constexpr, TOPK_GROUPS: tl.constexpr, NORMALIZE: tl.constexpr):
    """One token per program: DeepSeek-V3's noaux_tc routing (layers/moe.py's `route_grouped_sigmoid`).
    Scores sigmoid(logits) in float32; choice = score + bias; each of GROUPS equal groups of experts scores the
    sum of its two best choices; the TOPK_GROUPS best groups (ties: the lower group) keep their experts; of
    those, the TOP_K best choices in descending order (ties: the lower expert id), weighted by their scores,
    renormalised to sum 1 (+ 1e-20) when NORMALIZE, times `scale`.
    Invariant (the config's check): TOP_K <= TOPK_GROUPS * num_experts / GROUPS, so every pick is a kept expert."""
    token = tl.program_id(0)
    experts = tl.arange(0, E_P)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    # [groups, experts] tiles: row g holds group g's choices, -inf elsewhere (and on padding)
    groups = tl.arange(0, G_P)
    member = ((experts // (num_experts // GROUPS))[None, :] == groups[:, None]) & valid[None, :]
    in_group = tl.where(member, choice[None, :], float("-inf"))
    best_at = tl.argmax(in_group, 1, tie_break_left=True)
    second = tl.max(tl.where(experts[None, :] == best_at[:, None], float("-inf"), in_group), 1)
    group_scores = tl.where(groups < GROUPS, tl.max(in_group, 1) + second, float("-inf"))
    kept_group = tl.zeros([G_P], dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.argmax(group_scores, 0, tie_break_left=True)
        kept_group = tl.where(groups == best, 1, kept_group)
        group_scores = tl.where(groups == best, float("-inf"), group_scores)
    kept = tl.sum(tl.where(member & (kept_group[:, None] == 1), 1, 0), 0) > 0
    remaining = tl.where(kept, choice, float("-inf"))
    ranks = tl.arange(0, K_P)
    chosen_weights = tl.zeros([K_P], dtype=tl.float32)
    chosen_ids = tl.zeros([K_P], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(remaining, 0, tie_break_left=True)
        chosen_weights = tl.where(ranks == j, tl.sum(tl.where(experts == best, scores, 0.0), 0), chosen_weights)
        chosen_ids = tl.where(ranks == j, best, chosen_ids)
        remaining = tl.where(experts == best, float("-inf"), remaining)
    if NORMALIZE:
        chosen_weights = chosen_weights / (tl.sum(chosen_weights, 0) + 1e-20)
    chosen_weights = chosen_weights * scale
    kept_ranks = ranks < TOP_K
    tl.store(weights_ptr + token * TOP_K + ranks, chosen_weights, mask=kept_ranks)
    tl.store(ids_ptr + token * TOP_K + ranks, chosen_ids.to(tl.int64), mask=kept_ranks)


@triton.jit
def count_chunk_kernel(ids_ptr, counts_ptr, num_slots, first_expert, num_experts,
                       CHUNK: tl.constexpr, E_P: tl.constexpr):
    """Program c: how many of slots [c * CHUNK, (c + 1) * CHUNK) each local expert got -> counts[c, :]."""
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32) - first_expert
    columns = tl.arange(0, E_P)
    # another rank's expert (or a masked slot) matches no local column
    hit = (expert[:, None] == columns[None, :]) & (columns[None, :] < num_experts)
    tl.store(counts_ptr + chunk * E_P + columns, tl.sum(hit.to(tl.int32), 0))


@triton.jit
def expert_offsets_kernel(counts_ptr, chunk_base_ptr, block_expert_ptr, num_chunks, num_experts, max_blocks,
                          BLOCK_M: tl.constexpr, E_P: tl.constexpr, BLOCKS_TILE: tl.constexpr):
    """One program: chunk_base[c, e] = the sorted position of expert e's first slot in chunk c, and
    block_expert[b] for every block (in chunk order within an expert: the sort is stable)."""
    columns = tl.arange(0, E_P)
    running = tl.zeros([E_P], dtype=tl.int32)
    for chunk in range(num_chunks):  # each expert's slots in the chunks before this one
        tl.store(chunk_base_ptr + chunk * E_P + columns, running)
        running += tl.load(counts_ptr + chunk * E_P + columns)
    padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    for chunk in range(num_chunks):
        before = tl.load(chunk_base_ptr + chunk * E_P + columns)
        tl.store(chunk_base_ptr + chunk * E_P + columns, start + before)
    # block b's expert: the number of experts whose run ends at or before its first row (empty runs end where
    # they start, so they are counted and skipped); columns past num_experts end at the total, so a block
    # past every run counts them all and gets -1
    for first in range(0, max_blocks, BLOCKS_TILE):
        blocks = first + tl.arange(0, BLOCKS_TILE)
        owner = tl.sum((end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < max_blocks)


@triton.jit
def scatter_slots_kernel(ids_ptr, chunk_base_ptr, sorted_ptr, num_slots, first_expert, num_experts,
                         CHUNK: tl.constexpr, E_P: tl.constexpr):
    """Program c: write each local slot of chunk c at its sorted position (its expert's chunk base plus the
    number of the expert's slots before it in the chunk)."""
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32) - first_expert
    mine = (expert >= 0) & (expert < num_experts)
    columns = tl.arange(0, E_P)
    hit = (expert[:, None] == columns[None, :]) & mine[:, None]
    running = tl.cumsum(hit.to(tl.int32), 0)  # per expert, its slots up to and including this one
    within = tl.sum(tl.where(hit, running, 0), 1) - 1
    base = tl.load(chunk_base_ptr + chunk * E_P + expert, mask=mine, other=0)
    tl.store(sorted_ptr + base + within, slots, mask=mine)


@triton.jit
def _weight_tile(w_ptr, scale_ptr, offset_ptr, sub_ptr, expert, rows, row_ok, cols, col_ok,
                 stride_we, stride_wn, stride_se, stride_sn, stride_ue, stride_un,
                 FORMAT: tl.constexpr, HAS_SUB: tl.constexpr, DTYPE: tl.constexpr):
    """Weight rows x cols [BLOCK_N, BLOCK_K] of `expert` in DTYPE: a float weight as stored; a quantised one
    (kernels/quantized.py's layout) dequantised in registers as QuantizedWeight.dequantize does it:
    float32 scale * u + offset (times the 16-column sub-scale), rounded once to DTYPE."""
    mask = row_ok[:, None] & col_ok[None, :]
    base = expert.to(tl.int64) * stride_we + rows[:, None].to(tl.int64) * stride_wn
    if FORMAT == 0:
        return tl.load(w_ptr + base + cols[None, :], mask=mask, other=0.0).to(DTYPE)
    if FORMAT == 2:  # int4: 32 bytes per 64 columns, the first 32 in the low nibbles, the next 32 in the high
        byte = (cols // 64) * 32 + cols % 32
        u = tl.load(w_ptr + base + byte[None, :], mask=mask, other=0)
        u = (u >> ((cols // 32) % 2 * 4).to(tl.uint8)[None, :]) & 15
    else:
        u = tl.load(w_ptr + base + cols[None, :], mask=mask, other=0)
    scales = expert.to(tl.int64) * stride_se + rows[:, None].to(tl.int64) * stride_sn + (cols // 32)[None, :]
    scale = tl.load(scale_ptr + scales, mask=mask, other=0.0).to(tl.float32)
    offset = tl.load(offset_ptr + scales, mask=mask, other=0.0).to(tl.float32)
    w = u.to(tl.float32) * scale + offset
    if HAS_SUB:
        subs = expert.to(tl.int64) * stride_ue + rows[:, None].to(tl.int64) * stride_un + (cols // 16)[None, :]
        w = w * tl.load(sub_ptr + subs, mask=mask, other=0).to(tl.float32)
    return w.to(DTYPE)


@triton.jit
def grouped_gemm_kernel(a_ptr, out_ptr, w_ptr, scale_ptr, offset_ptr, sub_ptr, sorted_ptr, block_expert_ptr,
                        num_slots, N, K, stride_am, stride_om,
                        stride_we, stride_wn, stride_se, stride_sn, stride_ue, stride_un,
                        ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, FORMAT: tl.constexpr,
                        HAS_SUB: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[slot, n] = a[slot // ROWS_PER_A] . w[expert(slot), n] for the slots of one block and BLOCK_N
    outputs per program; GATED: w holds gate rows [0, N) and up rows [N, 2N), and the program writes
    silu(gate) * up (each rounded to the output dtype first, as SiluAndMul sees them).

    Invariant (batch invariance): a row's sum runs over K in BLOCK_K steps in one order, and each row of a
    tile is its own dot product, so its value depends on the tile sizes, never on which rows share its block.
    FORMAT: 0 float weights, 1 int8, 2 int4 (BLOCK_K a multiple of 64 there)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    block, tile = pid // n_tiles, pid % n_tiles
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    slot_ok = slots < num_slots
    a_rows = tl.where(slot_ok, slots // ROWS_PER_A, 0).to(tl.int64)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(0, K, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_ptr, scale_ptr, offset_ptr, sub_ptr, expert, n, n_ok, k, k_ok, stride_we, stride_wn,
                         stride_se, stride_sn, stride_ue, stride_un, FORMAT, HAS_SUB, dtype)
        if IEEE:  # float32 products exact (no TF32), as the PyTorch path computes them
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        if GATED:
            w_up = _weight_tile(w_ptr, scale_ptr, offset_ptr, sub_ptr, expert, n + N, n_ok, k, k_ok, stride_we,
                                stride_wn, stride_se, stride_sn, stride_ue, stride_un, FORMAT, HAS_SUB, dtype)
            if IEEE:
                acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    out_dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(out_dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
        result = (silu * acc_up.to(out_dtype).to(tl.float32)).to(out_dtype)
    else:
        result = acc.to(out_dtype)
    out_rows = tl.where(slot_ok, slots, 0).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + n[None, :], result, mask=slot_ok[:, None] & n_ok[None, :])
