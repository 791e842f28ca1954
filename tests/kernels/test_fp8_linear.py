"""FP8 (e4m3) weights, W8A8: the Triton kernels (in the interpreter) and the CPU paths equal the float32
reference that quantises activations the same way (kernels/w8a8.reference_linear), for per-channel,
per-tensor and 128-column block scales; the weight-only product equals the dequantised weight; rows come
out the same at any row count where batch invariance is asked. At model level, `--quantization fp8` and a
`quant_method: fp8` block-128 checkpoint generate HF float32's greedy ids on the weights they dequantise to,
with HF's projections fed the same per-token (per-group) quantised activations, on the CPU path and on the
Triton products (compressed-tensors FP8 checkpoints: tests/models/test_compressed_tensors.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.engine_probe import EIGHT_PROMPTS, assert_greedy_matches_hf
from helpers.packed_checkpoints import LINEARS, assert_layers_loaded_as, hf_with_quantised_inputs, write_fp8_checkpoint
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM
from tokenmill.kernels import w8a8
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.layers import triton_w8a8
from tokenmill.layers.w8a8_linear import W8A8Kernel, cpu_scaled_mm

K, N = 192, 96  # a whole and a partial 128-column block; 96 rows: a partial 64-row tile and 128-row block


def _weights():
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.05
    per_tensor = w8a8.from_checkpoint(torch.randn(N, K).to(torch.float8_e4m3fn), torch.tensor(0.003))
    blocks = w8a8.from_checkpoint(torch.randn(N, K).to(torch.float8_e4m3fn), torch.rand(1, 2) * 0.01 + 0.001, (128, 128))
    return {"channel": w8a8.quantize_fp8(w), "tensor": per_tensor, "block": blocks}


WEIGHTS = _weights()
BIAS = torch.randn(N)


def _inputs(m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    torch.manual_seed(m)
    x = torch.randn(m, K)
    x[:, :8] *= 30  # outliers: the per-token scale is set by a few large values, as in real activations
    return x.to(dtype)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to summation order: float32 rounding, or one rounding of a 16-bit output."""
    tolerance = 1e-5 if y.dtype == torch.float32 else 1e-2
    assert y.dtype == ref.dtype
    assert torch.allclose(y.float(), ref.float(), rtol=tolerance, atol=tolerance * ref.abs().max().item())


def test_activation_quantiser_is_torchs_e4m3_bit_for_bit():
    """The Triton quantiser's integer e4m3 encoding rounds as torch's float8 cast: ties to even, carries
    into the next binade, subnormals, zero rows; per token and per 64 columns."""
    torch.manual_seed(1)
    x = torch.randn(4, K) * torch.tensor([1e-4, 1.0, 300.0, 0.0]).unsqueeze(1)
    x[1, :6] = torch.tensor([448 / 1.0625 * 3, 3.0, 2.9, -0.03, 1e-6, 5e-7])  # the row's scale is 3: ties, tiny
    for group in (None, 64):
        q, scales = triton_w8a8.quantize_activations(x, group)
        q_ref, scales_ref = w8a8.quantize_activations(x, group)
        assert torch.equal(scales, scales_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("scales", ["channel", "tensor", "block"])
@pytest.mark.parametrize("m", [1, 17])
def test_w8a8_product_equals_the_float32_reference(scales, m):
    weight = WEIGHTS[scales]
    x = _inputs(m)
    q, x_scales = triton_w8a8.quantize_activations(x, weight.activation_group)
    _close(triton_w8a8.w8a8_product(q, x_scales, weight, BIAS, torch.float32, batch_invariant=False),
           w8a8.reference_linear(x, weight, BIAS))


@pytest.mark.parametrize("scales", ["channel", "block"])
def test_w8a8_product_in_bfloat16(scales):
    x = _inputs(16, torch.bfloat16)
    weight = WEIGHTS[scales]
    q, x_scales = triton_w8a8.quantize_activations(x, weight.activation_group)
    _close(triton_w8a8.w8a8_product(q, x_scales, weight, BIAS, torch.bfloat16, batch_invariant=False),
           w8a8.reference_linear(x, weight, BIAS))


@pytest.mark.parametrize("scales, dtype", [("channel", torch.float32), ("block", torch.float32),
                                           ("channel", torch.bfloat16)])
def test_weight_only_product_equals_the_dequantised_weight(scales, dtype):
    """e4m3 decoded in registers (as float16 fields, x 256) times unquantised activations."""
    weight, x = WEIGHTS[scales], _inputs(17, dtype)
    _close(triton_w8a8.weight_only_product(x, weight, BIAS, batch_invariant=False),
           w8a8.reference_linear(x, weight, BIAS, quantize_inputs=False))


class _OnDevice:
    """The product kernels' flag that their products run on the weight's device (TritonProducts)."""

    on_device = True


@pytest.mark.parametrize("scales", ["channel", "block"])
def test_batch_invariant_rows_do_not_depend_on_the_row_count(scales):
    """With batch invariance the Triton path keeps one tiling for every row count (never `_scaled_mm`):
    a row alone and the same row among 17 come out bit for bit the same."""
    kernel = W8A8Kernel(WEIGHTS[scales], BIAS, _OnDevice(), batch_invariant=True)
    assert not kernel.scaled_mm and kernel.path == "Triton W8A8"
    x = _inputs(17)
    y = kernel(x)
    assert torch.equal(y[5:6], kernel(x[5:6]))
    _close(y, w8a8.reference_linear(x, WEIGHTS[scales], BIAS))


@pytest.mark.skipif(not cpu_scaled_mm(), reason="this PyTorch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("native", [None, _OnDevice()], ids=["cpu", "triton-quantiser"])
def test_scaled_mm_path_equals_the_float32_reference(native):
    """Per-channel weights without batch invariance: row-wise scaled `torch._scaled_mm`, activations
    quantised by torch (CPU path) or by the Triton quantiser (device path)."""
    kernel = W8A8Kernel(WEIGHTS["channel"], BIAS, native, batch_invariant=False)
    assert kernel.scaled_mm
    x = _inputs(17)
    _close(kernel(x), w8a8.reference_linear(x, WEIGHTS["channel"], BIAS))


def test_cpu_path_is_batch_invariant_on_the_native_product():
    native = cpu_kernels()
    if native is None:
        pytest.skip("the native CPU kernels are not built here (no C compiler)")
    kernel = W8A8Kernel(WEIGHTS["block"], BIAS, native, batch_invariant=True)
    x = _inputs(17)
    y = kernel(x)
    assert torch.equal(y[7:8], kernel(x[7:8]))
    _close(y, w8a8.reference_linear(x, WEIGHTS["block"], BIAS))


def test_rows_narrow_and_fuse_and_columns_split_only_at_blocks():
    block = WEIGHTS["block"]
    fused = w8a8.cat_rows([block.narrow(0, 0, 40), block.narrow(0, 40, 56)])
    assert torch.equal(fused.dequantize(), block.dequantize())
    assert torch.equal(block.narrow(1, 128, 64).dequantize(), block.dequantize()[:, 128:])
    assert torch.equal(WEIGHTS["channel"].narrow(1, 96, 64).dequantize(), WEIGHTS["channel"].dequantize()[:, 96:160])
    with pytest.raises(ValueError, match="splits by input features only at multiples of 128"):
        block.narrow(1, 64, 128)
    with pytest.raises(ValueError, match="per 128 columns and per channel cannot be fused"):
        w8a8.cat_rows([block, WEIGHTS["channel"]])


# model level: a tiny Llama whose block-128 scales have partial blocks (192 = 128 + 64 columns)
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama", hidden_size=192,
                              intermediate_size=384)


# a value at an e4m3 rounding midpoint may round apart in HF's and the engine's summation orders (which differ by
# instruction set), moving a logprob by ~1e-4 to 2.2e-3 (an AVX2 machine, one prompt of ten; the others within
# 1e-6); without activation quantisation the default 1e-4 holds
QUANTISED_TOLERANCE = 5e-3
PROMPTS = EIGHT_PROMPTS[:3]
SHORT_PROMPTS = [EIGHT_PROMPTS[0], EIGHT_PROMPTS[3]]  # 4 and 2 tokens, for the interpreted runs


def test_quantization_fp8_runs_as_hf_on_the_dequantised_weights(base, tmp_path):
    """`--quantization fp8` on a float checkpoint: projections per output channel (scale = max |w| / 448),
    the embedding and LM head left in float32; batch-invariant CPU path (native product)."""
    state = load_file(str(base / "model.safetensors"))
    for name, tensor in state.items():
        if name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in LINEARS:
            state[name] = w8a8.quantize_fp8(tensor).dequantize()
    floats = tmp_path / "floats"
    floats.mkdir()
    for item in base.iterdir():
        if item.name != "model.safetensors":
            (floats / item.name).write_bytes(item.read_bytes())
    save_file(state, str(floats / "model.safetensors"))
    llm = LLM(str(base), dtype="float32", quantization="fp8", num_kv_blocks=64)
    assert llm.llm_engine.model.describe_weights() == "fp8 projections"
    assert_greedy_matches_hf(llm, hf_with_quantised_inputs(floats, None), prompts=PROMPTS, count=8,
                             logprob_tolerance=QUANTISED_TOLERANCE)


def test_quant_method_fp8_block_checkpoint_on_the_cpu_path(base, tmp_path):
    """DeepSeek's / Qwen3-FP8's layout (`weight_scale_inv` per 128 x 128 block; here 192 = 128 + 64 columns)
    kept as FP8 with its own values; activations quantised per token and 128 columns."""
    floats = write_fp8_checkpoint(base, tmp_path / "model")
    assert_layers_loaded_as(tmp_path / "model", floats, "fp8")
    llm = LLM(str(tmp_path / "model"), dtype="float32", num_kv_blocks=64)
    assert_greedy_matches_hf(llm, hf_with_quantised_inputs(floats, 128), prompts=PROMPTS, count=8,
                             logprob_tolerance=QUANTISED_TOLERANCE)


@pytest.fixture(scope="module")
def interpreted_checkpoint(tmp_path_factory):
    """A one-layer model of one 128-column block per row, as `quant_method: fp8`: every projection of every
    step runs in Triton's interpreter (~1 ms an operation), so the model is as small as the blocks allow."""
    root = tmp_path_factory.mktemp("interpreted")
    base = make_tiny_hf_model(root / "base", arch="llama", hidden_size=128, intermediate_size=128,
                              num_hidden_layers=1)
    return root / "model", write_fp8_checkpoint(base, root / "model")


def test_quant_method_fp8_on_the_triton_w8a8_product(interpreted_checkpoint):
    """`--linear-kernel triton`: the block-scaled Triton W8A8 kernel behind every projection."""
    folder, floats = interpreted_checkpoint
    llm = LLM(str(folder), dtype="float32", linear_kernel="triton", batch_invariant=False, num_kv_blocks=64)
    paths = {m.kernel.path for m in llm.llm_engine.model.modules() if isinstance(getattr(m, "kernel", None), W8A8Kernel)}
    assert paths == {"Triton W8A8"}
    assert_greedy_matches_hf(llm, hf_with_quantised_inputs(floats, 128), prompts=SHORT_PROMPTS, count=4,
                             logprob_tolerance=QUANTISED_TOLERANCE)


def test_weight_only_fp8_runs_as_hf_on_the_dequantised_weights(interpreted_checkpoint, monkeypatch):
    """TOKENMILL_FP8_WEIGHT_ONLY=1 (the path below sm89): the Triton weight-only product, activations not
    quantised, so HF float32 on the dequantised weights to the default tolerance."""
    folder, floats = interpreted_checkpoint
    monkeypatch.setenv("TOKENMILL_FP8_WEIGHT_ONLY", "1")
    llm = LLM(str(folder), dtype="float32", linear_kernel="triton", batch_invariant=False, num_kv_blocks=64)
    paths = {m.kernel.path for m in llm.llm_engine.model.modules() if isinstance(getattr(m, "kernel", None), W8A8Kernel)}
    assert paths == {"Triton weight-only"}
    hf = AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()
    assert_greedy_matches_hf(llm, hf, prompts=SHORT_PROMPTS, count=4)
