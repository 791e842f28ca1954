"""Llama 4's text model (issue 60): a tiny random Llama4ForCausalLM (helpers/tiny_models.py: a RoPE layer with chunked
local attention of 8 positions and a dense MLP, a NoPE layer with full attention, the query temperature and
experts) gives HF float32's greedy ids and logprobs in every mode the engine schedules a request in
(helpers/family_check.py), a request's output in the default dtype does not depend on what shares its batch, the
text model of a Llama4ForConditionalGeneration checkpoint loads (its vision tower skipped, said in the log) and
gives the same ids, images sent to it are refused, and the settings tokenmill does not run are refused by name.

Cost: about 4 s for `check_family` (two engine runs of eight prompts x 32 tokens, crossing four chunks), 1 s for
the batch-invariance run, 1 s for the multimodal checkpoint's engine; the checkpoint and HF model are built once."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.engine_probe import EIGHT_PROMPTS, hf_greedy_tokens
from helpers.family_check import check_alone_equals_batched, check_family
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.models.arch import MoEConfig, kv_cache_layout
from tokenmill.models.loader.hf_config import arch_config_from_hf


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """The tiny Llama4ForCausalLM checkpoint and its HF float32 model."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("llama4"), arch="llama4_text")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_llama4_equals_hf(llama4):
    check_family(*llama4)


@pytest.mark.skipif(cpu_kernels() is None, reason="batch invariance comes from the native kernels' products")
def test_llama4_request_alone_equals_it_in_a_batch_in_the_default_dtype(llama4):
    check_alone_equals_batched(llama4[0])


def multimodal_checkpoint(text_folder, folder):
    """A Llama4ForConditionalGeneration folder as transformers saves one: the text model's tensors under
    `language_model.`, a vision tower's and projector's beside them (random), the text config as text_config."""
    folder.mkdir()
    tensors = {f"language_model.{name}": t for name, t in load_file(text_folder / "model.safetensors").items()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.randn(32, 588)
    tensors["multi_modal_projector.linear_1.weight"] = torch.randn(64, 32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((text_folder / "config.json").read_text())
    text.pop("architectures")
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "dtype": "float32",
              "image_token_index": 200092, "text_config": text,
              "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 32}}
    (folder / "config.json").write_text(json.dumps(config))
    for file in text_folder.iterdir():  # the tokenizer's files and generation_config.json
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, folder / file.name)
    return folder


def test_llama4_multimodal_checkpoint_serves_its_text_model_and_refuses_images(llama4, tmp_path, caplog):
    path, hf = llama4
    folder = multimodal_checkpoint(path, tmp_path / "multimodal")
    with caplog.at_level(logging.INFO, logger="tokenmill.models.loader.hf_config"):
        llm = LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=64)
    assert "serving its text model only (Llama4ForConditionalGeneration); its vision tower" in caplog.text
    prompts = EIGHT_PROMPTS[:2]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy_tokens(hf, ids, 16)
    image = Image.new("RGB", (28, 28))
    with pytest.raises(ValueError, match="text-only: it takes no images"):
        llm.generate([{"prompt_token_ids": prompts[0], "multi_modal_data": {"image": image}}], params, use_tqdm=False)
    llm.shutdown()


def config_with(folder, tmp_path, **changes):
    """A copy of checkpoint `folder`'s config.json (only) with `changes`, read as tokenmill reads it."""
    copy = tmp_path / "model"
    copy.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return arch_config_from_hf(copy)


def test_llama4_config(llama4, tmp_path):
    arch = config_with(llama4[0], tmp_path)
    assert arch.layer_types == ("chunked_attention", "full_attention") and arch.attention_chunk_size == 8
    assert arch.no_rope_layers == frozenset({1}) and arch.qk_l2_norm and arch.nope_query_temperature == (4.0, 0.5)
    assert arch.intermediate_size == 128  # the dense layers' intermediate_size_mlp
    assert arch.moe == MoEConfig(num_experts=4, top_k=1, intermediate_size=32, norm_topk_prob=False,
                                 shared_intermediate_size=32, dense_layers=frozenset({0}), scoring="sigmoid_input")
    assert kv_cache_layout(arch, 4).chunks == [8, None]  # the chunked layer's KV group gives back passed chunks
    # as transformers derives them from an older config.json: every 4th layer NoPE, the others chunked
    derived = config_with(llama4[0], tmp_path, num_hidden_layers=4, no_rope_layers=[], layer_types=None,
                          moe_layers=None, interleave_moe_layer_step=1)
    assert derived.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    assert derived.no_rope_layers == frozenset({3}) and derived.moe.dense_layers == frozenset()
    unchunked = config_with(llama4[0], tmp_path, attention_chunk_size=None, layer_types=None,
                            attn_temperature_tuning=False, use_qk_norm=False)
    assert unchunked.layer_types == ("full_attention",) * 2 and unchunked.attention_chunk_size is None
    assert unchunked.nope_query_temperature is None and not unchunked.qk_l2_norm


@pytest.mark.parametrize("changes, message", [
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"no_rope_layers": [1, 2]}, r"Llama4ForCausalLM with no_rope_layers=\[1, 2\] is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]},
     r"Llama4ForCausalLM with layer_types \['sliding_attention'\] is not supported"),
    ({"attention_chunk_size": 0}, "Llama4ForCausalLM with attention_chunk_size=0 is not supported"),
    ({"floor_scale": 0}, "Llama4ForCausalLM with floor_scale=0 is not supported"),
    ({"moe_layers": None, "interleave_moe_layer_step": 0},
     "Llama4ForCausalLM with interleave_moe_layer_step=0 is not supported"),
    ({"num_experts_per_tok": 5}, "Llama4ForCausalLM with num_experts_per_tok=5 of 4 experts is not supported"),
])
def test_llama4_unsupported_settings_are_refused_by_name(llama4, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        config_with(llama4[0], tmp_path, **changes)


def test_llama4_scout_shaped_multimodal_config(tmp_path):
    # the settings of Llama-4-Scout-17B-16E-Instruct's config.json (transformers 4.51 wrote it: rope_scaling,
    # torch_dtype, attn_temperature_tuning as an int, the EOS ids at the text_config only): read as its text model
    text = {"model_type": "llama4_text", "attention_chunk_size": 8192, "attn_scale": 0.1, "attn_temperature_tuning": 4,
            "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "floor_scale": 8192, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760, "moe_layers": list(range(48)),
            "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)], "num_attention_heads": 40,
            "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16,
            "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "use_qk_norm": True,
            "vocab_size": 202048, "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "torch_dtype": "bfloat16",
              "tie_word_embeddings": False, "text_config": text, "vision_config": {"model_type": "llama4_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = arch_config_from_hf(tmp_path)
    assert arch.architecture == "Llama4ForCausalLM" and arch.vision is None and arch.checkpoint_dtype == "bfloat16"
    assert arch.eos_token_ids == (200001, 200007, 200008) and arch.rope_scaling.kind == "llama3"
    assert arch.layer_types.count("full_attention") == 12 and arch.attention_chunk_size == 8192
    assert arch.no_rope_layers == frozenset(range(3, 48, 4)) and arch.nope_query_temperature == (8192.0, 0.1)
    assert arch.moe.dense_layers == frozenset() and arch.moe.intermediate_size == 8192 and arch.intermediate_size == 16384
