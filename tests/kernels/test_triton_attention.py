"""The Triton backend's kernels, run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET), against the reference backend.

float32 only: the interpreter computes 16-bit floats wrongly (the kernels upcast them there), so
bfloat16 numerics are proven on a GPU (scripts/gpu-check.sh).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helpers.attention_steps import reference_and_backend
from tokenmill.attention.base import AttentionLayer, SequenceChunk
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.attention.triton_paged import TritonPagedBackend, host_metadata, write_kv

CPU = torch.device("cpu")
TOLERANCE = 1e-5


def mixed_batch(seed, heads, kv_heads, head_dim, block_size, specs, num_blocks=96):
    """A random cache, and chunks (query_len, context_len, query_by_query) over scattered blocks (holes
    included: the tables skip blocks, and unused blocks hold garbage)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, slots, start = [], [], 0
    for query_len, context_len, by_query in specs:
        used = -(-context_len // block_size)
        blocks, order = order[:used], order[used:]
        chunks.append(SequenceChunk(start, query_len, context_len, blocks, by_query))
        slots.extend(blocks[p // block_size] * block_size + p % block_size
                     for p in range(context_len - query_len, context_len))
        start += query_len
    q = torch.randn(start, heads, head_dim, generator=gen)
    k = torch.randn(start, kv_heads, head_dim, generator=gen)
    v = torch.randn(start, kv_heads, head_dim, generator=gen)
    return cache, chunks, torch.tensor(slots), q, k, v


# a fresh prefill, a prefix hit's chunk, decodes (one a block's first token), speculative rows
MIXED = [(20, 20, False), (7, 40, False), (1, 33, False), (1, 17, False), (3, 50, True), (1, 2, False)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 4, 16, 16),   # no GQA
    (6, 2, 32, 16),   # group 3 (not a power of two)
    (8, 1, 64, 8),    # multi-query, group 8, smaller blocks
    (10, 2, 24, 5),   # head_dim padded to 32, block size not a power of two, group 5
    (8, 2, 128, 16),  # Llama-3's head_dim, group 4
    (4, 2, 256, 16),  # Gemma's head_dim 256
])
@pytest.mark.parametrize("window", [None, 9])
def test_mixed_batch_matches_the_reference_backend(heads, kv_heads, head_dim, block_size, window):
    cache, chunks, slots, q, k, v = mixed_batch(1, heads, kv_heads, head_dim, block_size, MIXED)
    layer = AttentionLayer(head_dim ** -0.5, window)
    expected, ref_cache, got, got_cache = reference_and_backend(TritonPagedBackend(True, CPU), cache, chunks, slots, q, k, v,
                                               layer, block_size)
    assert torch.equal(got_cache, ref_cache)  # the K/V writes are copies: exact
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("window", [None, 21])
def test_wide_prefill_tiling_matches_the_reference_backend(window):
    # without batch invariance a step with a long chunk takes 64-row programs over 64-key tiles
    specs = [(70, 70, False), (40, 100, False), (1, 33, False), (3, 50, True)]
    cache, chunks, slots, q, k, v = mixed_batch(8, 8, 2, 32, 16, specs)
    layer = AttentionLayer(32 ** -0.5, window)
    expected, ref_cache, got, got_cache = reference_and_backend(TritonPagedBackend(False, CPU), cache, chunks, slots, q, k, v,
                                               layer, 16)
    assert torch.equal(got_cache, ref_cache)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("window", [None, 40])
def test_split_kv_decode_matches_the_reference_backend(window):
    # decode only, long contexts and few sequences: without batch invariance the keys are split
    specs = [(1, n, False) for n in (300, 257, 129, 5)]
    cache, chunks, slots, q, k, v = mixed_batch(2, 8, 2, 32, 16, specs, num_blocks=64)
    backend = TritonPagedBackend(False, CPU)
    meta = backend.build_metadata(chunks, slots, 16, CPU)
    assert backend._splits(meta, 2) > 1, "this step must take the split-KV kernel"
    layer = AttentionLayer(32 ** -0.5, window)
    expected, _, got, _ = reference_and_backend(backend, cache, chunks, slots, q, k, v, layer, 16)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("window", [None, 40])
def test_a_graphs_fixed_split_count_covers_short_and_empty_contexts(window):
    # a captured graph splits every sequence's keys 16 ways whatever its length: contexts shorter
    # than 16 tiles leave splits empty, and a padding row (context 0) comes out as zeros
    specs = [(1, n, False) for n in (300, 5, 33)]
    cache, chunks, slots, q, k, v = mixed_batch(2, 8, 2, 32, 16, specs, num_blocks=64)
    backend = TritonPagedBackend(False, CPU)
    meta = dataclasses.replace(backend.build_metadata(chunks, slots, 16, CPU), graph_splits=16)
    assert backend._splits(meta, 2) == 16
    layer = AttentionLayer(32 ** -0.5, window)
    ref = TorchReferenceBackend()  # (the reference alone: the Triton runs are the graph's two below)
    expected = ref.forward(q, k, v, cache.clone(), ref.build_metadata(chunks, slots, 16, CPU), layer)
    got = backend.forward(q, k, v, cache.clone(), meta, layer)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
    padded = dataclasses.replace(meta, seq_lens=torch.tensor([300, 0, 33], dtype=torch.int32),
                                 slot_mapping=torch.tensor([slots[0].item(), -1, slots[2].item()], dtype=torch.int32))
    got = backend.forward(q, k, v, cache.clone(), padded, layer)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.allclose(got[[0, 2]], expected[[0, 2]], atol=TOLERANCE, rtol=TOLERANCE)


def test_every_query_computes_the_same_bits_as_a_decode_at_its_position():
    # batch invariance: each query of a mixed step, attended alone as a one-token decode over the same
    # cache (with the step's K/V already written), gives bitwise the same output
    cache, chunks, slots, q, k, v = mixed_batch(3, 8, 2, 32, 16, MIXED)
    backend = TritonPagedBackend(True, CPU)
    layer = AttentionLayer(32 ** -0.5, 24)
    together = backend.forward(q, k, v, cache, backend.build_metadata(chunks, slots, 16, CPU), layer)
    for chunk in chunks:
        for i in range(chunk.query_len):
            row = chunk.query_start + i
            alone = SequenceChunk(0, 1, chunk.context_len - chunk.query_len + 1 + i, chunk.block_ids)
            out = backend.forward(q[row:row + 1], k[row:row + 1], v[row:row + 1], cache,
                                  backend.build_metadata([alone], slots[row:row + 1], 16, CPU), layer)
            assert torch.equal(out[0], together[row]), f"query {i} of the chunk at {chunk.query_start}"


def test_soft_capped_scores_match_a_dense_softmax():
    cache, chunks, slots, q, k, v = mixed_batch(4, 4, 2, 16, 16, [(6, 6, False), (1, 21, False)])
    backend = TritonPagedBackend(True, CPU)
    cap, scale = 5.0, 16 ** -0.5
    got = backend.forward(q, k, v, cache, backend.build_metadata(chunks, slots, 16, CPU),
                          AttentionLayer(scale, None, cap))
    for chunk in chunks:
        table = torch.tensor(chunk.block_ids)
        keys = cache[0][table].transpose(0, 1).reshape(2, -1, 16)[:, :chunk.context_len]  # [KVH, L, D]
        values = cache[1][table].transpose(0, 1).reshape(2, -1, 16)[:, :chunk.context_len]
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        queries = q[rows].transpose(0, 1)  # [H, Q, D]
        scores = queries @ keys.repeat_interleave(2, 0).transpose(1, 2) * scale
        scores = cap * torch.tanh(scores / cap)
        positions = torch.arange(chunk.context_len - chunk.query_len, chunk.context_len)
        scores = scores.masked_fill(torch.arange(chunk.context_len)[None, :] > positions[:, None], float("-inf"))
        expected = (scores.softmax(-1) @ values.repeat_interleave(2, 0)).transpose(0, 1)
        assert torch.allclose(got[rows], expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_padding_rows_write_nothing_and_attend_to_nothing():
    # a captured decode graph pads its batch with rows of slot -1 and context length 0
    cache, chunks, slots, q, k, v = mixed_batch(5, 4, 2, 16, 16, [(1, 20, False)])
    padded_chunks = chunks + [SequenceChunk(1, 1, 0, []), SequenceChunk(2, 1, 0, [])]
    padded_slots = torch.cat([slots, torch.tensor([-1, -1])])
    qp, kp, vp = (torch.cat([x, torch.randn(2, *x.shape[1:])]) for x in (q, k, v))
    backend = TritonPagedBackend(True, CPU)
    before = cache.clone()
    out = backend.forward(qp, kp, vp, cache, backend.build_metadata(padded_chunks, padded_slots, 16, CPU),
                          AttentionLayer(0.25))
    written = before.clone()
    block, offset = divmod(int(slots[0]), 16)
    written[0, block, :, offset], written[1, block, :, offset] = k[0], v[0]
    assert torch.equal(cache, written)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    assert torch.isfinite(out).all()


def test_key_only_cache_reads_values_from_the_key_plane():
    cache, chunks, slots, q, k, _ = mixed_batch(6, 4, 1, 32, 16, [(5, 12, False), (1, 30, False)])
    one_plane = cache[:1].clone()
    backend = TritonPagedBackend(True, CPU)
    layer = AttentionLayer(32 ** -0.5)
    got = backend.forward(q, k, k, one_plane, backend.build_metadata(chunks, slots, 16, CPU), layer)
    expected, _, _, _ = reference_and_backend(TorchReferenceBackend(), cache[:1].clone(), chunks, slots, q, k, k, layer, 16)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_unsupported_head_dims_and_dtypes_are_refused_by_name():
    backend = TritonPagedBackend(True, CPU)
    with pytest.raises(ValueError, match="head_dim 16..256, not 512"):
        backend.kv_cache_shape(8, 16, 2, 512)
    with pytest.raises(ValueError, match="head_dim"):
        backend.kv_cache_shape(8, 16, 2, 8)
    cache, chunks, slots, q, k, v = mixed_batch(7, 4, 2, 16, 16, [(1, 3, False)])
    with pytest.raises(ValueError, match="float64"):
        backend.forward(q.double(), k.double(), v.double(), cache.double(),
                        backend.build_metadata(chunks, slots, 16, CPU), AttentionLayer(0.25))


def test_host_metadata_pads_tables_to_the_widest_sequence():
    chunks = [SequenceChunk(0, 3, 3, [7]), SequenceChunk(3, 1, 40, [2, 9, 4])]
    starts, lens, tables = host_metadata(chunks, 16)
    assert starts.tolist() == [0, 3, 4] and lens.tolist() == [3, 40]
    assert tables.tolist() == [[7, 0, 0], [2, 9, 4]]


def test_host_metadata_takes_the_input_batchs_tables_as_the_chunks_lists_would_give_them():
    """The step's gathered rows (any width, blocks held past the context) give the chunks' padded tables."""
    chunks = [SequenceChunk(0, 3, 3, [7, 5]), SequenceChunk(3, 1, 40, [2, 9, 4, 6])]
    rows = np.array([[7, 5, 0, 0, 0], [2, 9, 4, 6, 0]], dtype=np.int32)
    for width in (None, 3, 8):
        expected = host_metadata(chunks, 16, width)
        got = host_metadata(chunks, 16, width, rows)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(expected, got))


def test_write_kv_stores_rows_at_their_slots():
    cache = torch.zeros(2, 4, 2, 8, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    write_kv(k, v, cache, torch.tensor([0, 13, 31], dtype=torch.int32))
    for row, slot in enumerate((0, 13, 31)):
        assert torch.equal(cache[0, slot // 8, :, slot % 8], k[row])
        assert torch.equal(cache[1, slot // 8, :, slot % 8], v[row])
    assert int((cache != 0).any(-1).sum()) == 12
