"""Multi-head latent attention (DeepSeek-V2) on tiny random checkpoints: logits, greedy tokens and logprobs
equal HF transformers' (float32), also from the same weights converted to GGUF as llama.cpp does; the KV
cache holds only the latent; chunked prefill and prefix caching change nothing; contradicting or
unsupported configs are refused."""

from __future__ import annotations

import json
import random

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_greedy_matches_hf, assert_logits_equal_hf, hf_forced, model_logits
from helpers.tiny_gguf import write_deepseek2_gguf_from_hf
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.models.arch import kv_cache_geometry
from tokenmill.models.loader.hf_config import arch_config_from_hf
from tokenmill.worker.worker import check_divisible

# the tiny config (tests/helpers/tiny_models.py): 2 layers (dense unless overridden), 4 heads, kv_lora_rank 32,
# RoPE dims 8
LATENT, ROPE = 32, 8
VARIANTS = {
    "q-proj": dict(),  # q_lora_rank None: queries straight from q_proj
    "q-lora": dict(q_lora_rank=24),  # q_a_proj -> q_a_layernorm -> q_b_proj
    # layer 1 a mixture of experts (layers/moe.py): 4 routed (top 2, weights x 2.5) and a shared expert
    "moe": dict(first_k_dense_replace=1, routed_scaling_factor=2.5),
    # YaRN as the released checkpoints have it (their mscale 0.707 both ways cancels in the tables; these
    # do not): prompts run past the 32 original positions, the softmax scale takes mscale_all_dim squared
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5}),
}
PROMPTS = [[1, 520, 9531, 42], list(range(100, 400, 7)), [7, 8, 9] * 30]
_rng = random.Random(0)
GREEDY_PROMPTS = PROMPTS + [[_rng.randrange(49152) for _ in range(n)] for n in (1, 5, 17, 33, 60)]
TOKENS = 32

# also run without native kernels and at the lowest ISA level (`make test`)
pytestmark = pytest.mark.every_level


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch="deepseek_v2", **VARIANTS[request.param])


@pytest.fixture(scope="module")
def pair(checkpoint):
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    llm = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=128)
    return llm, hf


def tokens_and_logprobs(outputs) -> list[tuple[list[int], list[float]]]:
    result = []
    for output in outputs:
        completion = output.outputs[0]
        result.append((list(completion.token_ids),
                       [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]))
    return result


def test_logits_equal_hf(pair):
    llm, hf = pair
    assert_logits_equal_hf(llm, hf, PROMPTS)


def test_batched_greedy_tokens_and_logprobs_equal_hf(pair):
    llm, hf = pair
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
    ours = tokens_and_logprobs(llm.generate(GREEDY_PROMPTS, params, use_tqdm=False))
    for (tokens, logprobs), ids in zip(ours, GREEDY_PROMPTS):
        hf_tokens, hf_logprobs = hf_forced(hf, ids, tokens)
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


# llama.cpp's GGUF keeps only mscale_all_dim and takes mscale as equal to it (the released configs' 0.707
# both ways), so the yarn checkpoint converted here has them equal
GGUF_VARIANTS = {
    "split-kv-b": (dict(q_lora_rank=24, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 32, "mscale": 0.707,
                                         "mscale_all_dim": 0.707}), True),
    "whole-kv-b": (dict(first_k_dense_replace=1), False),
}


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_a_gguf_file_gives_hf_greedy_tokens_and_logprobs(tmp_path, variant):
    """A DeepSeek-V2 GGUF as llama.cpp writes it (newer converters split kv_b_proj into attn_k_b and
    attn_v_b; older ones keep attn_kv_b) loads to the HF folder's configuration and gives HF's output."""
    overrides, split = GGUF_VARIANTS[variant]
    folder = make_tiny_hf_model(tmp_path / "hf", arch="deepseek_v2", **overrides)
    path = write_deepseek2_gguf_from_hf(folder, tmp_path / "deepseek2.gguf", split_kv_b=split)
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=256)
    ours, theirs = llm.llm_engine.arch, arch_config_from_hf(folder)
    assert (ours.architecture, ours.mla, ours.moe, ours.head_dim) == \
        (theirs.architecture, theirs.mla, theirs.moe, theirs.head_dim)
    # yarn's mscale_all_dim is stored as a float32 0.1 * mscale_all_dim
    assert ours.attention_scale == pytest.approx(theirs.attention_scale, rel=1e-6)
    assert (ours.rope_scaling is None) == (theirs.rope_scaling is None)
    if ours.rope_scaling is not None:
        assert ours.rope_scaling.attention_factor == pytest.approx(theirs.rope_scaling.attention_factor, rel=1e-6)
        assert ours.rope_scaling.factor == theirs.rope_scaling.factor
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = GREEDY_PROMPTS if split else GREEDY_PROMPTS[:3]
    assert_greedy_matches_hf(llm, hf, prompts, count=TOKENS, logprob_tolerance=1e-4)


@pytest.mark.parametrize("metadata, message", [
    (lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID), "expert_gating_func=2"),
    (lambda w: (w.add_expert_group_count(2), w.add_expert_group_used_count(1)), "expert_group_count=2"),
], ids=["sigmoid-gating", "group-limited"])
def test_a_gguf_file_with_unsupported_routing_is_refused_by_name(tmp_path, metadata, message):
    folder = make_tiny_hf_model(tmp_path / "hf", arch="deepseek_v2", first_k_dense_replace=1)
    path = write_deepseek2_gguf_from_hf(folder, tmp_path / "deepseek2.gguf", extra_metadata=metadata)
    with pytest.raises(ValueError, match=f"deepseek2 with {message} is not supported"):
        LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64)


def test_cache_holds_only_the_latent(pair):
    llm, _ = pair
    engine = llm.llm_engine
    runner = engine.runner
    assert kv_cache_geometry(engine.arch) == (1, LATENT + ROPE)
    assert len(runner.kv_caches) == 2
    # one plane (the latent is both key and value), one head, c_kv + k_pe per token: nothing stored twice
    assert all(tuple(cache.shape) == (1, 128, 1, 8, LATENT + ROPE) for cache in runner.kv_caches)
    # the memory budget is sized with the same geometry: layers x block_size x (r + rope) values a block
    assert engine.kv_layout.block_bytes(8) == 2 * 8 * (LATENT + ROPE) * 4
    assert engine.kv_layout.groups[0].spec.kind == "MLA latent" and len(engine.kv_layout.groups) == 1


def test_chunked_prefill_and_prefix_cache_agree_with_a_plain_run(checkpoint):
    prefix = list(range(2000, 2045))  # 45 shared tokens: 11 full blocks of 4
    prompts = [prefix + [11 * i + 3, 7 * i + 5] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    plain = LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=256, prefix_caching=False)
    reference = tokens_and_logprobs(plain.generate(prompts, params, use_tqdm=False))
    del plain
    # prefills cut into chunks of at most 16 tokens, and blocks shared between (then across) requests
    llm = LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    for _ in range(2):  # cold, then warm
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(
                tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False)), reference):
            assert tokens == ref_tokens
            assert logprobs == pytest.approx(ref_logprobs, abs=1e-5)
    assert llm.llm_engine.kv_cache.prefix_hits > 0


def test_native_element_wise_kernels_equal_hf(checkpoint):
    # the RoPE kernel rotates q_pe and k_pe in place as strided views of the projections' outputs
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no native kernels")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    llm = LLM(str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=64)
    # what bfloat16 and quantised models run (their KernelChoice.elementwise), on this float32 model
    llm.llm_engine.model._use_elementwise_kernels(kernels)
    ids = PROMPTS[1]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(model_logits(llm.llm_engine, ids), theirs, atol=2e-5, rtol=1e-4)


def test_an_mla_draft_keeps_greedy_tokens(checkpoint):
    # the draft runner allocates its own latent caches (spec_decode/draft.py)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(checkpoint), dtype="float32", num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=64, speculative_method="draft",
              draft_model=str(checkpoint), draft_num_layers=1, speculative_min_acceptance=0.0)
    drafted = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.llm_engine.stats().spec.draft_tokens > 0
    draft_cache = llm.llm_engine.speculation.proposer.runner.kv_caches[0]
    assert draft_cache.shape[0] == 1 and draft_cache.shape[2] == 1 and draft_cache.shape[-1] == LATENT + ROPE


def test_config_contradicting_the_weights_is_refused(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="deepseek_v2")
    config = json.loads((path / "config.json").read_text())
    config["kv_lora_rank"] = 24  # the tensors have 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"kv_a_\w+\.weight has shape \({LATENT},?.*kv_lora_rank 24"):
        LLM(str(path), dtype="float32", num_kv_blocks=16)


def test_unsupported_settings_are_refused(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="deepseek_v2")
    config = json.loads((path / "config.json").read_text())

    def arch_with(**changes):
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        return arch_config_from_hf(path)

    with pytest.raises(ValueError, match="MLA models run at tensor_parallel_size 1"):
        check_divisible(arch_with(), 2)
    with pytest.raises(ValueError, match="group_limited_greedy"):
        arch_with(first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        arch_with(first_k_dense_replace=1, norm_topk_prob=True)
    # the MoE translation: layers from first_k_dense_replace on are sparse, the shared experts fused
    moe = arch_with(first_k_dense_replace=1, routed_scaling_factor=2.5).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (4, 2, 32, 32)
    assert moe.dense_layers == frozenset({0}) and moe.routed_scaling_factor == 2.5 and not moe.norm_topk_prob
    assert arch_with().moe is None  # every layer dense
