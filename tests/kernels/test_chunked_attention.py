"""Llama 4's chunked local attention (a query at position p sees keys [(p // chunk) * chunk, p] only) on every
attention backend, against the formula written out here (transformers' chunked causal mask on plain attention): the
reference backend, the native CPU kernels (the AVX-512/AVX2 tiles at head_dim 64, the portable loop at 32; batch-
invariant and not; float32, bfloat16 and an int8 cache) and Triton's kernels in the interpreter (the unified kernel,
and the split-KV decode).

One step of decodes (positions 69 and 1), a chunk from position 0 (positions 0-5) and a chunk after cached context
(positions 25-29), with chunks of 4 and 8 positions: every kind of query has keys cut away by its chunk's start.
Each case runs in well under a second (the interpreter's few programs included)."""

from __future__ import annotations

import pytest
import torch

from helpers.attention_steps import (assert_split_kv_decode_matches_reference, mixed_attention_step,
                                    reference_and_backend)
from kernels.test_attention_sinks import backends
from tokenmill.attention.base import AttentionLayer
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.kernels.cpu_kernels import cpu_kernels

CPU = torch.device("cpu")
BLOCK = 8


def chunked_attention(q, cache, chunks, slots, k, v, scale, chunk):
    """Each chunk's attention over its cached context (the step's K/V written first), causal and within each
    query's own chunk of `chunk` positions, in float64."""
    written = cache.clone().double()
    written[0][slots // BLOCK, :, slots % BLOCK] = k.double()
    written[1][slots // BLOCK, :, slots % BLOCK] = v.double()
    group = q.shape[1] // cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for c in chunks:
        keys, values = written[:, list(c.block_ids)].transpose(1, 2).flatten(2, 3)[:, :, :c.context_len]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, L, D]
        rows = slice(c.query_start, c.query_start + c.query_len)
        positions = torch.arange(c.context_len - c.query_len, c.context_len)[:, None]
        seen = torch.arange(c.context_len)[None, :] <= positions
        seen &= torch.arange(c.context_len)[None, :] >= positions // chunk * chunk
        scores = (q[rows].double().transpose(0, 1) @ keys.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
        out[rows] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)
    return out.float()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (4, 4, 32)])  # the tiles; the portable loop
@pytest.mark.parametrize("chunk", [4, 8])
def test_chunked_attention_sees_only_its_own_chunk_on_every_backend(process_kernels, heads, kv_heads, head_dim, chunk):
    cache, chunks, slots, q, k, v, _ = mixed_attention_step(heads, kv_heads, head_dim, seed=7, block_size=BLOCK)
    scale = head_dim ** -0.5
    expected = chunked_attention(q, cache, chunks, slots, k, v, scale, chunk)
    whole = chunked_attention(q, cache, chunks, slots, k, v, scale, 1000)
    assert not torch.allclose(expected[0], whole[0], atol=1e-2)  # every kind of query loses keys to its chunk
    assert not torch.allclose(expected[9:12], whole[9:12], atol=1e-2)
    layer = AttentionLayer(scale, attention_chunk=chunk)
    for name, backend in backends(process_kernels):
        got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(chunks, slots, BLOCK, CPU), layer)
        assert torch.allclose(got, expected, atol=2e-5, rtol=2e-5), name


@pytest.mark.skipif(cpu_kernels() is None, reason="the native kernels did not build")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_native_chunked_attention_equals_the_reference_in_bfloat16_and_over_an_int8_cache(process_kernels, cache_dtype):
    # bfloat16: the layer the AMX tiles never take (they attend without chunks) goes to the decode kernels; int8:
    # decode_attention_q8.c's own walk over the keys
    from kernels.test_decode_q8 import _int8_cache

    cache, chunks, slots, q, k, v, _ = mixed_attention_step(8, 4, 64, seed=8, block_size=BLOCK)
    if cache_dtype == torch.int8:
        cache = _int8_cache(cache)
    else:
        cache, q, k, v = (t.to(torch.bfloat16) for t in (cache, q, k, v))
    layer = AttentionLayer(0.125, attention_chunk=8)
    for backend in (CpuPagedBackend(process_kernels), CpuPagedBackend(process_kernels, batch_invariant=False)):
        expected, _, got, _ = reference_and_backend(backend, cache, chunks, slots, q, k, v, layer, BLOCK)
        tolerance = 2e-2 if cache_dtype == torch.bfloat16 else 2e-5
        assert torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_split_kv_decode_keeps_to_the_chunk():
    # without batch invariance long decodes split their keys across programs: the splits start at the chunk
    pytest.importorskip("tokenmill.attention.triton_paged")
    assert_split_kv_decode_matches_reference(AttentionLayer(32 ** -0.5, attention_chunk=100))
