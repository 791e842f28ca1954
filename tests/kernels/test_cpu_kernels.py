"""The native CPU kernels against the PyTorch ops they replace (the reference backend and layers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.base import SequenceChunk
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_ref import TorchReferenceBackend
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
    expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(chunks, slots, block_size, torch.device("cpu")))
    got = fast.forward(q, k, v, fast_cache, fast.build_metadata(chunks, slots, block_size, torch.device("cpu")))
    assert torch.equal(fast_cache, ref_cache)  # the K/V writes are copies: exact
    assert torch.allclose(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_decode_result_does_not_depend_on_the_rest_of_the_batch(kernels):
    lengths = [300, 5, 77, 140]
    cache, chunks, slots, q, k, v = random_batch(5, torch.bfloat16, 9, 3, 64, 16, lengths, num_blocks=64)
    backend = CpuPagedBackend(kernels)
    together = backend.forward(q, k, v, cache.clone(), backend.build_metadata(chunks, slots, 16, torch.device("cpu")))
    for i, chunk in enumerate(chunks):
        alone = SequenceChunk(0, 1, chunk.context_len, chunk.block_ids)
        row = slice(i, i + 1)
        out = backend.forward(q[row], k[row], v[row], cache.clone(),
                              backend.build_metadata([alone], slots[row], 16, torch.device("cpu")))
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
        results.append(backend.forward(q, k, v, c, backend.build_metadata(chunks, slots, block_size, c.device)))
    assert torch.allclose(results[0], results[1], atol=2e-5, rtol=2e-5)


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
def test_silu_mul_and_rope_match_the_pytorch_ops(kernels, dtype, head_dim, inner):
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * inner, generator=gen).to(dtype) * 4
    expected = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    assert torch.allclose(kernels.silu_mul(gate_up).float(), expected.float(), atol=TOLERANCE[dtype] * 2,
                          rtol=TOLERANCE[dtype])

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
