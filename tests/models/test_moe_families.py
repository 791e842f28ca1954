"""Mixture-of-experts families added for issue 60 (Qwen2-MoE, DeepSeek-V3, GLM-4.5): each tiny random checkpoint, read from its own
config.json as transformers reads it, gives HF float32's greedy ids and logprobs in every mode the engine
schedules a request in (helpers/family_check.py), a request's output in the default dtype does not depend on
what shares its batch, and the settings tokenmill does not run are refused by name.

Cost: about 4 s per family for `check_family` (two engine runs of eight prompts x 32 tokens), 1 s for the
batch-invariance run; the checkpoints and HF models are built once per module."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import hf_greedy_tokens_from
from helpers.family_check import check_alone_equals_batched, check_family
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.layers.moe import MoEBlock
from tokenmill.models.arch import MoEConfig
from tokenmill.models.loader.hf_config import arch_config_from_hf
from tokenmill.models.loader.safetensors_weights import SafetensorsWeights

MOE_FAMILIES = ["qwen2_moe", "deepseek_v3", "glm4_moe"]


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    """Each family's tiny checkpoint, made on first use."""
    made = {}

    def folder(arch):
        if arch not in made:
            made[arch] = make_tiny_hf_model(tmp_path_factory.mktemp(arch), arch=arch)
        return made[arch]
    return folder


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_moe_family_equals_hf(moe_folders, arch):
    path = moe_folders(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_family(path, hf)


@pytest.mark.skipif(cpu_kernels() is None, reason="batch invariance comes from the native kernels' products")
@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_moe_family_request_alone_equals_it_in_a_batch_in_the_default_dtype(moe_folders, arch):
    check_alone_equals_batched(moe_folders(arch))


def config_with(folder, tmp_path, **changes):
    """A copy of checkpoint `folder`'s config.json (only) with `changes`, read as tokenmill reads it."""
    copy = tmp_path / "model"
    copy.mkdir(exist_ok=True)
    shutil.copy(folder / "config.json", copy / "config.json")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return arch_config_from_hf(copy)


def test_qwen2_moe_config(moe_folders, tmp_path):
    arch = config_with(moe_folders("qwen2_moe"), tmp_path)
    assert arch.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=False,
                                 shared_intermediate_size=48, shared_expert_gate=True, dense_layers=frozenset({0}))
    assert arch.attention_bias and not arch.attention_out_bias  # q, k, v biased (qkv_bias), o_proj not
    assert not config_with(moe_folders("qwen2_moe"), tmp_path, qkv_bias=False).attention_bias
    step = config_with(moe_folders("qwen2_moe"), tmp_path, mlp_only_layers=[], decoder_sparse_step=2)
    assert [step.layer_spec(i).moe for i in range(2)] == [False, True]


def test_deepseek_v3_config_and_its_mtp_layer_dropped(moe_folders, tmp_path, caplog):
    folder = moe_folders("deepseek_v3")
    with caplog.at_level(logging.INFO, logger="tokenmill.models.loader.hf_config"):
        arch = config_with(folder, tmp_path)
    assert "1 multi-token prediction layer(s) (num_nextn_predict_layers) are not loaded" in caplog.text
    # the checkpoint that test_moe_family_equals_hf loads holds that layer's tensors (layer 2 of 2)
    assert "model.layers.2.eh_proj.weight" in SafetensorsWeights(folder).names
    assert arch.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                 routed_scaling_factor=2.5, shared_intermediate_size=32, dense_layers=frozenset({0}),
                                 scoring="sigmoid", num_groups=4, topk_groups=2)
    assert arch.mla.q_lora_rank == 24 and arch.head_dim == 24
    assert config_with(folder, tmp_path, first_k_dense_replace=2).moe is None  # every layer dense


def test_glm4_moe_config(moe_folders, tmp_path, caplog):
    folder = moe_folders("glm4_moe")
    with caplog.at_level(logging.INFO, logger="tokenmill.models.loader.hf_config"):
        arch = config_with(folder, tmp_path)
    assert "Glm4MoeForCausalLM: its 1 multi-token prediction layer(s)" in caplog.text
    assert arch.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                 routed_scaling_factor=2.5, shared_intermediate_size=32, dense_layers=frozenset({0}),
                                 scoring="sigmoid", num_groups=1, topk_groups=1)
    assert arch.head_dim == 32 and arch.rotary_dim == 16  # partial_rotary_factor 0.5 (in rope_parameters)
    assert arch.qk_norm and arch.qk_norm_per_head and arch.attention_bias and not arch.attention_out_bias
    assert not config_with(folder, tmp_path, use_qk_norm=False).qk_norm
    # an older config.json: the factor at the top level
    assert config_with(folder, tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       partial_rotary_factor=1.0).rotary_dim is None


# The fused path (layers/fused_moe.py, here in Triton's interpreter on CPU tensors) routes with its own kernel:
# two prompts, 4 tokens, since an interpreted step costs ~0.2 s; batch_invariant=False leaves the dense layers
# on F.linear.
def test_deepseek_v3_fused_experts_give_hf_greedy_tokens(moe_folders):
    folder = moe_folders("deepseek_v3")
    llm = LLM(str(folder), dtype="float32", linear_kernel="triton", attention_backend="torch_ref",
              batch_invariant=False, block_size=8, num_kv_blocks=64)
    blocks = [m for m in llm.llm_engine.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.fused is not None and not b.experts for b in blocks)
    prompts = [[1, 520, 9531, 42], list(range(100, 400, 7))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids, output in zip(prompts, outputs):
        ours = output.outputs[0].token_ids
        assert ours == hf_greedy_tokens_from(hf, ids, 4, ours)


@pytest.mark.parametrize("arch, changes, message", [
    ("qwen2_moe", {"use_sliding_window": True}, "Qwen2MoeForCausalLM with use_sliding_window=True is not supported"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 is not supported"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "DeepseekV3ForCausalLM with scoring_func='softmax' is not supported"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave=False is not supported"),
    ("deepseek_v3", {"n_group": 3}, "n_group=3 is not supported: 8 experts must split into equal groups of at least 2"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group=5 of n_group=4 is not supported"),
    ("deepseek_v3", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is not supported"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ("glm4_moe", {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.3}},
     r"Glm4MoeForCausalLM with partial_rotary_factor=0.3 is not supported: it turns 9 of the head's 32 dims"),
    ("glm4_moe", {"n_group": 8}, "n_group=8 is not supported"),
    ("glm4_moe", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
])
def test_moe_family_unsupported_settings_are_refused_by_name(moe_folders, tmp_path, arch, changes, message):
    with pytest.raises(ValueError, match=message):
        config_with(moe_folders(arch), tmp_path, **changes)
