"""int8 W8A8 weights (compressed-tensors int-quantized, llm-compressor's W8A8): the Triton kernels (in the
interpreter) quantise activations to int8 per token bit for bit as the torch reference does, multiply them
with exact int32 sums whose scaled values equal a float64 reference of the integer products to float32
rounding, give `torch._int_mm`'s path the same values, and give every row the same bits at any row count
under batch invariance. At model level a W8A8 checkpoint written by compressed-tensors itself runs on the
Triton int8 products as HF float32 on the weights it decompresses to, with HF's projections fed the same
per-token int8 activations; on the CPU's native products it still loads as packed int8 weights."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_probe import EIGHT_PROMPTS, assert_greedy_matches_hf
from helpers.packed_checkpoints import hf_with_quantised_inputs, write_compressed
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM
from tokenmill.kernels import w8a8
from tokenmill.kernels.w8a8 import INT8
from tokenmill.layers import triton_w8a8
from tokenmill.layers.triton_products import TritonProducts
from tokenmill.layers.w8a8_linear import W8A8Kernel

K, N = 192, 96  # a whole and a partial 128-column K step; 96 rows: a partial 64-row tile


def _weight() -> w8a8.W8A8Weight:
    torch.manual_seed(0)
    values = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    scales = (torch.rand(N, 1) * 0.002 + 0.001).bfloat16()  # llm-compressor saves the model's bf16 scales
    return w8a8.from_checkpoint(values, scales)


WEIGHT = _weight()
BIAS = torch.randn(N)


def _inputs(m: int) -> torch.Tensor:
    torch.manual_seed(m)
    x = torch.randn(m, K)
    x[:, :8] *= 30  # outliers: the per-token scale is set by a few large values, as in real activations
    return x


def _integer_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The product in float64 from the reference quantiser's integers and scales, rounded once to float32."""
    q, scales = w8a8.quantize_activations(x, None, INT8)
    sums = q.double() @ WEIGHT.data.double().t()
    return (sums * WEIGHT.scale.double().t() * scales.double() + bias.double()).float()


def test_activation_quantiser_is_the_torch_reference_bit_for_bit():
    """Per token scale = max |x| / 127 and q = round(x / scale), halves to even, on rows of very different
    sizes, a zero row, and exact halves."""
    torch.manual_seed(1)
    x = torch.randn(4, K) * torch.tensor([1e-4, 1.0, 300.0, 0.0]).unsqueeze(1)
    x[1, :7] = torch.tensor([127.0, 2.5, 3.5, -0.5, -126.5, 0.49999997, 1.5])  # the row's scale is 1: halves
    q, scales = triton_w8a8.quantize_activations(x, None, INT8)
    q_ref, scales_ref = w8a8.quantize_activations(x, None, INT8)
    assert q.dtype == torch.int8
    assert torch.equal(scales, scales_ref) and torch.equal(q, q_ref)
    assert q[1, :7].tolist() == [127, 2, 4, 0, -126, 0, 2]
    assert not q[3].any()


@pytest.mark.parametrize("m", [1, 17])
def test_triton_int8_product_equals_the_integer_reference(m):
    """int32 sums are exact: the result is the float64 reference to float32 rounding (two products and a
    sum rounded, ~3 ulp), and the dequantised float32 product (`reference_linear`) to summation order."""
    x = _inputs(m)
    q, scales = triton_w8a8.quantize_activations(x, None, INT8)
    y = triton_w8a8.w8a8_product(q, scales, WEIGHT, BIAS, torch.float32, batch_invariant=False)
    assert torch.allclose(y, _integer_reference(x, BIAS), rtol=1e-6, atol=1e-6)
    assert torch.allclose(y, w8a8.reference_linear(x, WEIGHT, BIAS), rtol=1e-5, atol=1e-4)


def test_int_mm_path_gives_the_triton_products_values():
    """`torch._int_mm` (here PyTorch's CPU int8 GEMM) and the Triton scaling kernel: the same exact sums,
    scaled alike, so bit for bit the Triton product's output, in float32 and bfloat16."""
    x = _inputs(33)
    q, scales = triton_w8a8.quantize_activations(x, None, INT8)
    assert triton_w8a8.int_mm_takes(33, WEIGHT) and not triton_w8a8.int_mm_takes(16, WEIGHT)
    for dtype in (torch.float32, torch.bfloat16):
        expected = triton_w8a8.w8a8_product(q, scales, WEIGHT, BIAS, dtype, batch_invariant=False)
        assert torch.equal(triton_w8a8.int_mm_product(q, scales, WEIGHT, BIAS, dtype), expected)


def test_batch_invariant_rows_do_not_depend_on_the_row_count():
    """Through the layer's kernel on Triton's products with batch invariance: each row of a 33-row product
    is bit for bit the row multiplied alone or among 16."""
    kernel = W8A8Kernel(WEIGHT, BIAS, TritonProducts(), batch_invariant=True)
    assert kernel.path == "Triton int8 W8A8"
    x = _inputs(33)
    full = kernel(x)
    assert torch.equal(kernel(x[:1]), full[:1])
    assert torch.equal(kernel(x[16:32]), full[16:32])


def test_weights_refuse_what_has_no_int8_w8a8_product():
    """Non-zero zero points and block scales are refused by name; an all-zero zero point changes nothing;
    int8 and FP8 parts do not fuse; the packed int8 form dequantises to the same weight."""
    values, scale = WEIGHT.data, WEIGHT.scale
    with pytest.raises(ValueError, match="zero points are not all zero"):
        w8a8.from_checkpoint(values, scale, zero_point=torch.ones(N, 1, dtype=torch.int8))
    with pytest.raises(ValueError, match="not per 1 x 64 block"):
        w8a8.from_checkpoint(values, torch.ones(N, 3), (1, 64))
    zeroed = w8a8.from_checkpoint(values, scale, zero_point=torch.zeros(N, 1, dtype=torch.int8))
    assert torch.equal(zeroed.dequantize(), WEIGHT.dequantize())
    with pytest.raises(ValueError, match="fp8 and int8_w8a8 values cannot be fused"):
        w8a8.cat_rows([WEIGHT, w8a8.quantize_fp8(WEIGHT.dequantize())])
    assert torch.equal(WEIGHT.to_packed_int8().dequantize(), WEIGHT.dequantize())


# model level: a one-layer model as small as the Triton kernels' tiles allow, every projection of every step
# run in the interpreter (~1 ms an operation), hence two short prompts and four tokens
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8_w8a8")
    base = make_tiny_hf_model(root / "base", arch="llama", hidden_size=128, intermediate_size=128,
                              num_hidden_layers=1)
    return root / "model", write_compressed(base, root / "model", "W8A8")


def test_w8a8_checkpoint_runs_on_the_triton_int8_product_as_hf(checkpoint):
    folder, floats = checkpoint
    llm = LLM(str(folder), dtype="float32", linear_kernel="triton", attention_backend="torch_ref",
              batch_invariant=False, num_kv_blocks=64)
    model = llm.llm_engine.model
    paths = {m.kernel.path for m in model.modules() if isinstance(getattr(m, "kernel", None), W8A8Kernel)}
    assert paths == {"Triton int8 W8A8"}  # the CPU tensors' path: torch._int_mm is taken on CUDA only
    assert model.describe_weights() == "int8_w8a8 projections"
    # an activation at an int8 rounding midpoint may round apart in HF's and the engine's summation orders
    assert_greedy_matches_hf(llm, hf_with_quantised_inputs(floats, None, INT8),
                             prompts=[EIGHT_PROMPTS[0], EIGHT_PROMPTS[3]], count=4, logprob_tolerance=2e-3)


def test_w8a8_checkpoint_on_the_native_cpu_products_stays_packed_int8(checkpoint):
    """No Triton products: the layers run on the native int8-activation products as before."""
    folder, _ = checkpoint
    model = LLM(str(folder), dtype="float32", num_kv_blocks=64).llm_engine.model
    assert {m.quantized_format for m in model.modules() if hasattr(m, "quantize_to")} == {"int8"}
