"""The hybrids of Mamba2 mixers and attention: Granite 4.0-H (GraniteMoeHybridForCausalLM: 3 layers, Mamba2 -
attention - Mamba2, hidden 64, 4 experts plus a shared one, every Granite multiplier away from 1), Nemotron-H
(NemotronHForCausalLM: blocks M - * E M, NoPE attention, relu² MLP and experts) and Falcon-H1
(FalconH1ForCausalLM: a Mamba2 mixer beside attention, 1 layer here, 2 in its variants' tests, every muP multiplier
away from 1). Each tiny random checkpoint gives HF float32's greedy ids and logprobs plain, chunked, swap-preempted
and batched; its states carry across chunks split at every boundary, restart after a recompute preemption and go on,
with its K/V, from where they were after a swap preemption mid-prefill or in decode (the one pass's ids; a swap space
too small for a request recomputes it), its attention layers on every attention backend; a request's output in the default dtype does not
depend on its batch; two pipeline stages give the one rank's ids; with speculation (proposals of every accepted
length, a swap preemption) the ids and logprobs are the same bits as without. Granite's dense, NoPE variant and Falcon-H1's
other two gate/norm placements match HF, as does Nemotron-H's dt floor across chunks; a state kept in the attention
cache's blocks round-trips through non-adjacent blocks; unsupported settings are refused.

Cost: check_family on the 8 prompts x 32 tokens (HF one forward pass a prompt), small engines of 6 tokens a request
below; each checkpoint and its HF model are built once per module (about 10 s an architecture in all)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import hf_forced
from helpers.family_check import check_family
from helpers.forced_preemption import OTHERS, PROMPT, greedy_runs
from helpers.scripted_proposals import assert_speculation_changes_no_bit
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_spec import StateCacheSpec
from tokenmill.layers.mamba2_mixer import StateChunk
from tokenmill.layers.paged_state import PagedState
from tokenmill.models.loader.hf_falcon_h1 import falcon_h1_arch_config
from tokenmill.models.loader.hf_granite_hybrid import granite_hybrid_arch_config
from tokenmill.models.loader.hf_nemotron_h import nemotron_h_arch_config

# model_type -> (architecture, what the engine logs at start: the states' memory per request and the pool blocks
# they take in their groups, the attention's per token)
HYBRIDS = {
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM",
                         "KiB per request whatever its length, 0 per token (6 pool block(s) in each of its 2 group(s))",
                         "full attention: 1 group(s), 1 layers, 0.2 KiB per token"),
    # (layers "M-", "*E", "M": the two mixers' states in two groups of one layer, beside one attention layer)
    "nemotron_h": ("NemotronHForCausalLM",
                   "KiB per request whatever its length, 0 per token (6 pool block(s) in each of its 2 group(s))",
                   "full attention: 1 group(s), 1 layers, 0.2 KiB per token"),
    # (its one layer's mixer and attention as two decoder layers: a state group and an attention group)
    "falcon_h1": ("FalconH1ForCausalLM",
                  "KiB per request whatever its length, 0 per token (6 pool block(s) in each of its 1 group(s))",
                  "full attention: 1 group(s), 1 layers, 0.2 KiB per token"),
}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def model_type(request):
    return request.param


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model_type):
    return make_tiny_hf_model(tmp_path_factory.mktemp(model_type), arch=model_type)


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


def test_hybrid_matches_hf_plain_chunked_preempted_and_batched(model_type, folder, hf, caplog):
    architecture, state_memory, attention_memory = HYBRIDS[model_type]
    with caplog.at_level(logging.INFO):
        # the preempted requests swap (states and K/V)
        counts = check_family(folder, hf, prefix_caching=False, preemption_mode="swap")
    assert counts["preemptions"] > 0  # the attention group's growth preempts (check_family asserts it too)
    assert f"prefix caching is off: {architecture} keeps a recurrent state" in caplog.text
    # the state's memory per request and the pool blocks it takes beside the attention's per token, at start
    assert state_memory in caplog.text
    assert attention_memory in caplog.text


def test_hybrid_chunks_at_every_boundary_and_a_preempted_request_give_one_pass_ids(folder, one_pass):
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
def test_a_swapped_hybrid_request_goes_on_from_its_exact_state(folder, one_pass, budget, computed):
    """Swap preemption copies the request's state blocks and K/V blocks to the swap space and back into new blocks:
    it recomputes nothing and gives the one pass's ids (a lost or stale state or K/V changes them)."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=budget, preemption_mode="swap")
    swapped = greedy_runs(llm, [PROMPT, OTHERS[0]], preempt_at_step=3 if budget == 16 else 4, max_tokens=6)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.swap.num_swapped_out == 1 and scheduler.swap.num_swapped_in_tokens == computed
    assert scheduler.num_recomputed_tokens == 0 and scheduler.swap.num_free_slots == scheduler.swap.num_slots
    _assert_same_run(swapped, one_pass)


def test_a_hybrid_swap_space_too_small_recomputes(folder, one_pass):
    # one slot: a request's state blocks and its K/V blocks do not fit, so the preempted one is recomputed
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=16, preemption_mode="swap",
              swap_space_gb=1e-9)
    recomputed = greedy_runs(llm, [PROMPT, OTHERS[0]], preempt_at_step=3, max_tokens=6)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.swap.num_slots == 1 and scheduler.swap.num_swapped_out == 0
    assert scheduler.num_recomputed_tokens == 24
    _assert_same_run(recomputed, one_pass)


def test_hybrid_output_does_not_depend_on_its_batch_in_the_default_dtype(folder):
    alone = greedy_runs(LLM(str(folder), num_kv_blocks=32), [PROMPT])[0]
    # 5-token chunks; a pool of 24 blocks (a request's states take 8 of them in bfloat16 at 16 tokens a block)
    busy = LLM(str(folder), num_kv_blocks=24, max_num_batched_tokens=5)
    batched = greedy_runs(busy, [OTHERS[0], PROMPT, *OTHERS[1:]], preempt_at_step=4)
    assert batched[1] == alone  # the same bits


def test_hybrid_over_two_pipeline_stages_gives_the_one_rank_ids(folder):
    """Stage 0 holds a Mamba2 layer and the attention layer, stage 1 the other Mamba2 layer (Falcon-H1: its layer's
    mixer half on stage 0, its attention half on stage 1, which gets the stream both read from stage 0), each rank
    in a worker process with its own states and K/V; a batch of four gives the one-rank ids (2 ranks: about 3 s)."""
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
    arch = _matches_hf_on_two_prompts(path)
    assert arch.moe is None and arch.no_rope_layers == {0, 1} and arch.mamba_layers == {1}


@pytest.mark.parametrize("settings,gate_norm", [({"mamba_rms_norm": False}, "none"),
                                                ({"mamba_norm_before_gate": False}, "after_gate")])
def test_falcon_h1_with_its_other_gate_and_norm_placements_matches_hf(tmp_path, settings, gate_norm):
    # the module's Falcon-H1 norms the mixer's output before its gate; transformers' default has no norm
    # (y * silu(z) alone), and the norm may follow the gate; 2 layers (one layer's output feeding the next's two
    # halves), 2 prompts x 8 tokens
    arch = _matches_hf_on_two_prompts(make_tiny_hf_model(tmp_path, arch="falcon_h1", num_hidden_layers=2,
                                                         **settings))
    assert arch.mamba.gate_norm == gate_norm


def test_nemotron_h_floors_dt_at_time_step_min_as_hf_prefills_across_chunks(tmp_path):
    # time_step_min 0.05 with the mixers' initial dt (softplus(dt_bias)) drawn from [0.05, 0.1]: the floor clamps
    # many heads' dt. HF clamps it when it prefills (its forward over the whole prompt), the engine in every chunk
    # alike: its prompt logprobs are HF's, the prompt prefilled in chunks of 3 tokens. Float32, 1 prompt
    path = make_tiny_hf_model(tmp_path, arch="nemotron_h", time_step_min=0.05, time_step_max=0.1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    want = [float(rows[i, token]) for i, token in enumerate(PROMPT[1:])]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=3)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    got = [position[token].logprob for position, token in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert llm.llm_engine.arch.mamba.dt_min == 0.05


def _matches_hf_on_two_prompts(path):
    """Assert the engine gives HF float32's greedy ids and logprobs for 2 prompts x 8 tokens; the engine's arch."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [PROMPT, OTHERS[1]]
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64)
    for ids, (tokens, logprobs) in zip(prompts, greedy_runs(llm, prompts, max_tokens=8)):
        want_tokens, want_logprobs = hf_forced(hf, ids, tokens)
        assert list(tokens) == want_tokens
        assert max(abs(step[0][1] - want) for step, want in zip(logprobs, want_logprobs)) < 1e-4
    return llm.llm_engine.arch


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


@pytest.mark.parametrize("arch_config,setting,named", [
    (granite_hybrid_arch_config, {"time_step_limit": [0.0, 1.0]}, "time_step_limit"),
    (granite_hybrid_arch_config, {"hidden_act": "gelu"}, "hidden_act"),
    (granite_hybrid_arch_config, {"position_embedding_type": "alibi"}, "position_embedding_type"),
    (granite_hybrid_arch_config, {"num_hidden_layers": 2, "layer_types": ["mamba", "sliding_attention"]},
     "layer types"),
    (granite_hybrid_arch_config, {"position_embedding_type": "rope",
                                  "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "M*X"}, "letters"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "ME", "moe_latent_size": 32}, "moe_latent_size"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "ME", "n_routed_experts": 8, "n_group": 4,
                              "topk_group": 1, "num_experts_per_tok": 4}, "num_experts_per_tok"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "-M*"}, "must start with a mixer block"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "M*", "mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "M*", "mlp_bias": True}, "mlp_bias"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "M*", "mamba_hidden_act": "gelu"}, "hidden_act"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "M*", "mamba_dt_limit": [0.0, 1.0]}, "time_step_limit"),
    (nemotron_h_arch_config, {"hybrid_override_pattern": "M*", "sliding_window": 64}, "sliding_window"),
    (falcon_h1_arch_config, {"hidden_act": "gelu"}, "hidden_act"),
    (falcon_h1_arch_config, {"time_step_limit": [0.0, 1.0]}, "time_step_limit"),
    (falcon_h1_arch_config, {"projectors_bias": True}, "projectors_bias"),
    (falcon_h1_arch_config, {"mlp_bias": True}, "mlp_bias"),
    (falcon_h1_arch_config, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
    (falcon_h1_arch_config, {"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
    (falcon_h1_arch_config, {"mlp_multipliers": [1.0]}, "mlp_multipliers"),
])
def test_unsupported_hybrid_settings_are_refused(arch_config, setting, named):
    with pytest.raises(ValueError, match=named):
        arch_config(setting, {}, lambda: "float32")


def test_a_quantised_hybrid_cache_is_refused(model_type, folder):
    architecture = HYBRIDS[model_type][0]
    with pytest.raises(ValueError, match=f"kv_cache_dtype int8: {architecture}'s recurrent states"):
        LLM(str(folder), kv_cache_dtype="int8")


def test_speculation_keeps_the_states_of_accepted_proposals_only(folder):
    """Verified proposals run one at a time through the mixers; the states after the accepted ones are kept."""
    assert_speculation_changes_no_bit(str(folder), dict(num_kv_blocks=32))
