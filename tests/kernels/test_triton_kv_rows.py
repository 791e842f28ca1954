"""The Triton backend over one-byte KV caches (int8, fp8), in Triton's interpreter on CPU tensors: its writes
are the reference quantiser's bytes (kv_quant.py; the same blocks move through the prefix cache, the second
tier, swap and transfers, whichever backend wrote them), and its attention over a one-byte cache equals the
reference backend's, which attends to the cache's dequantised values.

Shapes are small: the interpreter runs each (token, head) program in Python (~30 ms each).
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention_steps import reference_and_backend
from tokenmill.attention.base import AttentionLayer, SequenceChunk
from tokenmill.attention.kv_quant import STORAGE, row_width, write_tokens
from tokenmill.attention.triton_paged import TritonPagedBackend, check_cache
from tokenmill.attention.triton_kv_rows import write_kv_rows

CPU = torch.device("cpu")
TOLERANCE = 1e-5
FORMATS = ["int8", "fp8"]


def garbage_cache(fmt, num_blocks, kv_heads, block_size, head_dim, seed=0):
    """A one-byte cache of random bytes (what a write must leave alone stays as it was)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (2, num_blocks, kv_heads, block_size, row_width(head_dim)), generator=gen,
                         dtype=torch.int8).view(STORAGE[fmt])


def filled_cache(fmt, num_blocks, kv_heads, block_size, head_dim, gen):
    """A one-byte cache whose every row is a random row quantised (the reference reads whole blocks, so a
    garbage scale's NaN would reach its output through a zero softmax weight)."""
    cache = garbage_cache(fmt, num_blocks, kv_heads, block_size, head_dim)
    tokens = num_blocks * block_size
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    write_tokens(cache, torch.arange(num_blocks).repeat_interleave(block_size),
                 torch.arange(block_size).repeat(num_blocks), k, v)
    return cache


def written_both_ways(fmt, k, v, slots, num_blocks, block_size):
    """(the reference quantiser's cache, the Triton writer's) after writing k, v at `slots` (-1: none)."""
    expected = garbage_cache(fmt, num_blocks, k.shape[1], block_size, k.shape[2])
    got = expected.clone()
    kept = slots >= 0
    write_tokens(expected, slots[kept] // block_size, slots[kept] % block_size, k[kept].float(), v[kept].float())
    write_kv_rows(k, v, got, slots.to(torch.int32))
    return expected, got


@pytest.mark.parametrize("fmt", FORMATS)
def test_writes_are_the_reference_quantisers_bytes(fmt):
    # rows of every magnitude (e4m3's subnormal range included), a zero row, negative zeros, a padding
    # slot (-1) and bfloat16 inputs; block size 5: rows cross no power-of-two boundary
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(9, 2, 32, generator=gen) * torch.logspace(-30, 4, 9)[:, None, None]
    v = torch.randn(9, 2, 32, generator=gen)
    k[1, 0] = 0.0
    v[2, 1, ::3] = -0.0
    v[3, 0, 1:] = torch.rand(31, generator=gen) * 1e-4  # one large value: the rest falls to e4m3's subnormals
    slots = torch.tensor([0, 7, 12, -1, 33, 34, 21, 3, 39])
    for inputs in ((k, v), (k.bfloat16(), v.bfloat16())):
        expected, got = written_both_ways(fmt, *inputs, slots, 8, 5)
        assert torch.equal(got, expected)


def _e4m3_halfway_rows():
    """[n, 128] rows, each led by 448 (so its scale is exactly 1): every value halfway between two
    neighbouring e4m3 values, one float32 ulp either side of it, and the negatives of these."""
    finite = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    halfway = (finite[:-1] + finite[1:]) / 2
    candidates = torch.cat([halfway, torch.nextafter(halfway, torch.zeros(1)), torch.nextafter(halfway, finite[1:])])
    candidates = torch.cat([candidates, -candidates])
    rows = torch.nn.functional.pad(candidates, (0, -len(candidates) % 127)).view(-1, 127)
    return torch.cat([torch.full((rows.shape[0], 1), 448.0), rows], dim=1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even_as_the_reference(fmt):
    # int8: rows scaled by exactly 1 (max 127) holding every x.5 in range; fp8: every e4m3 tie (round to
    # even, and the carry from the mantissa into the exponent), where Triton's own cast would round up
    if fmt == "fp8":
        rows = _e4m3_halfway_rows()
    else:
        halves = torch.arange(-127, 127, dtype=torch.float32) + 0.5
        rows = torch.cat([torch.tensor([127.0]), halves, torch.zeros(256 - 1 - len(halves))]).view(2, 128)
        rows[1, 0] = -127.0
    k = rows.view(-1, 1, 128)
    v = k.flip(0).contiguous()
    expected, got = written_both_ways(fmt, k, v, torch.arange(k.shape[0]), 2, 8)
    assert torch.equal(got, expected)


def mixed_step(fmt, seed, heads, kv_heads, head_dim, block_size, specs, num_blocks=48):
    """A one-byte cache whose every row is a real quantised row, and a step's chunks (query_len, context_len,
    query_by_query) over scattered blocks with their q, k, v and slots."""
    gen = torch.Generator().manual_seed(seed)
    cache = filled_cache(fmt, num_blocks, kv_heads, block_size, head_dim, gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, slots, start = [], [], 0
    for query_len, context_len, by_query in specs:
        blocks, order = order[:-(-context_len // block_size)], order[-(-context_len // block_size):]
        chunks.append(SequenceChunk(start, query_len, context_len, blocks, by_query))
        slots.extend(blocks[p // block_size] * block_size + p % block_size
                     for p in range(context_len - query_len, context_len))
        start += query_len
    q, k, v = (torch.randn(start, n, head_dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    return cache, chunks, torch.tensor(slots), q, k, v


# a fresh prefill, a prefix hit's chunk, decodes (one a block's first token), speculative rows
MIXED = [(12, 12, False), (5, 30, False), (1, 33, False), (1, 17, False), (3, 40, True)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_mixed_step_over_a_one_byte_cache_matches_the_reference_backend(fmt):
    # GQA group 3 and a window: the unified kernel's every kind of query over one-byte tiles
    cache, chunks, slots, q, k, v = mixed_step(fmt, 2, 6, 2, 32, 16, MIXED)
    layer = AttentionLayer(32 ** -0.5, 21)
    expected, ref_cache, got, got_cache = reference_and_backend(TritonPagedBackend(True, CPU), cache, chunks, slots,
                                                           q, k, v, layer, 16)
    assert torch.equal(got_cache, ref_cache)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_kv_decode_over_a_one_byte_cache_matches_the_reference_backend(fmt):
    # decode only, long contexts: without batch invariance each sequence's keys are split
    specs = [(1, 290, False), (1, 5, False)]
    cache, chunks, slots, q, k, v = mixed_step(fmt, 3, 4, 1, 64, 16, specs, num_blocks=24)
    backend = TritonPagedBackend(False, CPU)
    assert backend._splits(backend.build_metadata(chunks, slots, 16, CPU), 1) > 1, "this step must split"
    expected, ref_cache, got, got_cache = reference_and_backend(backend, cache, chunks, slots, q, k, v,
                                                           AttentionLayer(0.125), 16)
    assert torch.equal(got_cache, ref_cache)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_one_byte_caches_the_kernels_do_not_take_are_refused_by_name():
    backend = TritonPagedBackend(True, CPU)
    assert backend.kv_cache_shape(8, 16, 2, row_width(256)) == (2, 8, 2, 16, 260)  # Gemma's head_dim, fp8 rows
    check_cache(256, "fp8", 2)
    with pytest.raises(ValueError, match="MLA latent .key-only. caches are not quantised"):
        check_cache(64, "fp8", 1)
    with pytest.raises(ValueError, match="head_dim a multiple of 4 .* not 18"):
        check_cache(18, "int8", 2)
    with pytest.raises(ValueError, match="head_dim 16..256, not 260"):
        check_cache(260, None, 2)
    cache = garbage_cache("int8", 4, 2, 16, 16)
    q = torch.randn(1, 2, 32)
    step = backend.build_metadata([SequenceChunk(0, 1, 1, [0])], torch.tensor([0]), 16, CPU)
    with pytest.raises(ValueError, match="head_dim 32 has rows of 36 bytes, not 20"):
        backend.forward(q, q, q, cache, step, AttentionLayer(0.25))
