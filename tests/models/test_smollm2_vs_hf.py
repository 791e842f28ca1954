"""The real default model (SmolLM2-135M-Instruct GGUF) against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_probe import hf_greedy_tokens_from
from tokenmill import SamplingParams

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old clockmaker who",
    "List three fruits:",
    "Translate to French: The cat sleeps on the warm windowsill while the rain falls outside.",
    "In 1969, the first humans landed on the Moon. The mission was called Apollo 11, and the astronauts "
    "were Neil Armstrong, Buzz Aldrin and Michael Collins. Armstrong's first words on the surface were",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
]
NUM_TOKENS = 32  # float32 greedy equals HF token for token; 32 keeps the suite fast on AVX2 machines


def greedy(max_tokens=NUM_TOKENS, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2, smollm2):
    """HF's greedy tokens for every prompt, from one HF forward pass per prompt over the batched engine's tokens
    where they are HF's own (helpers.engine_probe.hf_greedy_tokens_from)."""
    tokenizer = smollm2.get_tokenizer()
    candidates = token_ids(smollm2.generate(PROMPTS, greedy(), use_tqdm=False))
    return [hf_greedy_tokens_from(hf_smollm2, tokenizer(p).input_ids, NUM_TOKENS, list(candidate))
            for p, candidate in zip(PROMPTS, candidates)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_greedy_matches_hf(smollm2, hf_greedy):
    outputs = smollm2.generate(PROMPTS, greedy())
    assert token_ids(outputs) == hf_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_alone_and_warm_prefix_cache_equal_batched(smollm2, hf_greedy):
    hits_before = smollm2.llm_engine.kv_cache.prefix_hits
    alone = [token_ids(smollm2.generate(p, greedy()))[0] for p in PROMPTS[:3]]
    assert alone == hf_greedy[:3]
    assert smollm2.llm_engine.kv_cache.prefix_hits > hits_before, "the re-sent prompts hit the prefix cache"


def test_chunked_prefill_gives_the_same_tokens(make_smollm2, hf_greedy):
    llm = make_smollm2(dtype="float32", quantization="none", max_num_batched_tokens=16)
    assert token_ids(llm.generate(PROMPTS, greedy())) == hf_greedy


def test_preemption_gives_the_same_tokens(make_smollm2, hf_greedy):
    llm = make_smollm2(dtype="float32", quantization="none", num_kv_blocks=24, block_size=8)
    assert token_ids(llm.generate(PROMPTS, greedy())) == hf_greedy
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions_total > 0, "a 192-token pool must preempt 8 sequences"
    assert engine.kv_cache.pool.num_free_blocks == 24


def test_logprobs_match_hf_log_softmax(smollm2, hf_smollm2):
    prompt = PROMPTS[3]
    out = smollm2.generate(prompt, greedy(max_tokens=8, logprobs=5, prompt_logprobs=3))[0]
    full = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([full])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    n_prompt = len(out.prompt_token_ids)
    for step, entry in enumerate(out.outputs[0].logprobs):
        token = out.outputs[0].token_ids[step]
        expected = reference[n_prompt - 1 + step]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-3)
        assert entry[token].rank == 1
        top5 = expected.topk(5).indices.tolist()
        assert set(top5) <= set(entry)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == n_prompt
    for position in range(1, n_prompt):
        token = out.prompt_token_ids[position]
        value = out.prompt_logprobs[position][token].logprob
        assert value == pytest.approx(reference[position - 1, token].item(), abs=1e-3)
