"""Mamba2 (Mamba2ForCausalLM): a tiny random checkpoint (2 layers, hidden 64, 8 heads of 16, 2 groups of state 16,
scan chunks of 8) gives HF float32's greedy ids and logprobs plain, chunked and batched; its recurrent state
carries across chunks split at every boundary, restarts cleanly after a recompute preemption and goes on from its
exact state after a swap preemption, mid-prefill or in decode (the same ids as one pass); a request's output in the
default dtype does not depend on its batch; with speculation (proposals of every accepted length, a swap preemption)
the ids and logprobs are the same bits as without; prefix caching is turned off, saying why; speculation on two
stages and a Mamba2 draft are refused.

Cost: check_family about 4 s (HF one uncached forward pass a prompt: helpers/engine_probe.hf_forced), the
engine runs below 2 prompts x 12 tokens each; the checkpoint and the HF model are built once per module."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.family_check import check_family
from helpers.forced_preemption import OTHERS, PROMPT
from helpers.forced_preemption import greedy_runs as _run
from helpers.scripted_proposals import assert_speculation_changes_no_bit
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM
from tokenmill.core.kv_spec import StateCacheSpec
from tokenmill.layers.mamba2_mixer import Mamba2Mixer, RecurrentState, StateChunk
from tokenmill.models.loader.hf_config import arch_config_from_hf
from tokenmill.models.loader.hf_mamba2 import mamba2_arch_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("mamba2"), arch="mamba2")


@pytest.fixture(scope="module")
def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_pass(folder):
    """The float32 ids and logprobs of PROMPT and OTHERS[0] run together, nothing preempted."""
    return _run(LLM(str(folder), dtype="float32", num_kv_blocks=8), [PROMPT, OTHERS[0]])


def _assert_same_run(run, want):
    """The same ids as `want`, logprobs within float32 noise (the runs split their chunks differently)."""
    for (ids, logprobs), (want_ids, want_logprobs) in zip(run, want):
        assert ids == want_ids
        worst = max(abs(a[1] - b[1]) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y))
        assert worst < 1e-4


def test_mamba2_matches_hf_plain_chunked_and_batched(folder, hf, caplog):
    with caplog.at_level(logging.INFO):
        check_family(folder, hf, prefix_caching=False, preempts=False)
    assert "prefix caching is off: Mamba2ForCausalLM keeps a recurrent state" in caplog.text
    assert "KiB per request whatever its length" in caplog.text  # the state's memory, logged at start


def test_chunks_at_every_boundary_and_a_preempted_request_give_one_pass_ids(folder, one_pass):
    """One-token chunks split the prompt at every boundary; a preemption mid-prefill drops the request's state and it
    recomputes from zero. Float32: the ids are the one pass's, the logprobs within float32 noise."""
    prompts = [PROMPT, OTHERS[0]]
    every_boundary = _run(LLM(str(folder), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=1), prompts)
    preempted = _run(LLM(str(folder), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=7,
                         preemption_mode="recompute"), prompts, preempt_at_step=3)
    for run in (every_boundary, preempted):
        _assert_same_run(run, one_pass)


# 16-token steps: after 3 steps the victim (OTHERS[0], admitted second) is 24 tokens into its 30-token prompt, beside
# PROMPT's decode; 64-token steps: both prompts in the first step, the victim preempted after 3 decode steps (33)
@pytest.mark.parametrize("budget,computed", [(16, 24), (64, 33)], ids=["mid_prefill", "in_decode"])
def test_a_swapped_request_goes_on_from_its_exact_state(folder, one_pass, budget, computed):
    """Swap preemption copies the request's state page to the swap space and back into a new page: it recomputes
    nothing and gives the one pass's ids (a lost or stale state changes them)."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=budget, preemption_mode="swap")
    swapped = _run(llm, [PROMPT, OTHERS[0]], preempt_at_step=3 if budget == 16 else 4)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.swap.num_swapped_out == 1 and scheduler.swap.num_swapped_in_tokens == computed
    assert scheduler.num_recomputed_tokens == 0 and scheduler.swap.num_free_slots == scheduler.swap.num_slots
    _assert_same_run(swapped, one_pass)


def test_a_request_output_does_not_depend_on_its_batch_in_the_default_dtype(folder):
    alone = _run(LLM(str(folder), num_kv_blocks=8), [PROMPT])[0]
    busy = LLM(str(folder), num_kv_blocks=3, max_num_batched_tokens=5)  # 5-token chunks; two requests wait
    batched = _run(busy, [OTHERS[0], PROMPT, *OTHERS[1:]])
    assert batched[1] == alone  # the same bits


def test_mixer_state_split_at_every_boundary_equals_one_chunk():
    """The scan and the conv continue from the stored state exactly: a prompt split in two at each position gives the
    one chunk's outputs and final state (float32 noise)."""
    # 4 heads of 16 in 2 groups, scan chunks of 4: a split lands inside and on chunk boundaries
    arch = mamba2_arch_config({"hidden_size": 32, "num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 2,
                               "chunk_size": 4, "num_hidden_layers": 1, "vocab_size": 10}, {}, lambda: "float32")
    torch.manual_seed(0)
    mixer = Mamba2Mixer(arch.hidden_size, arch.mamba)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    x = torch.randn(20, arch.hidden_size)
    m = arch.mamba
    spec = StateCacheSpec(m.conv_kernel, m.conv_dim, m.num_heads, m.head_dim, m.state_size, 4)
    with torch.inference_mode():
        whole_state = RecurrentState(2, spec, torch.float32, torch.device("cpu"))
        whole = mixer(x, whole_state, [StateChunk(0, 20, 1, True)])
        for split in range(1, 20):
            state = RecurrentState(2, spec, torch.float32, torch.device("cpu"))
            state.ssm.fill_(7.0)  # a previous owner's state: a fresh chunk must not read it
            first = mixer(x[:split], state, [StateChunk(0, split, 1, True)])
            second = mixer(x[split:], state, [StateChunk(0, 20 - split, 1, False)])
            torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(state.ssm[1], whole_state.ssm[1], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(state.conv[1], whole_state.conv[1])


def test_unsupported_settings_are_refused(folder):
    with pytest.raises(ValueError, match="time_step_limit"):
        mamba2_arch_config({"time_step_limit": [0.0, 1.0]}, {}, lambda: "float32")
    with pytest.raises(ValueError, match="hidden_act"):
        mamba2_arch_config({"hidden_act": "gelu"}, {}, lambda: "float32")
    assert arch_config_from_hf(folder).mamba.conv_dim == 128 + 2 * 2 * 16
    # speculation rolls states back in the sampling rank's process; a draft's own states are never rolled back
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="keeps a recurrent state per request, .* it runs on one rank"):
        LLM(str(folder), pipeline_parallel_size=2, speculative_config=ngram)
    with pytest.raises(ValueError, match=r"the draft model .* \(Mamba2ForCausalLM\) keeps a recurrent state"):
        LLM(str(folder), speculative_config={"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3})


def test_speculation_keeps_the_states_of_accepted_proposals_only(folder):
    """Verified proposals run one at a time through the mixer; the state after the accepted ones is kept."""
    assert_speculation_changes_no_bit(str(folder), dict(num_kv_blocks=32))
