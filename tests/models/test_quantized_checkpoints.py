"""GPTQ and AWQ checkpoints, written from known integer weights exactly as the formats' reference packers
(AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear) lay them out: loaded with
`--quantization none --dtype float32`, the engine's greedy ids and logprobs equal HF transformers float32
on the same weights as floats; schemes it cannot read are refused at load, by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_greedy_matches_hf
from helpers.packed_checkpoints import assert_layers_loaded_as, write_pair
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


@pytest.mark.parametrize("method, bits, act_order", [("gptq", 4, False), ("gptq", 4, True), ("gptq", 8, False),
                                                     ("awq", 4, False)])
def test_a_packed_checkpoint_runs_as_hf_on_its_float_weights(base, tmp_path, method, bits, act_order):
    packed, floats = write_pair(base, tmp_path, method, bits, act_order=act_order)
    hf = AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()
    llm = LLM(str(packed), quantization="none", dtype="float32", num_kv_blocks=256)
    assert_greedy_matches_hf(llm, hf)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits 3: only 4- and 8-bit GPTQ"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "only 4-bit AWQ in the GEMM layout"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq' is not supported"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 96]}, "weight_block_size \\[128, 96\\] is not supported"),
])
def test_a_scheme_it_cannot_read_is_refused_by_name(base, tmp_path, config, message):
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


@pytest.mark.parametrize("method, bits, group_size, act_order, kept", [
    ("gptq", 4, 32, False, "int4"), ("gptq", 8, 64, False, "int8"), ("awq", 4, 64, False, "int4"),
    ("gptq", 4, 32, True, "int4"),  # activation order: kept packed with the inputs sorted by group
    ("gptq", 4, 16, False, None),  # groups of 16 inputs: no 32-input run has one scale
])
def test_layers_stay_packed_where_the_format_maps_exactly(base, tmp_path, method, bits, group_size, act_order,
                                                          kept):
    """By default each packed layer becomes the native products' layout (int4 for 4 bits, int8 for 8) and
    dequantises to exactly the float weights; layers whose groups do not map come as those floats."""
    packed, floats = write_pair(base, tmp_path, method, bits, group_size, act_order)
    assert_layers_loaded_as(packed, floats, kept)


@pytest.mark.parametrize("method, bits", [("gptq", 4), ("gptq", 8), ("awq", 4)])
def test_served_packed_its_products_follow_the_float_weights(base, tmp_path, method, bits):
    """Served packed (the default), the products take int8 activations against the checkpoint's own
    integers: perplexity within 3% of the same weights served as floats, and the logprobs close."""
    from helpers.engine_probe import EIGHT_PROMPTS, perplexity

    packed, floats = write_pair(base, tmp_path, method, bits, group_size=64)
    served = LLM(str(packed), dtype="float32", num_kv_blocks=256)
    reference = LLM(str(floats), quantization="none", dtype="float32", num_kv_blocks=256)
    text = [token for prompt in EIGHT_PROMPTS for token in prompt]
    ratio = perplexity(served, text) / perplexity(reference, text)
    assert abs(ratio - 1) <= 0.03, ratio


LAYER = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update({f"{LAYER}.qweight": s[f"{LAYER}.qweight"].float()}),
     f"model.safetensors: {LAYER}.qweight is torch.float32 \\[8, 64\\]; the gptq format stores int32"),
    (lambda s: s.update({f"{LAYER}.scales": s[f"{LAYER}.scales"][:1]}),
     f"model.safetensors: {LAYER}: the gptq tensors do not agree: qweight unpacks to \\[64, 64\\]"),
    (lambda s: s.update({f"{LAYER}.qweight": s[f"{LAYER}.qweight"][:4]}),
     f"model.safetensors: {LAYER}: the gptq tensors do not agree: qweight unpacks to \\[32, 64\\]"),
])
def test_tensors_that_contradict_the_format_are_refused_naming_file_and_tensor(base, tmp_path, change, message):
    packed, _ = write_pair(base, tmp_path, "gptq", 4)
    state = load_file(str(packed / "model.safetensors"))
    change(state)
    save_file(state, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(str(packed), num_kv_blocks=64)


def test_a_truncated_file_is_refused_naming_it(base, tmp_path):
    packed, _ = write_pair(base, tmp_path, "awq", 4)
    path = packed / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match=f"{path} is not a readable safetensors file .*download it again"):
        LLM(str(packed), num_kv_blocks=64)


def test_vllms_quantization_names_serve_a_checkpoint_of_that_method_and_refuse_another(base, tmp_path):
    """A vLLM command line names the checkpoint's method (`--quantization gptq_marlin` picks vLLM's Marlin
    kernel): the same packed weights as auto serve it; a name of another method, or of a packed method for
    float weights, is refused before anything loads."""
    packed, _ = write_pair(base, tmp_path, "gptq", 4, group_size=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 5, 9, 13]}]
    auto = LLM(str(packed), dtype="float32", num_kv_blocks=64).generate(prompt, greedy, use_tqdm=False)
    marlin = LLM(str(packed), dtype="float32", num_kv_blocks=64, quantization="gptq_marlin")
    assert marlin.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == auto[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="--quantization awq expects a awq checkpoint, but .* has quantization "
                                         "method 'gptq'"):
        LLM(str(packed), quantization="awq", num_kv_blocks=64)
    with pytest.raises(ValueError, match="--quantization gptq expects a gptq checkpoint, but .* has float "
                                         r"\(unquantised\) weights"):
        LLM(str(base), quantization="gptq", num_kv_blocks=64)
