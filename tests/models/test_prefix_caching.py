"""Prefix caching end to end on a tiny model: greedy output never changes, whatever the cache did."""

from __future__ import annotations

import pytest

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 4
QUESTIONS = ["What is two plus two?", "Name a colour.", "Where is Paris?", "Spell cat.", "Count to three."]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

# also run without native kernels and at the lowest ISA level (`make test`)
pytestmark = pytest.mark.every_level


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="qwen2"))


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def run(llm, prompts, params=GREEDY):
    return tokens(llm.generate(prompts, params, use_tqdm=False))


@pytest.fixture(scope="module")
def reference(model_path):
    llm = LLM(model_path, prefix_caching=False, block_size=4, num_kv_blocks=512)
    return run(llm, [SYSTEM + q for q in QUESTIONS])


def test_cold_and_warm_cache_give_identical_tokens(model_path, reference):
    llm = LLM(model_path, block_size=4, num_kv_blocks=512)
    prompts = [SYSTEM + q for q in QUESTIONS]
    assert run(llm, prompts) == reference  # cold: the batch itself shares the system prompt
    hits_before = llm.llm_engine.kv_cache.prefix_hits
    assert run(llm, prompts) == reference  # warm
    assert [run(llm, p)[0] for p in prompts] == reference  # one at a time, fully warm
    assert llm.llm_engine.kv_cache.prefix_hits > hits_before


def test_evictions_and_preemptions_keep_tokens_identical(model_path, reference):
    llm = LLM(model_path, block_size=4, num_kv_blocks=24, max_num_batched_tokens=32)
    prompts = [SYSTEM + q for q in QUESTIONS]
    for _ in range(2):
        assert run(llm, prompts) == reference
    kv = llm.llm_engine.kv_cache
    assert kv.pool.num_evictions > 0 and llm.llm_engine.scheduler.num_preemptions_total > 0
    assert kv.pool.num_free_blocks == kv.num_blocks
    kv.pool.check_invariants()


def test_a_request_stopped_early_leaves_reusable_blocks(model_path, reference):
    llm = LLM(model_path, block_size=4, num_kv_blocks=512)
    first = SYSTEM + QUESTIONS[0]
    text = llm.generate(first, GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = llm.generate(first, SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)
    assert stopped[0].outputs[0].finish_reason == "stop"
    # the stopped request's blocks (prompt and the output up to the stop) are reused, not re-derived
    assert run(llm, [first]) == reference[:1]
    assert run(llm, [first + stopped[0].outputs[0].text]) == run(
        LLM(model_path, prefix_caching=False, block_size=4, num_kv_blocks=512), [first + stopped[0].outputs[0].text])


def test_prompt_logprobs_are_complete_on_a_warm_cache(model_path):
    llm = LLM(model_path, block_size=4, num_kv_blocks=512)
    prompt = SYSTEM + QUESTIONS[1]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    cold = llm.generate(prompt, params, use_tqdm=False)[0]
    warm = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(warm.prompt_logprobs) == len(warm.prompt_token_ids) == len(cold.prompt_logprobs)
    for position in range(1, len(cold.prompt_token_ids)):
        token = cold.prompt_token_ids[position]
        assert warm.prompt_logprobs[position][token].logprob == pytest.approx(
            cold.prompt_logprobs[position][token].logprob, abs=1e-4)


def test_second_tier_brings_evicted_prefixes_back_with_identical_tokens(model_path, reference, tmp_path):
    llm = LLM(model_path, block_size=4, num_kv_blocks=24, secondary_kv_gb=0.001,
              secondary_kv_folder=str(tmp_path))
    flood = [[7 + i] * 80 for i in range(2)]
    for index, question in enumerate(QUESTIONS[:3]):
        assert run(llm, [SYSTEM + question]) == reference[index: index + 1]
        run(llm, flood, SamplingParams(max_tokens=2))  # pushes the system prompt out of the pool
    kv = llm.llm_engine.kv_cache
    assert kv.pool.num_evictions > 0 and kv.tier.num_saves > 0
    assert kv.tier.num_hits > 0, "the system prompt must come back from the second tier"
    stats = llm.llm_engine.stats()
    assert stats.secondary_cache_hits == kv.tier.num_hits * 4
