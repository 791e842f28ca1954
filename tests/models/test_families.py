"""Mixture-of-experts families added for issue 60 (Qwen2-MoE): each tiny random checkpoint, read from its own
config.json as transformers reads it, gives HF float32's greedy ids and logprobs in every mode the engine
schedules a request in (helpers/family_check.py), a request's output in the default dtype does not depend on
what shares its batch, and the settings tokenmill does not run are refused by name.

Cost: about 4 s per family for `check_family` (two engine runs of eight prompts x 32 tokens), 1 s for the
batch-invariance run; the checkpoints and HF models are built once per module."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.family_check import check_family
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.layers.moe import MoEBlock
from tokenmill.models.arch import MoEConfig
from tokenmill.models.loader.hf_config import arch_config_from_hf

MOE_FAMILIES = ["qwen2_moe"]


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
    llm = LLM(str(moe_folders(arch)), block_size=8, num_kv_blocks=256, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def result(output):
        sample = output.outputs[0]
        return sample.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in sample.logprobs]

    target = {"prompt_token_ids": list(range(100, 400, 7))}
    alone = result(llm.generate([target], params, use_tqdm=False)[0])
    others = [{"prompt_token_ids": ids} for ids in ([7, 8, 9] * 30, [1, 520, 9531, 42], list(range(1000, 1060)))]
    batched = llm.generate([others[0], target, *others[1:]], params, use_tqdm=False)
    assert result(batched[1]) == alone
    assert any(isinstance(m, MoEBlock) for m in llm.llm_engine.model.modules())


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


@pytest.mark.parametrize("arch, changes, message", [
    ("qwen2_moe", {"use_sliding_window": True}, "Qwen2MoeForCausalLM with use_sliding_window=True is not supported"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 is not supported"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_moe_family_unsupported_settings_are_refused_by_name(moe_folders, tmp_path, arch, changes, message):
    with pytest.raises(ValueError, match=message):
        config_with(moe_folders(arch), tmp_path, **changes)
