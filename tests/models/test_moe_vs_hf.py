"""Mixtures of experts (Mixtral, Qwen3-MoE, OLMoE): tiny random checkpoints give HF's logits and greedy tokens;
the MoE block computes a token alike whatever shares its step; configs that contradict the tensors are refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_greedy_matches_hf, assert_logits_equal_hf, hf_greedy_tokens_from, model_logits
from helpers.family_check import check_alone_equals_batched
from helpers.tiny_gguf import write_moe_gguf_from_hf
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.layers.moe import MoEBlock, Router
from tokenmill.models.arch import MoEConfig
from tokenmill.models.decoder import GatedMLP
from tokenmill.models.loader import load_model_source
from tokenmill.parallel.group import TPGroup
from tokenmill.worker.worker import check_divisible

ARCHS = ["mixtral", "qwen3_moe", "olmoe"]
PROMPTS = [[1, 520, 9531, 42], list(range(100, 400, 7)), [7, 8, 9] * 30]

# also run without native kernels and at the lowest ISA level (`make test`)
pytestmark = pytest.mark.every_level

needs_native = pytest.mark.skipif(cpu_kernels() is None, reason="batch invariance comes from the native kernels' "
                                  "products (without them every layer multiplies through F.linear)")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {arch: make_tiny_hf_model(tmp_path_factory.mktemp(arch), arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, folders):
    path = folders[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=256), hf


def test_logits_equal_hf(pair):
    llm, hf = pair
    assert_logits_equal_hf(llm, hf, PROMPTS)


def test_batched_greedy_and_logprobs_equal_hf(pair):
    llm, hf = pair
    assert_greedy_matches_hf(llm, hf, count=32, logprob_tolerance=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_file_gives_hf_greedy_tokens_and_logprobs(tmp_path, folders, arch):
    """The same weights converted as llama.cpp does (experts stacked, the router as ffn_gate_inp, Mixtral
    as a "llama" file) load to the same mixture and give HF's output."""
    path = write_moe_gguf_from_hf(folders[arch], tmp_path / f"{arch}.gguf")
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=256)
    hf_source = load_model_source(str(folders[arch]), with_tokenizer=False)
    assert llm.llm_engine.arch.moe == hf_source.arch.moe
    assert llm.llm_engine.arch.architecture == hf_source.arch.architecture
    hf = AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).eval()
    assert_greedy_matches_hf(llm, hf, count=32, logprob_tolerance=1e-4)


@pytest.mark.parametrize("arch, window", [("mixtral", dict(sliding_window=16)),
                                          ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16))])
def test_sliding_window_shorter_than_the_prompts_equals_hf(tmp_path, arch, window):
    path = make_tiny_hf_model(tmp_path, arch=arch, **window)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64)
    assert llm.llm_engine.model.arch.sliding_window == 16
    ids = PROMPTS[1]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(model_logits(llm.llm_engine, ids), theirs, atol=2e-5, rtol=1e-4)


def test_arch_configs(folders):
    mixtral, qwen3_moe, olmoe = (load_model_source(str(folders[a])).arch for a in ARCHS)
    assert mixtral.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True)
    assert not mixtral.qk_norm
    assert qwen3_moe.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                      dense_layers=frozenset({1}))
    assert [qwen3_moe.layer_spec(i).moe for i in range(3)] == [True, False, True]
    assert qwen3_moe.qk_norm and qwen3_moe.qk_norm_per_head and qwen3_moe.head_dim == 32
    assert olmoe.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=False)
    assert olmoe.qk_norm and not olmoe.qk_norm_per_head and olmoe.rms_norm_eps == 1e-5
    # tensor parallelism splits each expert's intermediate (32); at 3 ranks everything else divides here
    three_ways = dict(num_attention_heads=6, num_key_value_heads=3, vocab_size=3000, intermediate_size=192,
                      hidden_size=96)
    for arch in (mixtral, qwen3_moe):
        check_divisible(arch, 2)
        with pytest.raises(ValueError, match=r"3 does not divide the model's expert intermediate size \(32\)"):
            check_divisible(dataclasses.replace(arch, **three_ways), 3)
    with pytest.raises(ValueError, match="q/k norm over the whole projections"):
        check_divisible(olmoe, 2)


def copy_with_config(folder, tmp_path, **changes):
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


@pytest.mark.parametrize("arch, changes, message", [
    ("mixtral", {"num_local_experts": 4}, r"experts\.4\..*expert 4, but the config has num_experts=4"),
    ("olmoe", {"num_experts": 16}, r"router weight has shape \(8, 64\): 8 experts.*config has num_experts=16"),
    ("qwen3_moe", {"moe_intermediate_size": 48}, r"has shape \((64, 32|32, 64)\), but the config's experts .*expert width 48"),
], ids=["fewer-experts", "more-experts", "expert-width"])
def test_config_contradicting_the_tensors_is_refused_naming_both(folders, tmp_path, arch, changes, message):
    with pytest.raises(ValueError, match=message):
        LLM(copy_with_config(folders[arch], tmp_path, **changes), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("arch, changes, message", [
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 of 8 experts is not supported"),
])
def test_unsupported_settings_are_refused_by_name(folders, tmp_path, arch, changes, message):
    with pytest.raises(ValueError, match=message):
        load_model_source(copy_with_config(folders[arch], tmp_path, **changes))


def make_block(dtype: torch.dtype, native, shared: int = 0, top_k: int = 3) -> MoEBlock:
    """A standalone block (8 experts, a scaled and unnormalised top 3, optionally shared experts) with seeded
    weights, its products through the kernels a batch-invariant model gets."""
    moe = MoEConfig(num_experts=8, top_k=top_k, intermediate_size=48, norm_topk_prob=False,
                    routed_scaling_factor=2.5, shared_intermediate_size=shared)
    block = MoEBlock(moe, 64, lambda width: GatedMLP(64, width, "silu", TPGroup.single()), TPGroup.single())
    generator = torch.Generator().manual_seed(0)
    for param in block.parameters():
        param.data = (torch.randn(param.shape, generator=generator) * 0.2).to(dtype)
    for module in block.modules():
        if hasattr(module, "use_kernel"):
            module.use_kernel(False, native, True)
    return block


def test_grouped_product_equals_a_per_token_loop():
    block = make_block(torch.float32, None, shared=32)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
        expected = []
        for row, p in zip(x, probs):
            weights, ids = p.topk(3)
            routed = sum(w * 2.5 * block.experts[int(e)](row[None])[0] for w, e in zip(weights, ids))
            expected.append(routed + block.shared_experts(row[None])[0])
        torch.testing.assert_close(block(x), torch.stack(expected), atol=1e-5, rtol=1e-5)
        assert block(x[:0]).shape == (0, 64)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shared", [0, 32], ids=["routed", "shared"])
def test_block_gives_a_token_the_same_bits_alone_and_in_any_batch(dtype, shared):
    block = make_block(dtype, cpu_kernels(), shared)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        full = block(x)
        counts = torch.bincount(torch.topk(block.gate(x).float(), 3).indices.flatten(), minlength=8)
        assert counts.max() > 16  # experts multiply many rows in the batch, one alone
        for i in range(0, 64, 7):
            assert torch.equal(block(x[i:i + 1])[0], full[i]), f"row {i}"
        for n in (2, 5, 17, 40):
            assert torch.equal(block(x[:n]), full[:n]), f"first {n} rows"
            assert torch.equal(block(x.flip(0)[:n]), full.flip(0)[:n]), f"last {n} rows, reversed"


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_request_alone_equals_it_in_a_batch(folders, dtype):
    check_alone_equals_batched(folders["mixtral"], dtype=dtype)


def test_quantized_experts_stay_quantized_and_the_router_float(folders):
    llm = LLM(str(folders["olmoe"]), dtype="float32", quantization="int8", block_size=8, num_kv_blocks=256)
    model = llm.llm_engine.model
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(e.gate_up_proj.quantized_format == e.down_proj.quantized_format == "int8"
                          for b in blocks for e in b.experts)
    assert all(isinstance(b.gate, Router) and b.gate.weight.dtype == torch.float32 for b in blocks)
    assert model.describe_weights().startswith("int8 projections")
    float_llm = LLM(str(folders["olmoe"]), dtype="float32", block_size=8, num_kv_blocks=256)
    quantized, exact = model_logits(llm.llm_engine, PROMPTS[1]), model_logits(float_llm.llm_engine, PROMPTS[1])
    assert (quantized - exact).abs().mean() < 0.05 * exact.std()  # int8 weights: close, not equal


# The fused path (layers/fused_moe.py: CUDA's, here in Triton's interpreter on CPU tensors): experts only, since
# batch_invariant=False leaves the dense layers on F.linear. Two prompts, 4 tokens: an interpreted step costs
# ~0.2 s. DeepSeek-V2: layer 1 sparse (4 experts, top 2, unnormalised and scaled, a shared expert).
FUSED = dict(dtype="float32", linear_kernel="triton", attention_backend="torch_ref", batch_invariant=False,
             block_size=8, num_kv_blocks=64)


# Mixtral's routing renormalised, OLMoE's not, DeepSeek-V2's scaled beside a shared expert (Qwen3-MoE's routing is
# Mixtral's: the loop-path tests hold it)
@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "deepseek_v2"])
def test_fused_experts_give_hf_greedy_tokens(folders, tmp_path, arch):
    folder = folders[arch] if arch in folders else make_tiny_hf_model(tmp_path, arch=arch, first_k_dense_replace=1)
    llm = LLM(str(folder), **FUSED)
    blocks = [m for m in llm.llm_engine.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.fused is not None and not b.experts for b in blocks)
    prompts = PROMPTS[:2]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids, output in zip(prompts, outputs):
        ours = output.outputs[0].token_ids
        assert ours == hf_greedy_tokens_from(hf, ids, 4, ours)
