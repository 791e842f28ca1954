"""The CUDA path's fused element-wise Triton kernels (layers/triton_fused.py), in Triton's interpreter on
CPU tensors, against the PyTorch ops they replace (float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.layers.triton_fused import TritonFusedOps

OPS = TritonFusedOps()


def test_add_rms_norm_matches_pytorch_and_updates_the_residual_in_place():
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(5, 96, generator=gen) for _ in range(3))
    weight = weight[0]
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-6)
    got = OPS.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(residual, expected_residual)
    alone = OPS.add_rms_norm(x, None, weight, 1e-6)
    assert torch.allclose(alone, F.rms_norm(x, (96,), weight, 1e-6), atol=1e-5, rtol=1e-5)


# the interpreter adds two 16-bit tensors as their integer bits (the Triton attention upcasts for that reason),
# so the residual add is checked in float32 and bfloat16 rows without one
@pytest.mark.parametrize("dtype, with_residual", [(torch.float32, True), (torch.bfloat16, False)])
def test_add_rms_norm_gives_a_row_the_same_bits_in_any_batch(dtype, with_residual):
    # one program per row, its block the row's width: the norm a batch-invariant CUDA run takes in float32
    # too (choose_kernels), where PyTorch's reduction may split a row by the tensor's shape
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(9, 96, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(96, generator=gen).to(dtype)
    batched_residual = residual.clone() if with_residual else None
    batched = OPS.add_rms_norm(x, batched_residual, weight, 1e-6)
    for first, count in ((0, 1), (4, 1), (2, 5)):
        alone_residual = residual[first:first + count].clone() if with_residual else None
        alone = OPS.add_rms_norm(x[first:first + count].clone(), alone_residual, weight, 1e-6)
        assert torch.equal(alone, batched[first:first + count])
        if with_residual:
            assert torch.equal(alone_residual, batched_residual[first:first + count])


def test_gated_activations_match_pytorch():
    gate_up = torch.randn(4, 2 * 1500, generator=torch.Generator().manual_seed(1))  # two column blocks
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(OPS.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.allclose(OPS.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotated", [4, 3])  # one program rotates all of a token's heads, padded to 4
def test_rope_rotates_strided_rows_in_place_as_the_pytorch_path(rotated):
    rotary = RotaryEmbedding(64, 128, 10000.0, None)
    qkv = torch.randn(6, 5, 64, generator=torch.Generator().manual_seed(2))  # q and k heads, then v
    positions = torch.tensor([0, 3, 17, 64, 100, 127])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    q_and_k = qkv[:, :rotated]  # rows strided (v's head follows), heads contiguous
    expected = apply_rotary(q_and_k.clone(), cos, sin)
    value = qkv[:, rotated:].clone()
    OPS.rope(q_and_k, positions, rotary.cos, rotary.sin)
    assert torch.allclose(q_and_k, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, rotated:], value)  # the row's other heads untouched
