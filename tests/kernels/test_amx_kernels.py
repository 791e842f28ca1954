"""The AMX products (kernels/amx_kernels.c): bfloat16 weights packed into tiles, and quantised weights
dequantised into tiles on the fly, against float32 matmuls and the quantised reference."""

from __future__ import annotations

import gguf
import pytest
import torch

from helpers.tiny_gguf import encode
from tokenmill.layers.linear_kernels import AmxPackedKernel, OneDnnPackedKernel, make_kernel
from tokenmill.kernels.quantized import AMX_BELOW_ROWS, AMX_FROM_ROWS, from_gguf, quantize, reference_linear


def bf16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # both sum in float32 (in different orders) and round once to bfloat16: one unit of its last place
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 17, 33, 70])
@pytest.mark.parametrize("out_features,in_features", [(45, 96), (100, 576)])
def test_packed_bfloat16_product_equals_a_float32_matmul(amx_kernels, rows, out_features, in_features):
    torch.manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features).bfloat16()
    got = amx_kernels.amx_linear(x, amx_kernels.amx_pack(weight), out_features, bias)
    bf16_close(got, (x.float() @ weight.float().T + bias).bfloat16())


def test_packed_kernel_takes_strided_rows_and_hands_many_rows_to_onednn(amx_kernels):
    weight = (torch.randn(64, 128) * 0.05).bfloat16()
    kernel = AmxPackedKernel(weight, None, amx_kernels, batch_invariant=False)
    wide = torch.randn(9, 256).bfloat16()
    bf16_close(kernel(wide[:, :128]), (wide[:, :128].float() @ weight.float().T).bfloat16())
    many = torch.randn(AMX_BELOW_ROWS + 5, 128).bfloat16()
    bf16_close(kernel(many), (many.float() @ weight.float().T).bfloat16())


@pytest.mark.parametrize("rows", [AMX_FROM_ROWS, 17, 40, AMX_BELOW_ROWS - 1])
@pytest.mark.parametrize("fmt", ["int8", "int4", "Q4_K"])
def test_quantised_product_on_tiles_equals_the_dequantised_reference(amx_kernels, rows, fmt):
    torch.manual_seed(rows)
    cols = 512
    if fmt == "Q4_K":  # float32 scales and offsets
        qtype = gguf.GGMLQuantizationType.Q4_K
        packed = from_gguf(qtype, encode(torch.randn(45, cols).mul(0.05).numpy(), qtype, 1), cols)
    else:
        packed = quantize(torch.randn(45, cols) * 0.05, fmt)  # 45 outputs: a partial panel of 32
    bias = torch.randn(45)
    op = amx_kernels.qlinear_op(packed, bias, batch_invariant=False)
    x = torch.randn(rows, cols).bfloat16()
    assert op.int8_below(torch.bfloat16) == AMX_FROM_ROWS
    bf16_close(op(x), reference_linear(x, packed, bias, int8_below=AMX_FROM_ROWS))


def test_tile_products_do_not_depend_on_the_rest_of_the_batch(amx_kernels):
    weight = (torch.randn(80, 256) * 0.05).bfloat16()
    packed_bf16 = AmxPackedKernel(weight, None, amx_kernels)
    quantised = amx_kernels.qlinear_op(quantize(weight.float(), "int4"), None, batch_invariant=False)
    group = AMX_FROM_ROWS  # the fewest rows that still take the tiles
    batch = torch.randn(5 * group, 256).bfloat16()
    for op in (packed_bf16, quantised):
        together = op(batch)
        in_groups = torch.cat([op(batch[i:i + group]) for i in range(0, 5 * group, group)])
        assert torch.equal(together, in_groups)


def test_widths_the_tiles_cannot_take_stay_with_onednn(amx_kernels):
    weight = (torch.randn(30, 80) * 0.05).bfloat16()  # 80 input features: not a multiple of 32
    kernel = make_kernel(weight, None, packed=True, native=amx_kernels)
    assert isinstance(kernel, OneDnnPackedKernel)
    x = torch.randn(10, 80).bfloat16()
    bf16_close(kernel(x), (x.float() @ weight.float().T).bfloat16())


@pytest.mark.parametrize("fmt", ["int8", "int4", "Q4_K"])
def test_tiles_hold_exactly_the_dequantised_weights(amx_kernels, fmt):
    # one-hot input rows pick single weights: each output is one exact product, so the result is the
    # tiles' weights themselves, which must equal the many-row path's bfloat16 dequantisation bit for bit
    cols = 128
    if fmt == "Q4_K":
        qtype = gguf.GGMLQuantizationType.Q4_K
        packed = from_gguf(qtype, encode(torch.randn(40, 256).mul(0.05).numpy(), qtype, 2), 256)
        cols = 256
    else:
        packed = quantize(torch.randn(40, cols) * 0.05, fmt)
    op = amx_kernels.qlinear_op(packed, None, batch_invariant=False)
    picked = op(torch.eye(cols).bfloat16())  # cols >= AMX_FROM_ROWS rows: the tile path
    assert torch.equal(picked.T, packed.dequantize(torch.bfloat16))
