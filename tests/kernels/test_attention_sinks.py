"""GPT-OSS's attention sinks (a learned logit per query head that joins its softmax's denominator and takes no
value) on every attention backend, against transformers' own GPT-OSS eager attention: the reference backend, the
native CPU kernels (the AVX-512/AVX2 tiles at head_dim 64, the portable loop at 32; batch-invariant and not) and
Triton's kernels in the interpreter (the unified kernel, and the split-KV decode whose merge joins the sinks).

One step of decodes, a chunk from position 0, a chunk after cached context and a sliding window, float32; sinks
of std 2 (scores of std ~1), so that leaving them out moves every output far beyond the tolerance. Each case
runs in well under a second (the interpreter's few programs included)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.attention_steps import assert_split_kv_decode_matches_reference, mixed_attention_step

from tokenmill.attention.base import AttentionLayer
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_ref import TorchReferenceBackend

CPU = torch.device("cpu")
BLOCK = 8
TOLERANCE = 2e-5


def sink_step(heads, kv_heads, head_dim, seed=5):
    """A random cache, one step's chunks (decodes, a fresh chunk, a chunk after context) and its q, k, v, slots."""
    cache, chunks, slots, q, k, v, gen = mixed_attention_step(heads, kv_heads, head_dim, seed, BLOCK)
    sinks = torch.randn(heads, generator=gen) * 2
    return cache, chunks, slots, q, k, v, sinks


def hf_attention(q, cache, chunks, slots, k, v, sinks, scale, window):
    """transformers' GPT-OSS eager attention of each chunk over its cached context (the step's K/V written first).
    Imported here: the module costs seconds, which collecting the suite would pay on every worker."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    written = cache.clone()
    written[0][slots // BLOCK, :, slots % BLOCK] = k
    written[1][slots // BLOCK, :, slots % BLOCK] = v
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[1] // cache.shape[2], training=False)
    out = torch.empty(q.shape)
    for c in chunks:
        keys, values = written[:, list(c.block_ids)].transpose(1, 2).flatten(2, 3)[:, :, :c.context_len]
        rows = slice(c.query_start, c.query_start + c.query_len)
        positions = torch.arange(c.context_len - c.query_len, c.context_len)[:, None]
        seen = torch.arange(c.context_len)[None, :] <= positions
        if window:
            seen &= torch.arange(c.context_len)[None, :] > positions - window
        mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[None, None]
        got, _ = eager_attention_forward(module, q[rows].transpose(0, 1)[None], keys[None], values[None], mask, scale)
        out[rows] = got[0]
    return out


def backends(kernels):
    """(name, backend) of every backend this machine runs, the native one on `kernels` (None: without it)."""
    found = [("torch_ref", TorchReferenceBackend())]
    if kernels is not None:
        found += [("cpu_paged", CpuPagedBackend(kernels)), ("cpu_paged, not invariant",
                                                            CpuPagedBackend(kernels, batch_invariant=False))]
    try:
        from tokenmill.attention.triton_paged import TritonPagedBackend
    except ImportError:
        return found
    return found + [("triton_paged", TritonPagedBackend(True, CPU))]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (4, 4, 32)])  # the tiles; the portable loop
@pytest.mark.parametrize("window", [None, 9])
def test_sinks_join_the_softmax_as_transformers_gpt_oss_does_on_every_backend(process_kernels, heads, kv_heads,
                                                                              head_dim, window):
    cache, chunks, slots, q, k, v, sinks = sink_step(heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = hf_attention(q, cache, chunks, slots, k, v, sinks, scale, window)
    sinkless = hf_attention(q, cache, chunks, slots, k, v, torch.full_like(sinks, -1e9), scale, window)
    assert not torch.allclose(expected, sinkless, atol=1e-2)
    layer = AttentionLayer(scale, window, sinks=sinks)
    for name, backend in backends(process_kernels):
        c = cache.clone()
        got = backend.forward(q, k, v, c, backend.build_metadata(chunks, slots, BLOCK, CPU), layer)
        assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE), name


def test_split_kv_decode_merges_the_sinks_in():
    # without batch invariance long decodes split their keys across programs; the merge joins each head's sink once
    pytest.importorskip("tokenmill.attention.triton_paged")
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(7)) * 2
    assert_split_kv_decode_matches_reference(AttentionLayer(32 ** -0.5, None, sinks=sinks))
