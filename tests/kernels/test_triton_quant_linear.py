"""The Triton weight-only quantised product (layers/triton_quant_linear.py) in Triton's interpreter: it equals
the float32 product with the dequantised weight for int4 and int8 weights, float16 and float32 scales,
Q6_K-style sub-scales and activation order; batch-invariant, each output row is bit-identical whatever the
number of rows; its embedding rows are the dequantised weight's rows. Shapes are tiny and few (the
interpreter runs every program in Python): widths off the tiles' multiples so every mask is exercised, and
enough input features that the few-row tiling splits its K loop."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.kernels.quantized import QuantizedWeight, cat_rows, pack_blocks, quantize, reference_linear
from tokenmill.layers import triton_quant_linear
from tokenmill.layers.linear import MergedColumnParallelLinear
from tokenmill.layers.triton_quant_linear import DECODE, PREFILL, TritonQuantizedProduct
from tokenmill.models.loader.packed_layers import packed_when_in_runs

ROWS, COLS = 80, 224  # outputs off BLOCK_N's multiples; inputs padded to 256: two K tiles of the decode tiling


def _sub_scaled(rows: int, cols: int) -> QuantizedWeight:
    """An int8 weight with a signed sub-scale per 16 columns, as GGUF Q6_K converts (scale d, offset -32 d)."""
    g = torch.Generator().manual_seed(3)
    u = torch.randint(0, 64, (rows, cols), generator=g, dtype=torch.uint8)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.01).half().float()
    sub = torch.randint(-128, 128, (rows, cols // 16), generator=g, dtype=torch.int8)
    return pack_blocks("int8", cols, u, d, -32 * d, sub)


def _float32_scaled(rows: int, cols: int) -> QuantizedWeight:
    """An int4 weight whose scales are not float16 values (Q4_K's products of two scales)."""
    g = torch.Generator().manual_seed(4)
    u = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.1 + 1e-3
    weight = pack_blocks("int4", cols, u, scale, -scale * 7.3)
    assert weight.scale.dtype == torch.float32
    return weight


def _act_order(rows: int, cols: int, bits: int, seed: int = 5) -> QuantizedWeight:
    """A GPTQ desc_act layer (groups of 64 inputs shuffled over the inputs) as the loader keeps it packed."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.arange(cols)[torch.randperm(cols, generator=g)] // 64
    u = torch.randint(0, 1 << bits, (rows, cols), generator=g)
    zeros = torch.randint(1, (1 << bits) - 1, (rows, cols // 64), generator=g)
    scales = (torch.rand(rows, cols // 64, generator=g) * 0.003 + 0.001).half().float()
    weight = packed_when_in_runs(u, zeros, scales, groups, bits)
    assert weight is not None and weight.input_order is not None
    expected = (u - zeros[:, groups]).float() * scales[:, groups]
    assert torch.equal(weight.dequantize(), expected)  # the stored permutation undone
    return weight


WEIGHTS = {
    "int4": lambda: quantize(torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1)), "int4"),
    "int8": lambda: quantize(torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(2)), "int8"),
    "int8-sub-scales": lambda: _sub_scaled(ROWS, COLS),
    "int4-float32-scales": lambda: _float32_scaled(ROWS, COLS),
    "int4-act-order": lambda: _act_order(ROWS, 256, 4),
    "int8-act-order": lambda: _act_order(ROWS, 256, 8),
}


def reference(x: torch.Tensor, weight: QuantizedWeight, bias) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), weight.dequantize().double(), bias.double())


@pytest.mark.parametrize("kind", WEIGHTS)
def test_products_equal_the_float32_product_with_the_dequantised_weight(kind):
    weight = WEIGHTS[kind]()
    bias = torch.randn(ROWS)
    for invariant in (True, False):
        product = TritonQuantizedProduct(weight, bias, invariant)
        assert product.format == weight.format and product.splits[DECODE] > 1  # the split K loop is covered
        for m in (1, 3, 17, 33):  # both tilings where not batch-invariant, and partial tiles of both
            x = torch.randn(m, weight.cols)
            torch.testing.assert_close(product(x).double(), reference(x, weight, bias), rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 5, weight.cols)[:, ::2]  # leading dimensions, strided rows
    assert product(x).shape == (2, 3, ROWS)
    torch.testing.assert_close(product(x).double(), reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_inputs_give_results_in_their_dtype(dtype):
    weight = WEIGHTS["int4"]()
    product = TritonQuantizedProduct(weight, None, batch_invariant=False)
    for m in (2, 20):
        x = torch.randn(m, COLS).to(dtype)
        y = product(x)
        assert y.dtype == dtype
        # the result rounded once to the 16-bit dtype (the interpreter's bfloat16 casts truncate: 2 ulps)
        torch.testing.assert_close(y.float(), reference(x.float(), weight, torch.zeros(ROWS)).float(),
                                   rtol=2 ** -6, atol=1e-2)


@pytest.mark.parametrize("kind", ["int4", "int8-sub-scales", "int4-act-order"])
def test_batch_invariant_rows_are_bit_identical_at_any_row_count(kind, monkeypatch):
    """Each row's sums run the same tiles in the same order whether it shares the product with 0 or 63
    other rows, across the few-row/many-row boundary (16/17) and the split product's row chunks."""
    weight = WEIGHTS[kind]()
    product = TritonQuantizedProduct(weight, torch.randn(ROWS), batch_invariant=True)
    assert product.splits[DECODE] > 1
    x = torch.randn(64, weight.cols)
    full = product(x)
    for first, m in ((0, 1), (0, 17), (61, 3), (31, 33)):  # rows at other positions of their tiles too
        assert torch.equal(product(x[first:first + m]), full[first:first + m]), (first, m)
    monkeypatch.setattr(triton_quant_linear, "_SPLIT_ROWS", 16)  # 64 rows in four launches
    assert torch.equal(product(x), full)


def test_without_batch_invariance_many_rows_take_the_large_tiles():
    product = TritonQuantizedProduct(WEIGHTS["int4"](), None, batch_invariant=False)
    assert product.tiling(1) is product.tiling(16) is DECODE and product.tiling(17) is PREFILL
    assert product.splits[PREFILL] == 1  # a split K loop only where few rows leave the GPU idle
    invariant = TritonQuantizedProduct(WEIGHTS["int4"](), None, batch_invariant=True)
    assert {invariant.tiling(m) for m in (1, 17, 4096)} == {DECODE}


@pytest.mark.parametrize("kind", ["int4", "int8-sub-scales", "int4-float32-scales", "int4-act-order"])
def test_embedding_rows_are_the_dequantised_rows(kind):
    weight = WEIGHTS[kind]()
    product = TritonQuantizedProduct(weight, None, batch_invariant=True)
    ids = torch.tensor([[3, 0], [ROWS - 1, 3]])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(product.embedding(ids, dtype), weight.dequantize(dtype)[ids])


def test_activation_order_on_the_cpu_products_and_through_row_operations():
    """The native CPU kernels gather the input in the stored order as the reference does; rows select and
    fuse keeping the order; input features split where the groups stay in runs, else a clear error."""
    weight = WEIGHTS["int4-act-order"]()
    x = torch.randn(3, weight.cols)
    kernels = cpu_kernels()
    if kernels is not None:  # a machine without a compiler has only the reference
        op = kernels.qlinear_op(weight, None)
        torch.testing.assert_close(op(x), reference_linear(x, weight, None), rtol=1e-5, atol=1e-4)
        assert torch.equal(op.embedding(torch.tensor([1, 4]), torch.float32), weight.dequantize()[[1, 4]])
    fused = cat_rows([weight.narrow(0, 0, 16), weight.narrow(0, 16, 64)])
    assert torch.equal(fused.dequantize(), weight.dequantize())
    with pytest.raises(ValueError, match="must share one order of their input features"):
        cat_rows([weight, quantize(torch.randn(8, weight.cols), "int4")])
    whole_groups = QuantizedWeight(weight.format, weight.cols, weight.data, weight.scale, weight.offset,
                                   input_order=torch.arange(weight.cols).view(-1, 64).flip(0).flatten())
    half = whole_groups.narrow(1, 128, 128)  # features 128..255 are the first two stored groups
    assert torch.equal(half.dequantize(), whole_groups.dequantize()[:, 128:])
    with pytest.raises(ValueError, match="activation order .* cannot be split by input features"):
        weight.narrow(1, 0, 128)


def test_fused_projections_in_different_input_orders_load_as_their_float_weights():
    """No GPTQ tool writes them (projections of one input share its order), but such a checkpoint still
    loads: one packed weight has one input order, so the layer keeps the exact dequantised floats."""
    first, second = WEIGHTS["int4-act-order"](), _act_order(48, 256, 4, seed=6)
    assert not torch.equal(first.input_order, second.input_order)
    layer = MergedColumnParallelLinear(256, [ROWS, 48])
    layer.weight_loader(layer.weight, first, 0)
    layer.weight_loader(layer.weight, second, 1)
    assert layer.quantized is None
    assert torch.equal(layer.weight.data, torch.cat([first.dequantize(), second.dequantize()]))
