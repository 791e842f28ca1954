"""The one-byte KV caches, int8 and fp8 (attention/kv_quant.py, kernels/decode_attention_q8.c): rows
round-trip within half a step, the native decode matches the reference backend over the same cache, and a
row's result ignores the batch."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.test_cpu_kernels import DecodeCall, random_batch
from tokenmill.attention.base import AttentionLayer, SequenceChunk
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.kv_quant import (STORAGE, dequantize_key_tiles, dequantize_rows, quantize_rows, row_width,
                                         write_tokens)
from tokenmill.attention.torch_ref import TorchReferenceBackend

CPU = torch.device("cpu")


def test_rows_round_trip_within_half_a_step():
    x = torch.randn(50, 3, 64) * torch.linspace(0.01, 10, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row keeps scale 0 and reads back as zeros
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    back = dequantize_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 + 1e-6)
    assert torch.equal(back[7, 1], torch.zeros(64))


def test_fp8_rows_round_trip_within_half_an_e4m3_step():
    """e4m3 keeps 3 mantissa bits: a value read back is within half a step (2^-4 of its binade, relative)
    of x / scale, the row's largest magnitude maps to 448 exactly, and the bits are torch's own e4m3."""
    x = torch.randn(50, 3, 64) * torch.linspace(0.01, 10, 50)[:, None, None]
    x[7, 1] = 0.0
    rows = quantize_rows(x, "fp8")
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 68)
    back = dequantize_rows(rows, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert torch.all((back - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -10)
    largest = x.abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.gather(-1, largest).abs(), x.abs().gather(-1, largest), rtol=1e-6)
    assert torch.equal(back[7, 1], torch.zeros(64))
    assert torch.equal(rows[..., :64], (x / torch.where(scale > 0, scale, 1)).to(torch.float8_e4m3fn).view(torch.uint8))


def _int8_cache(cache: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """The one-byte cache of `fmt` holding a float cache's every token, written as the engine writes them."""
    _, num_blocks, kv_heads, block_size, head_dim = cache.shape
    int8 = torch.zeros(2, num_blocks, kv_heads, block_size, row_width(head_dim), dtype=STORAGE[fmt])
    blocks = torch.arange(num_blocks).repeat_interleave(block_size)
    offsets = torch.arange(block_size).repeat(num_blocks)
    tokens = [plane.permute(0, 2, 1, 3).reshape(num_blocks * block_size, kv_heads, head_dim) for plane in cache]
    write_tokens(int8, blocks, offsets, *tokens)
    return int8


def test_keys_are_stored_transposed_and_read_back_as_written():
    cache = torch.randn(2, 3, 2, 4, 8)
    int8 = _int8_cache(cache)
    keys = dequantize_key_tiles(int8[0].view(3, 2, 4 * 12), 4, torch.float32)  # [blocks, heads, bs, D]
    expected = dequantize_rows(quantize_rows(cache[0]), torch.float32)
    assert torch.equal(keys, expected)
    assert torch.equal(dequantize_rows(int8[1], torch.float32), dequantize_rows(quantize_rows(cache[1]), torch.float32))


def _int8_batch(dtype, heads, kv_heads, head_dim, block_size, lengths, fmt="int8"):
    cache, chunks, slots, q, k, v = random_batch(13, dtype, heads, kv_heads, head_dim, block_size, lengths,
                                                 num_blocks=128)
    return _int8_cache(cache.float(), fmt), chunks, slots, q, k, v


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, None), (8, 2, 128, 8, None), (6, 1, 64, 5, None), (4, 4, 32, 16, 20)])
def test_native_one_byte_decode_matches_the_reference_backend(kernels, fmt, dtype, heads, kv_heads, head_dim,
                                                              block_size, window):
    lengths = [2, 17, 40, 3 * block_size + 1, 130, 200]
    cache, chunks, slots, q, k, v = _int8_batch(dtype, heads, kv_heads, head_dim, block_size, lengths, fmt)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref, fast = TorchReferenceBackend(), CpuPagedBackend(kernels)
    layer = AttentionLayer(head_dim ** -0.5, window)
    expected = ref.forward(q.float(), k.float(), v.float(), ref_cache,
                           ref.build_metadata(chunks, slots, block_size, CPU), layer)
    got = fast.forward(q, k, v, fast_cache, fast.build_metadata(chunks, slots, block_size, CPU), layer)
    assert torch.equal(fast_cache, ref_cache)  # both write the same quantised rows
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_one_byte_decode_does_not_depend_on_the_rest_of_the_batch(kernels, fmt):
    lengths = [300, 5, 77, 140]
    cache, chunks, slots, q, k, v = _int8_batch(torch.bfloat16, 9, 3, 64, 16, lengths, fmt)
    backend, layer = CpuPagedBackend(kernels), AttentionLayer(64 ** -0.5)
    together = backend.forward(q, k, v, cache.clone(), backend.build_metadata(chunks, slots, 16, CPU), layer)
    for i, chunk in enumerate(chunks):
        row = slice(i, i + 1)
        out = backend.forward(q[row], k[row], v[row], cache.clone(),
                              backend.build_metadata([SequenceChunk(0, 1, chunk.context_len, chunk.block_ids)],
                                                     slots[row], 16, CPU), layer)
        assert torch.equal(out[0], together[i])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])  # whole vectors, and a tail past them on the scalar loop
def test_the_native_writer_quantises_rows_bit_for_bit_as_pytorch(kernels, fmt, dtype, head_dim):
    """The fused step writes one-byte rows in C: they must equal kv_quant.write_tokens' bytes, ties (to even),
    e4m3 subnormals, signed zeros and all-zero rows included, so a token's cache bytes never depend on which
    path wrote them."""
    heads, block_size = 2, 16
    largest = 127.0 if fmt == "int8" else 448.0
    ties = ([2.5, 3.5, -2.5, 0.5, -0.5, 126.5] if fmt == "int8" else
            [1.0625, 1.1875, -1.0625, 2 ** -10, 3 * 2 ** -10, 2 ** -6 - 2 ** -10, 416.0, -0.0])
    crafted = torch.zeros(head_dim)
    crafted[0] = largest  # scale 1: each value is its own quotient
    crafted[1:1 + len(ties)] = torch.tensor(ties)
    crafted[-len(ties):] = torch.tensor(ties)  # and in the last dimensions (with head_dim 40, past the vectors)
    rows = torch.randn(40, heads, head_dim) * torch.logspace(-8, 2, 40)[:, None, None]
    rows[0, 0], rows[1, 1] = crafted, 0.0
    rows = rows.to(dtype)
    slots = torch.randperm(8 * block_size)[:40]
    expected = torch.zeros(2, 8, heads, block_size, row_width(head_dim), dtype=STORAGE[fmt])
    write_tokens(expected, slots // block_size, slots % block_size, rows, rows.flip(0))
    got = torch.zeros_like(expected)
    kernels.cache_write(got, rows, rows.flip(0), slots)
    assert torch.equal(got, expected)


def _float_cache(one_byte: torch.Tensor) -> torch.Tensor:
    """The float32 cache [2, blocks, kv_heads, block_size, head_dim] a one-byte cache reads back as."""
    _, num_blocks, kv_heads, block_size, width = one_byte.shape
    keys = dequantize_key_tiles(one_byte[0].reshape(num_blocks, kv_heads, block_size * width), block_size, torch.float32)
    return torch.stack([keys, dequantize_rows(one_byte[1], torch.float32)])


# (heads, kv_heads, head_dim, block_size): the query tiles at each head_dim they take (64, 128, 256) and
# block sizes 16 and 32; the per-query loops for a block size not a multiple of 16, group 9 and head_dim 32
ONE_BYTE_SHAPES = [(9, 3, 64, 16), (8, 2, 128, 32), (8, 4, 256, 16), (4, 1, 64, 5), (9, 1, 64, 16), (4, 4, 32, 16)]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", ONE_BYTE_SHAPES)
def test_a_prefill_chunk_over_a_one_byte_cache_attends_as_the_cache_reads_back(kernels, fmt, dtype, heads, kv_heads,
                                                                              head_dim, block_size):
    """Decodes and a 40-query chunk (rows in tiles) over a one-byte cache: each row is attention over the
    values the cache holds (widened, times their scales), with and without a window."""
    call = DecodeCall(21, dtype, heads, kv_heads, head_dim, block_size, [1, 17, 64, 130], chunk=40, chunk_start=50)
    one_byte = _int8_cache(call.cache.float(), fmt)
    call.cache = _float_cache(one_byte)  # what the reference attends over
    for window in (0, 37):
        got = call.run(kernels, cache=one_byte, window=window)
        tolerance = 2e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got.float(), call.reference(window), atol=tolerance, rtol=tolerance), window


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", ONE_BYTE_SHAPES)
def test_one_byte_prefill_queries_attend_alike_however_the_chunk_is_cut(kernels, fmt, window, heads, kv_heads,
                                                                        head_dim, block_size):
    """Batch invariance over a one-byte cache: a 150-query chunk's rows get the same bits in pieces cut at
    random, behind other sequences' decodes, and alone (a decode)."""
    call = DecodeCall(15, torch.bfloat16, heads, kv_heads, head_dim, block_size, [5, 90], chunk=150, chunk_start=1)
    one_byte = _int8_cache(call.cache.float(), fmt)
    rows = len(call.lens)
    together = call.run(kernels, cache=one_byte, window=window)
    cuts = [2] + sorted(random.Random(head_dim + window).sample(range(3, rows), 7)) + [rows]
    for first, last in zip(cuts, cuts[1:]):
        piece = list(range(first, last))
        assert torch.equal(call.run(kernels, piece, cache=one_byte, window=window), together[piece]), (first, last)
        assert torch.equal(call.run(kernels, [1, 0] + piece, cache=one_byte, window=window)[2:], together[piece])
    for row in (2, 3, 18, 65, 66, rows - 1):
        assert torch.equal(call.run(kernels, [row], cache=one_byte, window=window)[0], together[row]), row


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", ONE_BYTE_SHAPES)
def test_one_byte_slots_past_a_context_do_not_reach_its_result(kernels, fmt, heads, kv_heads, head_dim, block_size):
    """Each sequence's last block past its context holding NaN scales and arbitrary bytes (as a reused block
    may): the results, a chunk's rows included, stay bit-identical."""
    call = DecodeCall(16, torch.bfloat16, heads, kv_heads, head_dim, block_size, [1, 2, 7, 17, 40, 64, 65, 130],
                      chunk=9, chunk_start=20)
    one_byte = _int8_cache(call.cache.float(), fmt)
    poisoned = one_byte.clone()
    nan = torch.tensor([float("nan")]).view(poisoned.dtype)
    context = {}  # each sequence's last block: its longest context (the chunk's rows share a table)
    for row, length in enumerate(call.lens):
        context[call.tables[row][-1]] = max(length, context.get(call.tables[row][-1], 0))
    for last, length in context.items():
        past = (length - 1) % block_size + 1
        poisoned[1, last, :, past:, :head_dim] = 0x7F  # e4m3's NaN pattern, int8's largest
        poisoned[1, last, :, past:, head_dim:] = nan
        keys = poisoned[0, last].view(kv_heads, -1)  # [head_dim x block_size values][block_size scales]
        keys[:, :head_dim * block_size].view(kv_heads, head_dim, block_size)[:, :, past:] = 0x7F
        keys[:, head_dim * block_size:].view(kv_heads, block_size, 4)[:, past:] = nan
    expected = call.run(kernels, cache=one_byte)
    assert torch.equal(call.run(kernels, cache=poisoned), expected)


def test_the_native_writer_rounds_every_e4m3_number_and_midpoint_as_pytorch(kernels):
    """Quotients at every e4m3 number, every midpoint between neighbours (ties, to even) and just either side
    of each midpoint, both signs: the C writer's bytes are PyTorch's (scale 1: each row holds 448)."""
    numbers = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, in order
    midpoints = (numbers[1:] + numbers[:-1]) / 2
    quotients = torch.cat([numbers, midpoints, torch.nextafter(midpoints, torch.zeros(1)),
                           torch.nextafter(midpoints, torch.full((1,), 448.0))])
    quotients = torch.cat([quotients, -quotients])
    head_dim = 64
    per_row = head_dim - 1
    padded = torch.zeros(-(-len(quotients) // per_row) * per_row)
    padded[:len(quotients)] = quotients
    rows = torch.cat([torch.full((len(padded) // per_row, 1), 448.0), padded.view(-1, per_row)], dim=1)
    rows = rows.view(-1, 1, head_dim)
    slots = torch.arange(len(rows))
    blocks = -(-len(rows) // 16)
    expected = torch.zeros(2, blocks, 1, 16, row_width(head_dim), dtype=torch.uint8)
    write_tokens(expected, slots // 16, slots % 16, rows, rows)
    got = torch.zeros_like(expected)
    kernels.cache_write(got, rows, rows, slots)
    assert torch.equal(got, expected)
