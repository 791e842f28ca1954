"""Granite 4.0-H (GraniteMoeHybridForCausalLM), the first hybrid: a tiny random checkpoint (3 layers, Mamba2 -
attention - Mamba2, hidden 64, 4 experts plus a shared one, every Granite multiplier away from 1) gives HF float32's
greedy ids and logprobs plain, chunked, swap-preempted and batched; its states carry across chunks split at every
boundary, restart after a recompute preemption and go on, with its K/V, from where they were after a swap preemption
mid-prefill or in decode (the one pass's ids; a swap space too small for a request recomputes it), its attention
layer on every attention backend; a request's output in the default dtype does not depend on its batch; two pipeline stages give the one
rank's ids; the dense, NoPE variant matches HF; a state kept in the attention
cache's blocks round-trips through non-adjacent blocks; unsupported settings are refused.

Cost: check_family on 4 prompts x 16 tokens (HF's generate is the oracle), small engines of 6 tokens a request
below; the checkpoint and the HF model are built once per module."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import EIGHT_PROMPTS, hf_greedy_logprobs
from helpers.family_check import check_family
from helpers.forced_preemption import OTHERS, PROMPT, greedy_runs
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM
from tokenmill.core.kv_spec import StateCacheSpec
from tokenmill.layers.mamba2_mixer import StateChunk
from tokenmill.layers.paged_state import PagedState
from tokenmill.models.loader.hf_granite_hybrid import granite_hybrid_arch_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("granite_hybrid"), arch="granitemoehybrid")


@pytest.fixture(scope="module")
def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_pass(folder):
    """The float32 ids and logprobs of PROMPT and OTHERS[0] run together (6 tokens each), nothing preempted."""
    return greedy_runs(LLM(str(folder), dtype="float32", num_kv_blocks=32), [PROMPT, OTHERS[0]], max_tokens=6)


def _assert_same_run(run, want):
    """The same ids as `want`, logprobs within float32 noise (the runs split their chunks differently)."""
    for (ids, logprobs), (want_ids, want_logprobs) in zip(run, want):
        assert ids == want_ids
        worst = max(abs(a[1] - b[1]) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y))
        assert worst < 1e-4


def test_granite_hybrid_matches_hf_plain_chunked_preempted_and_batched(folder, hf, caplog):
    with caplog.at_level(logging.INFO):
        # 4 of the 8 prompts (the two longest among them) x 16 tokens: HF's reference Mamba2 kernels make its
        # generate the slow half of the check (10 s for 8 x 32); the preempted requests swap (states and K/V)
        counts = check_family(folder, hf, count=16, prompts=EIGHT_PROMPTS[:4], prefix_caching=False,
                              preemption_mode="swap")
    assert counts["preemptions"] > 0  # the attention group's growth preempts (check_family asserts it too)
    assert "prefix caching is off: GraniteMoeHybridForCausalLM keeps a recurrent state" in caplog.text
    # the state's memory per request and the pool blocks it takes beside the attention's per token, at start
    assert "KiB per request whatever its length, 0 per token (6 pool block(s) in each of its 2 group(s))" in caplog.text
    assert "full attention: 1 group(s), 1 layers, 0.2 KiB per token" in caplog.text


def test_granite_hybrid_chunks_at_every_boundary_and_a_preempted_request_give_one_pass_ids(folder, one_pass):
    """One-token chunks split the prompt at every boundary; a preemption mid-prefill drops the request's blocks
    (states and K/V) and it recomputes from zero. Float32: the one pass's ids, logprobs within float32 noise.
    The two runs use the backends check_family's CPU default does not (the reference, and Triton in its
    interpreter): the attention layer runs on them as any family's, beside states kept in their cache tensors."""
    prompts = [PROMPT, OTHERS[0]]
    every_boundary = greedy_runs(LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=1,
                                     attention_backend="torch_ref"), prompts, max_tokens=6)
    preempted = greedy_runs(LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=7,
                                attention_backend="triton_paged", linear_kernel="dense", preemption_mode="recompute"),
                            prompts, preempt_at_step=3, max_tokens=6)
    for run in (every_boundary, preempted):
        _assert_same_run(run, one_pass)


# 16-token steps: after 3 steps the victim (OTHERS[0], admitted second) is 24 tokens into its 30-token prompt, beside
# PROMPT's decode; 64-token steps: both prompts in the first step, the victim preempted after 3 decode steps (33)
@pytest.mark.parametrize("budget,computed", [(16, 24), (64, 33)], ids=["mid_prefill", "in_decode"])
def test_a_swapped_granite_hybrid_request_goes_on_from_its_exact_state(folder, one_pass, budget, computed):
    """Swap preemption copies the request's state blocks and K/V blocks to the swap space and back into new blocks:
    it recomputes nothing and gives the one pass's ids (a lost or stale state or K/V changes them)."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=budget, preemption_mode="swap")
    swapped = greedy_runs(llm, [PROMPT, OTHERS[0]], preempt_at_step=3 if budget == 16 else 4, max_tokens=6)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.swap.num_swapped_out == 1 and scheduler.swap.num_swapped_in_tokens == computed
    assert scheduler.num_recomputed_tokens == 0 and scheduler.swap.num_free_slots == scheduler.swap.num_slots
    _assert_same_run(swapped, one_pass)


def test_a_granite_hybrid_swap_space_too_small_recomputes(folder, one_pass):
    # one slot: a request's 2 x 6 state blocks and its K/V blocks do not fit, so the preempted one is recomputed
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=16, preemption_mode="swap",
              swap_space_gb=1e-9)
    recomputed = greedy_runs(llm, [PROMPT, OTHERS[0]], preempt_at_step=3, max_tokens=6)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.swap.num_slots == 1 and scheduler.swap.num_swapped_out == 0
    assert scheduler.num_recomputed_tokens == 24
    _assert_same_run(recomputed, one_pass)


def test_granite_hybrid_output_does_not_depend_on_its_batch_in_the_default_dtype(folder):
    alone = greedy_runs(LLM(str(folder), num_kv_blocks=32), [PROMPT])[0]
    # 5-token chunks; a pool of 24 blocks (a request's states take 8 of them in bfloat16 at 16 tokens a block)
    busy = LLM(str(folder), num_kv_blocks=24, max_num_batched_tokens=5)
    batched = greedy_runs(busy, [OTHERS[0], PROMPT, *OTHERS[1:]], preempt_at_step=4)
    assert batched[1] == alone  # the same bits


def test_granite_hybrid_over_two_pipeline_stages_gives_the_one_rank_ids(folder):
    """Stage 0 holds a Mamba2 layer and the attention layer, stage 1 the other Mamba2 layer, each rank in a worker
    process with its own states and K/V; a batch of four gives the one-rank ids (2 ranks: about 3 s)."""
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in [PROMPT, *OTHERS]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(str(folder), dtype="float32").generate(prompts, params, use_tqdm=False)
    two = LLM(str(folder), dtype="float32", pipeline_parallel_size=2,
              distributed_executor_backend="mp").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_a_dense_granite_hybrid_without_rope_matches_hf(tmp_path):
    # the other variant Granite 4.0-H ships: no experts (each layer's MLP the shared MLP alone) and no position
    # embedding (NoPE), here with the attention layer first; 2 layers, 2 prompts x 8 tokens
    path = make_tiny_hf_model(tmp_path, arch="granitemoehybrid", num_hidden_layers=2,
                              layer_types=["attention", "mamba"], num_local_experts=0, position_embedding_type=None)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [PROMPT, OTHERS[1]]
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64)
    for ids, (tokens, logprobs) in zip(prompts, greedy_runs(llm, prompts, max_tokens=8)):
        want_tokens, want_logprobs = hf_greedy_logprobs(hf, ids, 8)
        assert list(tokens) == want_tokens
        assert max(abs(step[0][1] - want) for step, want in zip(logprobs, want_logprobs)) < 1e-4
    arch = llm.llm_engine.arch
    assert arch.moe is None and arch.no_rope_layers == {0, 1} and arch.mamba_layers == {1}


def test_a_state_in_attention_blocks_round_trips_and_touches_no_other_block():
    spec = StateCacheSpec(conv_kernel=4, conv_dim=24, num_heads=2, head_dim=4, state_size=8, dtype_bytes=2)
    cache = torch.full((2, 10, 2, 4, 8), 7.0, dtype=torch.bfloat16)  # [planes, blocks, heads, block_size, dim]
    paged = PagedState(cache, spec)
    assert paged.pages == 2  # 256 bytes of SSM state + 144 of conv window in blocks of 256 bytes
    untouched = cache.clone()
    conv, ssm = torch.randn(3, 24).to(torch.bfloat16), torch.randn(2, 4, 8)
    paged.store(StateChunk(0, 5, 6, True, (6, 2)), conv, ssm)
    loaded_conv, loaded_ssm = paged.load(StateChunk(0, 1, 6, False, (6, 2)))
    assert torch.equal(loaded_conv, conv) and torch.equal(loaded_ssm, ssm)  # float32 SSM state kept exactly
    others = [b for b in range(10) if b not in (2, 6)]
    assert torch.equal(cache[:, others], untouched[:, others])
    fresh_conv, fresh_ssm = paged.load(StateChunk(0, 4, 6, True, (6, 2)))  # a new sequence: zeros, not the blocks'
    assert not fresh_conv.any() and not fresh_ssm.any()


@pytest.mark.parametrize("setting,named", [
    ({"time_step_limit": [0.0, 1.0]}, "time_step_limit"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"num_hidden_layers": 2, "layer_types": ["mamba", "sliding_attention"]}, "layer types"),
    ({"position_embedding_type": "rope", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
])
def test_unsupported_granite_hybrid_settings_are_refused(setting, named):
    with pytest.raises(ValueError, match=named):
        granite_hybrid_arch_config(setting, {}, lambda: "float32")


def test_granite_hybrid_quantised_cache_is_refused(folder):
    with pytest.raises(ValueError, match="kv_cache_dtype int8: GraniteMoeHybridForCausalLM's recurrent states"):
        LLM(str(folder), kv_cache_dtype="int8")
