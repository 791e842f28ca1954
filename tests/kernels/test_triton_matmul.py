"""The batch-invariant products of a batch-invariant CUDA run, in Triton's interpreter on CPU tensors: the
float matmul (layers/triton_matmul.py) and the row log-softmax of the logprobs (sampling/triton_log_softmax.py).
Each must give a row the same bits whatever number of rows shares the call and wherever the row sits among
them, and agree with the float32 reference. Shapes are small (the interpreter runs every program in Python)
but reach every edge: outputs not a multiple of the tile width, input features not a multiple of the chunk,
a batch spanning two row tiles, rows with a stride (MLA's per-head views), a row wider than one chunk of
the log-softmax."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.triton_matmul import invariant_linear, pack_weight, tiling
from tokenmill.sampling.triton_log_softmax import row_log_softmax

OUT, IN = 96, 200  # 96 outputs: a partial column tile; 200 features: a partial last chunk


def _weights(dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, IN, generator=gen).to(dtype)
    return weight, (torch.randn(OUT, generator=gen) if bias else None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_matches_float32_and_gives_a_row_the_same_bits_in_any_batch(dtype, bias):
    weight, b = _weights(dtype, bias)
    packed = pack_weight(weight)
    assert packed.dtype == dtype  # InvariantDenseKernel converts inputs to this dtype
    gen = torch.Generator().manual_seed(1)
    # 100 rows: more than one row tile (64 in 16-bit, 32 in float32); the rows of interest at 37..100
    batch = torch.randn(100, IN, generator=gen).to(dtype)
    rows = batch[37:]
    got = invariant_linear(batch, packed, OUT, b)
    assert got.dtype == dtype and got.shape == (100, OUT)
    expected = batch.float() @ weight.float().t() + (0 if b is None else b)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:  # products exact, float32 sums in another order: at most the last bit of the rounding differs
        torch.testing.assert_close(got.float(), expected.to(dtype).float(), rtol=2 ** -7, atol=1e-2)
    # the same rows alone, in a batch of 7, in a batch of 64 at another offset in its tile, and strided
    for count in (1, 7, 33, 63):
        assert torch.equal(invariant_linear(rows[:count].clone(), packed, OUT, b), got[37:37 + count]), count
    assert torch.equal(invariant_linear(batch[36:100].clone(), packed, OUT, b), got[36:100])
    wide = torch.zeros(7, 3 * IN, dtype=dtype)
    wide[:, IN:2 * IN] = rows[:7]
    assert torch.equal(invariant_linear(wide[:, IN:2 * IN], packed, OUT, b), got[37:44])


def test_the_tiling_depends_on_the_weight_alone():
    # the kernel's constants take (outputs, features, dtype), never a row count: the invariance's premise
    assert tiling(2048, 8192, torch.bfloat16) == tiling(2048, 8192, torch.bfloat16)
    assert tiling(16384, 2048, torch.bfloat16).block_n == 128 and tiling(2048, 2048, torch.bfloat16).block_n == 64
    for t in (tiling(96, 200, torch.float32), tiling(96, 200, torch.bfloat16)):
        assert min(t.block_m, t.block_n, t.block_k) >= 16  # tl.dot's smallest tile


def test_invariant_linear_names_bad_inputs():
    weight, _ = _weights(torch.float32, False)
    packed = pack_weight(weight)
    with pytest.raises(ValueError, match="inputs of the weight's dtype"):
        invariant_linear(torch.zeros(2, IN, dtype=torch.bfloat16), packed, OUT, None)
    with pytest.raises(ValueError, match="packed weight is"):
        invariant_linear(torch.zeros(2, IN + 1), packed, OUT, None)
    with pytest.raises(ValueError, match="float32 bias"):
        invariant_linear(torch.zeros(2, IN), packed, OUT, torch.zeros(OUT, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous rows"):
        invariant_linear(torch.zeros(IN, 2).t(), packed, OUT, None)
    with pytest.raises(ValueError, match="2-D float32, bfloat16 or float16"):
        pack_weight(torch.zeros(4, 4, dtype=torch.int8))
    assert invariant_linear(torch.zeros(0, IN), packed, OUT, None).shape == (0, OUT)


def test_row_log_softmax_is_close_to_torch_and_gives_a_row_the_same_bits_in_any_batch():
    # 5,000 logits a row: two 4,096-lane chunks, the second partial; one row has -inf entries (masked tokens)
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(2)) * 8
    logits[2, ::3] = float("-inf")
    got = row_log_softmax(logits)
    torch.testing.assert_close(got, logits.log_softmax(dim=-1), rtol=1e-5, atol=1e-5)
    for first, count in ((0, 1), (2, 1), (3, 3), (1, 4)):
        assert torch.equal(row_log_softmax(logits[first:first + count].clone()), got[first:first + count])
    with pytest.raises(ValueError, match="float32 logits"):
        row_log_softmax(logits.to(torch.bfloat16))
