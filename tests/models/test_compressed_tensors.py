"""compressed-tensors checkpoints written by the format's own library (compressed-tensors' ModelCompressor,
what llm-compressor saves through): served dequantised (`--quantization none --dtype float32`) they run
as HF transformers float32 on the weights the library itself decompresses to; served packed (the default)
int layers keep the library's integers on the native int4/int8 products, FP8 layers its e4m3 values on
the FP8 products; schemes the engine cannot read,
and tensors that contradict their scheme, are refused at load by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.engine_probe import EIGHT_PROMPTS, assert_greedy_matches_hf, perplexity
from helpers.packed_checkpoints import assert_layers_loaded_as, write_compressed
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM
from tokenmill.models.loader import load_model_source

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


PRESETS = ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8"]


@pytest.mark.parametrize("preset", PRESETS)
def test_dequantised_it_runs_as_hf_on_the_weights_the_library_decompresses_to(base, tmp_path, preset):
    floats = write_compressed(base, tmp_path / preset, preset)
    hf = AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()
    llm = LLM(str(tmp_path / preset), quantization="none", dtype="float32", num_kv_blocks=256)
    assert_greedy_matches_hf(llm, hf)


@pytest.mark.parametrize("preset, kept", [("W4A16", "int4"), ("W4A16_ASYM", "int4"), ("W8A16", "int8"),
                                          ("W8A8", "int8_w8a8"), ("FP8", "fp8"), ("FP8_BLOCK", "fp8")])
def test_int_layers_stay_packed_and_equal_the_decompressed_weights(base, tmp_path, preset, kept):
    """Packed (the default): int layers as int4/int8 holding the library's integers, FP8 layers (per-tensor
    scales with a static input_scale; 128 x 128 blocks) as FP8 weights holding its e4m3 values, dequantising
    to exactly its decompressed weights, and the served model's perplexity within 3% of the same weights
    served as floats (FP8: W8A8, activations quantised per token; greedy ids are not compared, as the
    model's bfloat16 values put activations on e4m3 rounding midpoints that summation order decides)."""
    floats = write_compressed(base, tmp_path / preset, preset)
    assert_layers_loaded_as(tmp_path / preset, floats, kept)
    served = LLM(str(tmp_path / preset), dtype="float32", num_kv_blocks=256)
    reference = LLM(str(floats), quantization="none", dtype="float32", num_kv_blocks=256)
    text = [token for prompt in EIGHT_PROMPTS for token in prompt]
    assert perplexity(served, text) == pytest.approx(perplexity(reference, text), rel=0.03)


def test_layers_the_config_ignores_stay_floats(base, tmp_path):
    """`ignore` by name and by regex: those layers are saved as floats and load as they are."""
    ignore = ["lm_head", "re:.*mlp\\.down_proj$", "model.layers.0.self_attn.o_proj"]
    floats = write_compressed(base, tmp_path / "model", "W4A16", ignore=ignore)
    kinds = {name: type(weight).__name__ for name, weight in
             load_model_source(str(tmp_path / "model"), with_tokenizer=False).iter_weights(True)}
    assert kinds["model.layers.1.mlp.down_proj.weight"] == kinds["model.layers.0.self_attn.o_proj.weight"] == "Tensor"
    assert kinds["model.layers.1.self_attn.o_proj.weight"] == "QuantizedWeight"
    hf = AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()
    assert_greedy_matches_hf(LLM(str(tmp_path / "model"), quantization="none", dtype="float32",
                                 num_kv_blocks=256), hf, prompts=EIGHT_PROMPTS[:2], count=8)


def _edit(folder, config_change=None, tensor_change=None):
    if config_change is not None:
        config = json.loads((folder / "config.json").read_text())
        config_change(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))
    if tensor_change is not None:
        state = load_file(str(folder / "model.safetensors"))
        tensor_change(state)
        save_file(state, str(folder / "model.safetensors"))


LAYER = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("config_change, tensor_change, message", [
    (lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=2), None, "2-bit int weights"),
    (lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}), None,
     "sparsity_config"),
    (lambda c: c.update(format="nvfp4-pack-quantized") or c["config_groups"]["group_0"].pop("format"), None,
     "format 'nvfp4-pack-quantized' is not supported"),
    (lambda c: c["ignore"].append(LAYER), None, f"layer {LAYER} is in the config's ignore list"),
    (lambda c: c["config_groups"]["group_0"].update(targets=["re:.*mlp.*"]), None,
     "no config group targets layer model.layers.0.self_attn.[qkvo]_proj"),
    (None, lambda s: s.update({f"{LAYER}.weight_shape": torch.tensor([64, 96])}),
     f"layer {LAYER} .*weight_packed is \\[64, 8\\], but weight_shape \\[64, 96\\]"),
    (None, lambda s: s.update({f"{LAYER}.weight_scale": torch.ones(64, 3)}),
     f"layer {LAYER} .*weight_scale is \\[64, 3\\]"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update(group_size=48), None,
     "group_size 48 does not divide the (64|128) input features"),
])
def test_a_scheme_it_cannot_read_or_tensors_that_contradict_it_are_refused(base, tmp_path, config_change,
                                                                         tensor_change, message):
    folder = tmp_path / "model"
    write_compressed(base, folder, "W4A16")
    _edit(folder, config_change, tensor_change)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), num_kv_blocks=64)
