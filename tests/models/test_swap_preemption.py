"""Preemption by swapping: a tiny pool and long contexts force preemptions; swapped requests come back with
their KV copied, not recomputed, and every output (ids and logprobs, default dtype) equals the run that
never preempted."""

from __future__ import annotations

import pytest

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

PROMPTS = [list(range(100 + 7 * i, 160 + 7 * i)) for i in range(6)]  # 60 tokens each
PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("swap") / "model"))


def _run(model: str, **options):
    llm = LLM(model, block_size=16, max_num_seqs=6, **options)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    scheduler = llm.llm_engine.scheduler
    result = ([(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outputs], scheduler.num_preemptions_total, scheduler.num_recomputed_tokens, scheduler.swap)
    llm.shutdown()
    return result


def test_swapping_gives_the_unpreempted_output_and_recomputes_nothing(model):
    reference, preemptions, _, _ = _run(model, num_kv_blocks=512)
    assert preemptions == 0
    # 24 blocks of 16 tokens hold three of the six 124-token sequences: the others are preempted
    recomputed, preempted, recomputed_tokens, _ = _run(model, num_kv_blocks=24, preemption_mode="recompute")
    assert preempted > 0 and recomputed_tokens > 0 and recomputed == reference
    for mode in ("swap", "auto"):  # auto swaps on a CPU: copying is far cheaper than computing again
        swapped, preempted, recomputed_tokens, swap = _run(model, num_kv_blocks=24, preemption_mode=mode)
        assert preempted > 0 and swap.num_swapped_out > 0 and swap.num_swapped_in_tokens > 0
        assert recomputed_tokens == 0, mode
        assert swapped == reference, mode
        assert swap.num_free_slots == swap.num_slots  # every slot came back


def test_a_full_swap_space_falls_back_to_recompute(model):
    reference, _, _, _ = _run(model, num_kv_blocks=512)
    # one slot of 16 tokens: no preempted sequence fits, so each is recomputed
    swapped, preempted, recomputed_tokens, swap = _run(model, num_kv_blocks=24, preemption_mode="swap",
                                                       swap_space_gb=1e-9)
    assert preempted > 0 and recomputed_tokens > 0 and swap.num_swapped_out == 0
    assert swapped == reference


def test_swap_refused_for_sliding_window_models(tmp_path):
    folder = make_tiny_hf_model(tmp_path / "gemma", "gemma3_text")
    with pytest.raises(ValueError, match="sliding-window layers"):
        LLM(str(folder), num_kv_blocks=64, preemption_mode="swap")
    LLM(str(folder), num_kv_blocks=64)  # auto: recompute for it
