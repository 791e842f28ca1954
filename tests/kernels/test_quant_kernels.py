"""The quantised weight layout and its native products, against GGUF's own decoding and the PyTorch
reference (`reference_linear`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from helpers.tiny_gguf import encode
from tokenmill.kernels.isa import level_named
from tokenmill.kernels.cpu_kernels import ALWAYS_INT8, load_kernels
from tokenmill.kernels import quantized
from tokenmill.kernels.quantized import (DEQUANTIZE_FROM_ROWS, EXACT_GGUF_FORMATS, QuantizedWeight, cat_rows,
                                        from_gguf, quantize, quantize_activations, reference_linear)
from tokenmill.models.loader.gguf_tensors import undo_llama_rope_permute

T = gguf.GGMLQuantizationType


def gguf_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    weight = np.random.default_rng(seed).normal(0, 0.05, size=(rows, cols)).astype(np.float32)
    return encode(weight, qtype, seed)


def packed_weight(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """`quantize(weight, fmt)`; fmt "int8+sub": int8 with a signed sub-scale per 16 columns (GGUF Q6_K's
    form), random over the whole int8 range, the block scales shrunk to keep the values' size."""
    if fmt != "int8+sub":
        return quantize(weight, fmt)
    plain = quantize(weight, "int8")
    rows, blocks = plain.scale.shape
    sub = torch.randint(-128, 128, (rows, 2 * blocks), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(weight.numel()))
    return QuantizedWeight("int8", plain.cols, plain.data, (plain.scale.float() / 64).half(),
                           (plain.offset.float() / 64).half(), sub)


@pytest.mark.parametrize("qtype", list(EXACT_GGUF_FORMATS))
def test_gguf_blocks_convert_exactly(qtype):
    rows, cols = 24, 512  # 512 columns: two Q4_K super-blocks per row
    raw = gguf_blocks(qtype, rows, cols)
    packed = from_gguf(qtype, raw, cols)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert packed.format == EXACT_GGUF_FORMATS[qtype]
    assert torch.equal(packed.dequantize(), expected)
    # GGUF's own scales are half precision and stay so; the K-quants' products of two scales need float32
    assert packed.scale.dtype == (torch.float32 if qtype in (T.Q4_K, T.Q5_K) else torch.float16)
    # Q6_K's 16-weight scales stay as sub-scales, one per 16 columns
    assert (packed.sub_scale is not None) == (qtype == T.Q6_K)


def test_q6_k_columns_and_mixed_fusions_keep_values_exactly():
    """Tensor-parallel input shards of a Q6_K weight, and fusing it with Q4_K (int4, taken to int8
    exactly) and Q8_0 rows (no sub-scales: ones), all dequantise to the GGUF values."""
    q6 = from_gguf(T.Q6_K, gguf_blocks(T.Q6_K, 8, 512), 512)
    full = q6.dequantize()
    for start, length in ((0, 32), (224, 64), (256, 256)):
        assert torch.equal(q6.narrow(1, start, length).dequantize(), full[:, start:start + length])
    q4 = from_gguf(T.Q4_K, gguf_blocks(T.Q4_K, 4, 512, seed=1), 512)
    q8 = from_gguf(T.Q8_0, gguf_blocks(T.Q8_0, 4, 512, seed=2), 512)
    fused = cat_rows([q4.to_format("int8"), q6, q8])
    assert fused.format == "int8" and fused.sub_scale is not None and fused.scale.dtype == torch.float32
    assert torch.equal(fused.dequantize(), torch.cat([q4.dequantize(), full, q8.dequantize()]))


def test_padded_width_and_row_operations_keep_values():
    weight = torch.randn(10, 96)  # 96 columns: padded to 128 inside
    packed = quantize(weight, "int4")
    full = packed.dequantize()
    assert full.shape == (10, 96)
    assert torch.equal(packed.narrow(0, 3, 4).dequantize(), full[3:7])
    assert torch.equal(cat_rows([packed.narrow(0, 5, 5), packed.narrow(0, 0, 5)]).dequantize(),
                       torch.cat([full[5:], full[:5]]))
    permuted = undo_llama_rope_permute(packed, num_heads=5)
    assert torch.equal(permuted.dequantize(), undo_llama_rope_permute(full, num_heads=5))
    for fmt in ("int4", "int8"):  # tensor-parallel input shards: whole 32-column blocks, values kept exactly
        weight_fmt = quantize(weight, fmt)
        for start, length in ((0, 32), (32, 64), (64, 32)):
            assert torch.equal(weight_fmt.narrow(1, start, length).dequantize(),
                               weight_fmt.dequantize()[:, start:start + length])
    with pytest.raises(ValueError, match="multiples of 32 columns"):
        packed.narrow(1, 16, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "int8")


@pytest.mark.parametrize("fmt, bound", [("int8", 0.5 / 127), ("int4", 0.5 / 15)])
def test_load_time_quantisation_error_is_half_a_step(fmt, bound):
    weight = torch.randn(64, 256)
    error = (quantize(weight, fmt).dequantize() - weight).abs().view(64, -1, 32)
    block_range = weight.view(64, -1, 32)
    span = block_range.abs().amax(-1) if fmt == "int8" else block_range.amax(-1) - block_range.amin(-1)
    # half a quantisation step, plus the float16 rounding of the block's scale and offset
    assert (error.amax(-1) <= span * bound * 1.01 + 1e-3 * span).all()


def test_native_activation_quantisation_equals_the_reference(kernels):
    x = torch.randn(7, 96) * torch.logspace(-3, 2, 96)
    x[2] = 0  # an all-zero row has scale 0
    q, dx = kernels.quantize_activations(x)
    q_ref, dx_ref = quantize_activations(x)
    assert torch.equal(q.float(), q_ref) and torch.equal(dx, dx_ref)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int8+sub"])
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, DEQUANTIZE_FROM_ROWS, 767, 768, 2049])
@pytest.mark.parametrize("cols", [96, 576])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_native_product_equals_the_reference_in_float32(kernels, fmt, rows, cols, batch_invariant):
    torch.manual_seed(rows * cols)
    packed = packed_weight(torch.randn(45, cols) * 0.1, fmt)  # 45 outputs: a partial tile of 4
    bias = torch.randn(45)
    x = torch.randn(rows, cols)
    op = kernels.qlinear_op(packed, bias, batch_invariant)
    assert (op.int8_below(x.dtype) > rows) == (batch_invariant or rows < DEQUANTIZE_FROM_ROWS)
    got = op(x)
    expected = reference_linear(x, packed, bias, int8_below=op.int8_below(x.dtype))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K, "Q4_K+Q6_K"])
def test_native_product_with_gguf_weights_in_bfloat16(kernels, qtype):
    if qtype == "Q4_K+Q6_K":  # a fused projection of both: float32 scales with sub-scales
        packed = cat_rows([from_gguf(T.Q4_K, gguf_blocks(T.Q4_K, 24, 512, seed=4), 512).to_format("int8"),
                           from_gguf(T.Q6_K, gguf_blocks(T.Q6_K, 16, 512, seed=3), 512)])
    else:
        packed = from_gguf(qtype, gguf_blocks(qtype, 40, 512, seed=3), 512)
    for rows in (2, DEQUANTIZE_FROM_ROWS + 3):
        x = torch.randn(rows, 512).bfloat16()
        op = kernels.qlinear_op(packed, None)
        got = op(x).float()
        expected = reference_linear(x, packed, None, int8_below=op.int8_below(x.dtype)).float()
        # the outputs are rounded to bfloat16: they agree to its last bit, after different summation orders
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_do_not_depend_on_the_rest_of_the_batch(kernels, dtype):
    packed = quantize(torch.randn(64, 256), "int4")
    op = kernels.qlinear_op(packed, None)  # batch-invariant: the int8 products at every row count
    batch = torch.randn(2 * DEQUANTIZE_FROM_ROWS + 5, 256).to(dtype)
    together = op(batch)
    alone = torch.cat([op(batch[i:i + 1]) for i in range(batch.shape[0])])
    assert torch.equal(together, alone)


def test_native_product_checks_its_input(kernels):
    op = kernels.qlinear_op(quantize(torch.randn(8, 64), "int8"), None)
    with pytest.raises(ValueError, match="features"):
        op(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        op(torch.randn(2, 64).half())


@pytest.mark.parametrize("fmt", ["int8", "int4", "int8+sub"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_lookups_equal_the_packed_table(kernels, fmt, dtype):
    packed = packed_weight(torch.randn(45, 96), fmt)  # 45 rows: a partial group of 16 in the cell layout
    op = kernels.qlinear_op(packed, None)
    ids = torch.tensor([44, 0, 17, 3, 3, 31])
    assert torch.equal(op.embedding(ids, dtype), packed.embedding(ids, dtype))
    assert torch.equal(op.dequantize(5, 40, dtype), packed.dequantize(dtype)[5:45])
    with pytest.raises(ValueError, match="outside"):
        op.embedding(torch.tensor([2, 45]), dtype)
    assert torch.equal(op.embedding(ids, torch.float16), packed.embedding(ids, torch.float32).half())
    with pytest.raises(ValueError, match="not within"):
        op.dequantize(40, 6, dtype)


def forced_int8(monkeypatch) -> int:
    """Make every row count take the int8 dot products (no dequantising, no AMX tiles); the bound to
    hand `reference_linear`."""
    monkeypatch.setattr(quantized, "DEQUANTIZE_FROM_ROWS", ALWAYS_INT8)
    monkeypatch.setattr(quantized, "AMX_FROM_ROWS", ALWAYS_INT8)
    return ALWAYS_INT8


@pytest.mark.parametrize("fmt", ["int8", "int4", "int8+sub"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_products_at_every_row_count_equal_the_reference(kernels, monkeypatch, fmt, dtype):
    below = forced_int8(monkeypatch)
    torch.manual_seed(5)
    packed = packed_weight(torch.randn(45, 576) * 0.1, fmt)
    bias = torch.randn(45)
    op = kernels.qlinear_op(packed, bias)
    for rows in (1, 15, 16, 17, 767, 2049):
        x = torch.randn(rows, 576).to(dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(op(x).float(), reference_linear(x, packed, bias, int8_below=below).float(),
                                   rtol=tolerance, atol=10 * tolerance)


# bfloat16 inputs only with every row count forced onto the int8 products: left to the thresholds they
# dequantise at 40 rows on levels with native bfloat16 and stay int8 below them (int8_rows_below)
@pytest.mark.parametrize("dtype, force_int8", [(torch.float32, False), (torch.float32, True),
                                               (torch.bfloat16, True)])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int8+sub"])
def test_quantised_products_give_the_same_numbers_at_every_level(kernels_of_every_level, monkeypatch, fmt, dtype,
                                                                 force_int8):
    """The integer dot products are exact and the float steps are the same operations on every level, so
    the portable C, AVX2 and AVX512-VNNI paths (and, under `make test-arm`, the aarch64 build) agree to the bit
    (the AMX tiles are left out)."""
    if len(kernels_of_every_level) < 2:
        pytest.skip("this CPU runs only one instruction-set level")
    if force_int8:
        forced_int8(monkeypatch)
    torch.manual_seed(6)
    packed = packed_weight(torch.randn(45, 576) * 0.1, fmt)
    bias = torch.randn(45)
    x = torch.randn(40, 576).to(dtype)
    results = {name: k.qlinear_op(packed, bias)(x) for name, k in kernels_of_every_level.items()}
    first_name, first = next(iter(results.items()))
    for name, result in results.items():
        assert torch.equal(result, first), f"{name} differs from {first_name}"


@pytest.mark.parametrize("fmt", ["int8", "int4", "int8+sub"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_int8_tiles_give_the_vector_products_bits(amx_kernels, fmt, dtype):
    """From 16 rows the amx level's int8 product takes its integer dots on AMX-INT8 tiles (where the CPU
    has them): every row count gives the AVX512-VNNI level's bits, bias or none."""
    vnni = load_kernels(level_named("avx512_vnni"))
    torch.manual_seed(7)
    # (outputs, features, row counts): 1,000 outputs of 576 features span several panels of expanded
    # tiles per thread; 32 and 160 features leave fewer than four blocks in the last step; 300 rows
    # span several row chunks
    for outputs, features, row_counts in ((45, 576, (15, 16, 17, 33, 100)), (1000, 576, (16, 300)),
                                          (45, 32, (17,)), (45, 160, (40,))):
        packed = packed_weight(torch.randn(outputs, features) * 0.1, fmt)
        for bias in (torch.randn(outputs), None):
            tiles, vectors = amx_kernels.qlinear_op(packed, bias), vnni.qlinear_op(packed, bias)
            for rows in row_counts:
                x = torch.randn(rows, features).to(dtype)
                assert torch.equal(tiles(x), vectors(x)), (outputs, features, rows, bias is None)
