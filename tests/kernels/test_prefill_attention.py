"""The AMX prefill attention (kernels/prefill_attention.c) against the reference backend's SDPA, in
mixed batches of fresh prompts, chunks continuing a cached context and decodes."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention.base import AttentionLayer, SequenceChunk
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_ref import TorchReferenceBackend

CPU = torch.device("cpu")
# (query_len, context_len): a one-token prompt, fresh prompts shorter and longer than a key block (128),
# chunks that continue a context (a prefix hit, a later chunk of a long prompt) and two decodes
MIXED = [(1, 1), (37, 37), (1, 40), (200, 200), (20, 150), (130, 300), (1, 129)]


def mixed_batch(seed, heads, kv_heads, head_dim, block_size, spec):
    """A bfloat16 cache holding each sequence's earlier positions in scattered blocks, and q/k/v of
    the new tokens; returns (cache, chunks, slots, q, k, v) with q a strided view of a fused qkv."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-context // block_size) for _, context in spec)
    cache = torch.randn(2, need + 8, kv_heads, block_size, head_dim, generator=gen).bfloat16()
    order = torch.randperm(need + 8, generator=gen).tolist()
    chunks, slots, start = [], [], 0
    for query_len, context in spec:
        used = -(-context // block_size)
        blocks, order = order[:used], order[used:]
        chunks.append(SequenceChunk(start, query_len, context, blocks))
        for p in range(context - query_len, context):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        start += query_len
    qkv = torch.randn(start, heads + 2 * kv_heads, head_dim, generator=gen).bfloat16()
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return cache, chunks, torch.tensor(slots), q, k, v


def prefill_backend(amx_kernels):
    """The paged backend with prefill chunks attending as chunks (not query by query as decodes, the
    batch-invariant default), so that they go to the AMX kernel."""
    return CpuPagedBackend(amx_kernels, batch_invariant=False)


def layer_for(q):
    return AttentionLayer(q.shape[-1] ** -0.5)


def both_backends(amx_kernels, batch, block_size):
    cache, chunks, slots, q, k, v = batch
    ref, fast = TorchReferenceBackend(), prefill_backend(amx_kernels)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(chunks, slots, block_size, CPU), layer_for(q))
    meta = fast.build_metadata(chunks, slots, block_size, CPU)
    got = fast.forward(q, k, v, fast_cache, meta, layer_for(q))
    assert torch.equal(fast_cache, ref_cache)
    return got, expected, meta, fast_cache


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2: group 3
    (8, 2, 128, 16),   # head_dim 128: two passes over the output's dim tiles
    (4, 4, 32, 32),    # no grouping, one dim step, 32-token blocks
])
def test_prefill_attention_on_tiles_matches_sdpa(amx_kernels, heads, kv_heads, head_dim, block_size):
    batch = mixed_batch(11, heads, kv_heads, head_dim, block_size, MIXED)
    got, expected, meta, cache = both_backends(amx_kernels, batch, block_size)
    # scores and sums in float32 on both sides; SDPA rounds the probabilities to bfloat16 before P V,
    # the kernel keeps about 16 bits of them (two bfloat16 parts): a few bfloat16 units of the last place
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1e-2)
    # and the kernel did run (rather than the reference path behind it)
    q = batch[3]
    direct = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    assert amx_kernels.prefill_attention(direct, q, cache, meta.prefill_chunks, meta.prefill_tables, head_dim ** -0.5)
    prefill_rows = torch.cat([torch.arange(c.query_start, c.query_start + c.query_len)
                              for c in batch[1] if not (c.query_len == 1 and c.context_len > 1)])
    assert torch.equal(direct[prefill_rows], got[prefill_rows])
    # the SDPA masks of the chunks that continue a context were never built: the kernel took them
    assert all("mask" not in entry.__dict__ for entry in meta.prefills)


def test_a_prefill_row_does_not_depend_on_the_rest_of_the_batch(amx_kernels):
    batch = mixed_batch(12, 9, 3, 64, 16, MIXED)
    together, _, _, _ = both_backends(amx_kernels, batch, 16)
    cache, chunks, slots, q, k, v = batch
    chunk = chunks[5]  # 130 new tokens after 170 cached ones
    rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
    alone_chunk = SequenceChunk(0, chunk.query_len, chunk.context_len, chunk.block_ids)
    backend = prefill_backend(amx_kernels)
    alone = backend.forward(q[rows], k[rows], v[rows], cache.clone(),
                            backend.build_metadata([alone_chunk], slots[rows], 16, CPU), layer_for(q))
    assert torch.equal(alone, together[rows])


@pytest.mark.parametrize("head_dim,block_size", [(48, 16), (64, 8)])
def test_shapes_the_kernel_does_not_take_fall_back_to_sdpa(amx_kernels, head_dim, block_size):
    batch = mixed_batch(13, 4, 2, head_dim, block_size, MIXED)
    got, expected, meta, cache = both_backends(amx_kernels, batch, block_size)
    q = batch[3]
    if block_size % 16:  # the backend knows the kernel cannot take these blocks and does not ask it
        assert meta.prefill_chunks is None
    else:  # the kernel itself declines this head size
        assert not amx_kernels.prefill_attention(torch.empty_like(q.contiguous()), q, cache, meta.prefill_chunks,
                                                 meta.prefill_tables, head_dim ** -0.5)
    prefill_rows = [c.query_start + i for c in batch[1] if not (c.query_len == 1 and c.context_len > 1)
                    for i in range(c.query_len)]
    assert torch.equal(got[prefill_rows], expected[prefill_rows])  # the very same SDPA calls


def test_the_wrapper_refuses_what_the_kernel_cannot_read(amx_kernels):
    cache, chunks, slots, q, k, v = mixed_batch(14, 9, 3, 64, 16, MIXED[:2])
    meta = prefill_backend(amx_kernels).build_metadata(chunks, slots, 16, CPU)
    with pytest.raises(ValueError, match="bfloat16"):
        amx_kernels.prefill_attention(torch.empty(q.shape), q.float(), cache, meta.prefill_chunks, meta.prefill_tables, 0.125)
    with pytest.raises(ValueError, match="int64 chunks"):
        amx_kernels.prefill_attention(torch.empty_like(q.contiguous()), q, cache, meta.prefill_chunks.int(),
                                  meta.prefill_tables, 0.125)


def test_a_key_only_cache_gives_what_its_keys_repeated_as_values_give(amx_kernels):
    # MLA's latent cache: one plane, read as both keys and values
    cache, chunks, slots, q, k, _ = mixed_batch(15, 8, 1, 64, 16, MIXED)
    backend = prefill_backend(amx_kernels)
    one_plane, two_planes = cache[:1].clone(), torch.cat((cache[:1], cache[:1]))
    meta = backend.build_metadata(chunks, slots, 16, CPU)
    got = backend.forward(q, k, k, one_plane, meta, layer_for(q))
    expected = backend.forward(q, k, k, two_planes, backend.build_metadata(chunks, slots, 16, CPU), layer_for(q))
    assert torch.equal(got, expected)
    direct = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    assert amx_kernels.prefill_attention(direct, q, one_plane, meta.prefill_chunks, meta.prefill_tables, 64 ** -0.5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (16, 1, 32)])
def test_every_query_gets_the_same_bits_however_its_chunk_is_cut(amx_kernels, heads, kv_heads, head_dim):
    """The batch-invariant default on AMX attends every query on these tiles: a 150-query chunk after 180
    cached positions gives each query the bits it gets in pieces cut at random (tiles of 16 queries and
    items of a few queries times the group's heads), behind another sequence's decode, and one query at
    a time as decodes; NaN in the cache slots past the context never reaches it."""
    block_size, context, length = 16, 330, 150
    start = context - length
    gen = torch.Generator().manual_seed(head_dim)
    blocks = -(-context // block_size)
    cache = torch.randn(2, 2 * blocks + 2, kv_heads, block_size, head_dim, generator=gen).bfloat16()
    order = torch.randperm(2 * blocks + 2, generator=gen)
    table, other_table = order[:blocks].int(), order[blocks:2 * blocks].int()
    cache[:, table[-1], :, context % block_size:] = float("nan")
    q = torch.randn(length, heads, head_dim, generator=gen).bfloat16()
    other_q = torch.randn(1, heads, head_dim, generator=gen).bfloat16()

    def run(pieces, behind_a_decode=False):
        rows, lens, contexts, tables = [], [], [], []
        if behind_a_decode:
            rows, lens, contexts, tables = [other_q], [1], [200], [other_table]
        for first, last in pieces:
            rows.append(q[first:last])
            lens.append(last - first)
            contexts.append(start + last)
            tables.append(table)
        lens_t = torch.tensor(lens)
        chunks = torch.stack([torch.cumsum(lens_t, 0) - lens_t, lens_t, torch.tensor(contexts)]).contiguous()
        queries = torch.cat(rows)
        out = torch.full(queries.shape, float("nan"), dtype=torch.bfloat16)
        assert amx_kernels.prefill_attention(out, queries, cache, chunks, torch.stack(tables).contiguous(),
                                             head_dim ** -0.5)
        return out[1:] if behind_a_decode else out

    together = run([(0, length)])
    assert not together.isnan().any()
    cuts = [0] + sorted(random.Random(head_dim).sample(range(1, length), 9)) + [length]
    pieces = list(zip(cuts, cuts[1:]))
    assert torch.equal(run(pieces), together)
    assert torch.equal(run(pieces, behind_a_decode=True), together)
    assert torch.equal(run([(0, 17), (17, 33), (33, 34), (34, 50), (50, length)]), together)
    assert torch.equal(run([(i, i + 1) for i in range(length)]), together)
    for row in (0, 17, length - 1):  # a lone decode: with one kv head, an item per query head
        assert torch.equal(run([(row, row + 1)]), together[row:row + 1]), row


def test_the_batch_invariant_backend_puts_every_chunk_on_the_tiles_but_windowed_layers(amx_kernels):
    """Batch-invariant with AMX: decodes and prefills alike go to the tiles, so a query's bits do not
    depend on whether it comes in its prompt or alone; a windowed layer takes the decode kernel for every
    query instead, the same for every batch."""
    cache, chunks, slots, q, k, v = mixed_batch(16, 9, 3, 64, 16, MIXED)
    backend = CpuPagedBackend(amx_kernels, batch_invariant=True)
    meta = backend.build_metadata(chunks, slots, 16, CPU)
    assert meta.prefill_chunks.shape[1] == len(chunks) and meta.decode_token_index is None
    written = cache.clone()  # holds the step's K/V once the forward has run
    got = backend.forward(q, k, v, written, meta, layer_for(q))
    direct = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    assert amx_kernels.prefill_attention(direct, q, written, meta.prefill_chunks, meta.prefill_tables, 64 ** -0.5)
    assert torch.equal(got, direct)
    expected = TorchReferenceBackend().forward(q, k, v, cache.clone(), TorchReferenceBackend().build_metadata(
        chunks, slots, 16, CPU), layer_for(q))
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1e-2)
    windowed = AttentionLayer(64 ** -0.5, sliding_window=50)
    meta = backend.build_metadata(chunks, slots, 16, CPU)
    got = backend.forward(q, k, v, cache.clone(), meta, windowed)
    assert meta.decode_token_index.numel() == q.shape[0]  # every query as a one-token decode
    expected = TorchReferenceBackend().forward(q, k, v, cache.clone(), TorchReferenceBackend().build_metadata(
        chunks, slots, 16, CPU), windowed)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1e-2)

