"""The native CPU kernels against the PyTorch ops they replace (the reference backend and layers)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from helpers.attention_steps import mixed_attention_step
from tokenmill.attention.base import AttentionLayer, SequenceChunk
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_ref import TorchReferenceBackend, padded_block_tables, split_decodes
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def random_batch(seed, dtype, heads, kv_heads, head_dim, block_size, lengths, num_blocks=64):
    """A cache holding `lengths[i] - 1` earlier tokens per sequence in scattered blocks, plus one new token each."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, slots = [], []
    for i, length in enumerate(lengths):
        used = -(-length // block_size)
        blocks, order = order[:used], order[used:]
        chunks.append(SequenceChunk(i, 1, length, blocks))
        p = length - 1
        slots.append(blocks[p // block_size] * block_size + p % block_size)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(lengths), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(lengths), kv_heads, head_dim, generator=gen).to(dtype)
    return cache, chunks, torch.tensor(slots), q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2: the AVX-512 path, group 3
    (8, 2, 128, 8),    # Llama-3-like head_dim, group 4
    (4, 4, 32, 16),    # no GQA, head_dim 32: the portable path
    (6, 1, 64, 5),     # multi-query, a block size that is not a power of two
])
def test_decode_attention_and_cache_writes_match_the_reference_backend(kernels, dtype, heads, kv_heads, head_dim,
                                                                      block_size):
    # each decode has earlier tokens to attend to; the long ones span several 64-key work items
    lengths = [2, 17, 40, 3 * block_size, 3 * block_size + 1, 130, 200]
    cache, chunks, slots, q, k, v = random_batch(7, dtype, heads, kv_heads, head_dim, block_size, lengths,
                                                 num_blocks=128)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref, fast = TorchReferenceBackend(), CpuPagedBackend(kernels)
    layer = AttentionLayer(head_dim ** -0.5)
    expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(chunks, slots, block_size, torch.device("cpu")),
                           layer)
    got = fast.forward(q, k, v, fast_cache, fast.build_metadata(chunks, slots, block_size, torch.device("cpu")), layer)
    assert torch.equal(fast_cache, ref_cache)  # the K/V writes are copies: exact
    assert torch.allclose(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_only_cache_attends_as_a_two_plane_cache_holding_the_keys_twice(kernels, dtype):
    # MLA's latent: the values are the keys, stored once (one plane); decode and the prefill chunk agree
    # with the reference over a two-plane cache whose value plane repeats the keys
    heads, head_dim, block_size = 4, 40, 8
    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(1, 32, 1, block_size, head_dim, generator=gen).to(dtype)
    chunks = [SequenceChunk(0, 1, 30, [3, 9, 4, 20]), SequenceChunk(1, 5, 21, [7, 1, 30])]
    slots = torch.tensor([20 * 8 + 5] + [30 * 8 + i for i in range(0, 5)])
    q = torch.randn(6, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(6, 1, head_dim, generator=gen).to(dtype)
    layer, cpu = AttentionLayer(head_dim ** -0.5), torch.device("cpu")
    ref, fast = TorchReferenceBackend(), CpuPagedBackend(kernels)
    two_planes = torch.cat((keys, keys)).clone()
    expected = ref.forward(q, k, k, two_planes, ref.build_metadata(chunks, slots, block_size, cpu), layer)
    for backend in (ref, fast):
        one_plane = keys.clone()
        got = backend.forward(q, k, k, one_plane, backend.build_metadata(chunks, slots, block_size, cpu), layer)
        assert torch.equal(one_plane[0], two_planes[0])
        assert torch.allclose(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        with pytest.raises(ValueError, match="v must be k"):
            backend.forward(q, k, k.clone(), one_plane, backend.build_metadata(chunks, slots, block_size, cpu), layer)


def test_block_tables_of_a_chunk_split_query_by_query_are_each_querys_own():
    # a 7-query chunk at positions 3..9 with 4-token blocks, a decode, then a 2-query chunk from position 0
    long, other, short = [11, 4, 8, 2], [5, 6], [9]
    chunks = [SequenceChunk(0, 7, 10, long), SequenceChunk(7, 1, 6, other), SequenceChunk(8, 2, 2, short)]
    decodes, prefills = split_decodes(chunks, every_query=True)
    assert prefills == [] and [c.context_len for c in decodes] == [4, 5, 6, 7, 8, 9, 10, 6, 1, 2]
    tables = padded_block_tables(decodes, 4, torch.int32)
    expected = [[11, 0, 0], [11, 4, 0], [11, 4, 0], [11, 4, 0], [11, 4, 0], [11, 4, 8], [11, 4, 8],
                [5, 6, 0], [9, 0, 0], [9, 0, 0]]
    assert tables.dtype == torch.int32 and tables.tolist() == expected


def test_a_decode_result_does_not_depend_on_the_rest_of_the_batch(kernels):
    lengths = [300, 5, 77, 140]
    cache, chunks, slots, q, k, v = random_batch(5, torch.bfloat16, 9, 3, 64, 16, lengths, num_blocks=64)
    backend, layer = CpuPagedBackend(kernels), AttentionLayer(64 ** -0.5)
    together = backend.forward(q, k, v, cache.clone(), backend.build_metadata(chunks, slots, 16, torch.device("cpu")),
                               layer)
    for i, chunk in enumerate(chunks):
        alone = SequenceChunk(0, 1, chunk.context_len, chunk.block_ids)
        row = slice(i, i + 1)
        out = backend.forward(q[row], k[row], v[row], cache.clone(),
                              backend.build_metadata([alone], slots[row], 16, torch.device("cpu")), layer)
        assert torch.equal(out[0], together[i])


def test_decode_reads_q_rows_in_place_within_a_mixed_batch(kernels):
    """Decode rows sit between prefill rows in the flat batch; q is a strided view of a fused qkv output."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 32, kv_heads, block_size, head_dim, generator=gen)
    qkv = torch.randn(7, heads + 2 * kv_heads, head_dim, generator=gen)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    chunks = [SequenceChunk(0, 3, 3, [5]), SequenceChunk(3, 1, 20, [1, 2]), SequenceChunk(4, 2, 2, [9]),
              SequenceChunk(6, 1, 33, [10, 11, 12])]
    slots = torch.tensor([80, 81, 82, 2 * 16 + 3, 144, 145, 12 * 16 + 0])
    results = []
    for backend in (TorchReferenceBackend(), CpuPagedBackend(kernels)):
        c = cache.clone()
        results.append(backend.forward(q, k, v, c, backend.build_metadata(chunks, slots, block_size, c.device),
                                       AttentionLayer(head_dim ** -0.5)))
    assert torch.allclose(results[0], results[1], atol=2e-5, rtol=2e-5)


class DecodeCall:
    """Inputs of kernels.decode_attention over a cache of `lengths` sequences in scattered blocks, one row
    each, then `chunk` rows of one more sequence at consecutive positions from `chunk_start` (a prefill
    chunk attending query by query: the AVX2 path tiles such rows), rows in that order."""

    def __init__(self, seed, dtype, heads, kv_heads, head_dim, block_size, lengths, chunk=0, chunk_start=1):
        gen = torch.Generator().manual_seed(seed)
        self.lens = list(lengths) + list(range(chunk_start, chunk_start + chunk))
        self.tables = []
        used = [-(-length // block_size) for length in lengths] + ([-(-self.lens[-1] // block_size)] if chunk else [])
        num_blocks = sum(used) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        for n in used:
            self.tables.append(order[:n])
            order = order[n:]
        self.tables += [self.tables.pop()] * chunk if chunk else []
        max_blocks = max(used)
        self.block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in self.tables], dtype=torch.int32)
        self.context_lens = torch.tensor(self.lens, dtype=torch.int32)
        self.cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)
        self.q = torch.randn(len(self.lens), heads, head_dim, generator=gen).to(dtype)
        self.scale, self.block_size = head_dim ** -0.5, block_size

    def run(self, kernels, rows=None, cache=None, **window):
        """The outputs of `rows` (default all) attending in one call, as [len(rows), heads, head_dim]."""
        rows = list(range(len(self.lens))) if rows is None else rows
        out = torch.zeros_like(self.q[rows])
        kernels.decode_attention(out, self.q[rows], self.cache if cache is None else cache,
                                 torch.arange(len(rows), dtype=torch.int64), self.block_tables[rows],
                                 self.context_lens[rows], self.scale, **window)
        return out

    def keys_and_values(self, row):
        """Row `row`'s context as float32 [2, kv_heads, context, head_dim]."""
        blocks = self.cache[:, self.tables[row]].float()  # [2, blocks, kv_heads, block_size, head_dim]
        return blocks.transpose(1, 2).flatten(2, 3)[:, :, :self.lens[row]]

    def reference(self, window):
        """softmax(q k^T * scale) v over each row's last `window` keys, in float32."""
        out = torch.empty(self.q.shape)
        for row, length in enumerate(self.lens):
            kv = self.keys_and_values(row)[:, :, max(0, length - window) if window > 0 else 0:]
            group = self.q.shape[1] // kv.shape[1]
            k, v = kv.repeat_interleave(group, dim=1)
            weights = torch.softmax((k @ self.q[row].float().unsqueeze(-1)).squeeze(-1) * self.scale, dim=-1)
            out[row] = (weights.unsqueeze(1) @ v).squeeze(1)
        return out


# (heads, kv_heads, head_dim, block_size): the AVX-512 spans of each head_dim (192 and 256 too), AVX2's
# tiles, group 9 on the portable loop, and block sizes below, at and not dividing the 64-key spans
WINDOWED_SHAPES = [(9, 3, 64, 16), (8, 2, 128, 8), (8, 4, 256, 16), (4, 1, 256, 5), (6, 2, 192, 32),
                   (9, 1, 64, 16), (4, 4, 32, 16)]
# lengths: within and past a block, at and past a 64-key span, long
WINDOWED_LENGTHS = [1, 2, 7, 17, 40, 64, 65, 130, 200]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", WINDOWED_SHAPES)
def test_windowed_decode_attends_only_the_last_window_keys(kernels, dtype, heads, kv_heads, head_dim, block_size):
    call = DecodeCall(11, dtype, heads, kv_heads, head_dim, block_size, WINDOWED_LENGTHS, chunk=11, chunk_start=58)
    # one key, less than a block, not a multiple of the block size, a span, longer than every context
    for window in (1, 3, 37, 64, 1000):
        expected = call.reference(window)
        got = call.run(kernels, window=window)
        assert torch.allclose(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]), window


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", WINDOWED_SHAPES)
def test_a_windowed_decode_result_does_not_depend_on_the_rest_of_the_batch(kernels, heads, kv_heads, head_dim,
                                                                           block_size):
    call = DecodeCall(12, torch.bfloat16, heads, kv_heads, head_dim, block_size, WINDOWED_LENGTHS, chunk=10,
                      chunk_start=70)
    rows = len(call.lens)
    for window in (3, 37):
        together = call.run(kernels, window=window)
        for row in range(rows):
            assert torch.equal(call.run(kernels, [row], window=window)[0], together[row]), (window, row)
        # the chunk's rows in other tiles: its second half alone, and behind other sequences
        half = list(range(rows - 5, rows))
        assert torch.equal(call.run(kernels, half, window=window), together[half])
        assert torch.equal(call.run(kernels, [3, 8] + half, window=window)[2:], together[half])


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", WINDOWED_SHAPES)
def test_a_prefill_chunks_queries_attend_alike_however_the_chunk_is_cut(kernels, dtype, heads, kv_heads, head_dim,
                                                                       block_size, window):
    """Batch invariance of attention: a 150-query chunk from position 1 (tiles of many queries, spans cut
    mid-tile, odd and even edges) gives every query the bits it gets in pieces cut at random, behind
    other sequences' decodes, and alone."""
    call = DecodeCall(15, dtype, heads, kv_heads, head_dim, block_size, [5, 90], chunk=150, chunk_start=1)
    rows = len(call.lens)
    together = call.run(kernels, window=window)
    cuts = [2] + sorted(random.Random(head_dim + window).sample(range(3, rows), 7)) + [rows]
    for first, last in zip(cuts, cuts[1:]):
        piece = list(range(first, last))
        assert torch.equal(call.run(kernels, piece, window=window), together[piece]), (first, last)
        assert torch.equal(call.run(kernels, [1, 0] + piece, window=window)[2:], together[piece]), (first, last)
    for row in (2, 3, 18, 65, 66, rows - 1):
        assert torch.equal(call.run(kernels, [row], window=window)[0], together[row]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", WINDOWED_SHAPES)
def test_cache_slots_past_a_context_do_not_reach_its_result(kernels, dtype, heads, kv_heads, head_dim, block_size):
    """NaN in the slots of each sequence's last block past its context (as a reused block may hold): a
    lone decode's result stays bit-identical."""
    call = DecodeCall(16, dtype, heads, kv_heads, head_dim, block_size, WINDOWED_LENGTHS)
    poisoned = call.cache.clone()
    for row, length in enumerate(call.lens):
        last = call.tables[row][-1]
        poisoned[:, last, :, (length - 1) % block_size + 1:] = float("nan")
    for row in range(len(call.lens)):
        assert torch.equal(call.run(kernels, [row], cache=poisoned), call.run(kernels, [row])), row


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", WINDOWED_SHAPES)
def test_keys_before_the_window_do_not_reach_the_result(kernels, heads, kv_heads, head_dim, block_size):
    """NaN in every key and value before a row's window (the chunk's: before its first row's window), whole
    blocks included, as a freed and reused block may hold: the results stay bit-identical."""
    call = DecodeCall(13, torch.float32, heads, kv_heads, head_dim, block_size, WINDOWED_LENGTHS, chunk=9,
                      chunk_start=75)
    chunk_rows = len(call.lens) - 9
    for window in (3, 37):
        poisoned = call.cache.clone()
        for row, length in enumerate(call.lens[:chunk_rows + 1]):
            for position in range(max(0, length - window)):
                poisoned[:, call.tables[row][position // block_size], :, position % block_size] = float("nan")
        assert torch.equal(call.run(kernels, cache=poisoned, window=window), call.run(kernels, window=window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", WINDOWED_SHAPES)
def test_no_window_or_one_no_context_exceeds_is_full_attention_bit_for_bit(kernels, dtype, heads, kv_heads, head_dim,
                                                                           block_size):
    call = DecodeCall(14, dtype, heads, kv_heads, head_dim, block_size, WINDOWED_LENGTHS, chunk=8, chunk_start=30)
    full = call.run(kernels)
    assert torch.allclose(full.float(), call.reference(0), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for window in (0, -1, max(call.lens), 10 ** 9):
        assert torch.equal(call.run(kernels, window=window), full), window


@pytest.mark.parametrize("rows,hidden", [(33, 576), (1, 100), (17, 24)])  # widths with and without vector tails
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_add_then_norm(kernels, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    expected_residual = x + residual
    x32 = expected_residual.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # HF's formula
    got = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    assert torch.allclose(got.float(), expected.float(), atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])
    alone = kernels.add_rms_norm(x, None, weight, 1e-5)
    assert torch.allclose(alone.float(), F.rms_norm(x, (hidden,), weight, 1e-5).float(),
                          atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


# head_dim 64: every level's vector path; 48: AVX2's (half a multiple of 8), not AVX-512's; 36: scalar
@pytest.mark.parametrize("head_dim,inner", [(64, 96), (48, 100), (36, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations_and_rope_match_the_pytorch_ops(kernels, dtype, head_dim, inner):
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * inner, generator=gen).to(dtype) * 4
    expected = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    assert torch.allclose(kernels.silu_mul(gate_up).float(), expected.float(), atol=TOLERANCE[dtype] * 2,
                          rtol=TOLERANCE[dtype])
    gate_up[0, :4] = torch.tensor([-30.0, -9.0, 12.0, 0.0])  # GELU's tails: e^-2z overflows, or vanishes
    expected = F.gelu(gate_up[:, :inner], approximate="tanh") * gate_up[:, inner:]
    got = kernels.gelu_tanh_mul(gate_up)
    assert torch.allclose(got.float(), expected.float(), atol=TOLERANCE[dtype] * 2, rtol=TOLERANCE[dtype])
    assert torch.isfinite(got).all()

    rotary = RotaryEmbedding(head_dim, 300, 10000.0)
    qkv = torch.randn(6, 15, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 7, 299, 31, 1, 150])
    expected = apply_rotary(qkv[:, :12], *rotary.cos_sin(positions, dtype))
    untouched = qkv[:, 12:].clone()
    kernels.rope(qkv[:, :12], positions, rotary.cos, rotary.sin)
    assert torch.equal(qkv[:, :12], expected)  # element-wise, rounded like the unfused ops: exact
    assert torch.equal(qkv[:, 12:], untouched)


def test_wrappers_refuse_what_the_c_code_cannot_read(kernels):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.silu_mul(torch.zeros(8, 2).t())


def _capped_attention_by_query(q, cache, chunks, block_size, scale, cap):
    """Each query's attention over its causal context in float32, scores soft-capped: cap * tanh(s / cap)."""
    out = torch.empty(q.shape)
    for c in chunks:
        for i in range(c.query_len):
            row, length = c.query_start + i, c.context_len - c.query_len + i + 1
            blocks = cache[:, list(c.block_ids)].float()  # [2, blocks, kv_heads, block_size, head_dim]
            k, v = blocks.transpose(1, 2).flatten(2, 3)[:, :, :length].repeat_interleave(
                q.shape[1] // cache.shape[2], dim=1)
            scores = (k @ q[row].float().unsqueeze(-1)).squeeze(-1) * scale
            out[row] = (torch.softmax(torch.tanh(scores / cap) * cap, dim=-1).unsqueeze(1) @ v).squeeze(1)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (4, 4, 32)])  # the AVX-512 tiles; the portable loop
def test_soft_capped_scores_are_capped_before_the_softmax_on_both_cpu_backends(kernels, heads, kv_heads, head_dim):
    # Gemma 2's attn_logit_softcapping: decodes, a chunk from position 0 and one after cached context, in one step,
    # float32, against the formula; the cap (0.4, scores of std ~1) moves every output far beyond the tolerance
    block_size, cap, scale = 8, 0.4, head_dim ** -0.5
    cache, chunks, slots, q, k, v, _ = mixed_attention_step(heads, kv_heads, head_dim, 21, block_size)
    layer, cpu = AttentionLayer(scale, logit_softcap=cap), torch.device("cpu")
    written = cache.clone()
    written[0][slots // block_size, :, slots % block_size] = k
    written[1][slots // block_size, :, slots % block_size] = v
    expected = _capped_attention_by_query(q, written, chunks, block_size, scale, cap)
    uncapped = _capped_attention_by_query(q, written, chunks, block_size, scale, 1e9)
    assert not torch.allclose(expected, uncapped, atol=1e-2)
    for backend in (TorchReferenceBackend(), CpuPagedBackend(kernels), CpuPagedBackend(kernels, batch_invariant=False)):
        c = cache.clone()
        got = backend.forward(q, k, v, c, backend.build_metadata(chunks, slots, block_size, cpu), layer)
        assert torch.allclose(got, expected, atol=2e-5, rtol=2e-5), type(backend).__name__
