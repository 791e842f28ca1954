"""Speculative decoding end to end: greedy output is token-identical with it on or off, on mixed batches,
for n-gram and draft proposals; sampling keeps the target's distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

# prompts whose continuations repeat earlier text, so prompt lookup has something to propose
PROMPTS = ["one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. one",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):",
           "A much longer prompt about nothing in particular, repeated. " * 8,
           "Hello"]
# 24 tokens: every prompt takes several rounds of proposals after the long prompt's last chunk
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
# A 32-token budget chunks the long prompt, so its prefill chunks run beside the others' verifications.
# Float32 with float weights: there a row's result does not depend on how many rows its batch has. (With
# quantised weights in bfloat16 the products change method at 16 rows, so where two tokens nearly tie,
# what else runs decides between them, with or without speculation.)
ENGINE = dict(dtype="float32", quantization="none", max_num_batched_tokens=32, speculative_max_batch=8)


def run(llm: LLM) -> tuple[list[list[int]], list]:
    """Greedy outputs of PROMPTS (with one seeded sampling request in the same batch), and every step's schedule."""
    schedules = []
    execute = llm.llm_engine.runner.execute_async

    def recording(schedule):
        schedules.append([(s.request_id, len(s.spec_token_ids), s.sample) for s in schedule.scheduled])
        return execute(schedule)

    llm.llm_engine.runner.execute_async = recording
    outputs = llm.generate(PROMPTS + [PROMPTS[0]], [GREEDY] * len(PROMPTS) + [SAMPLED], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    return [o.outputs[0].token_ids for o in outputs[:len(PROMPTS)]], schedules


@pytest.fixture(scope="module")
def plain_run(make_smollm2):
    """The greedy outputs and the schedules without speculation."""
    return run(make_smollm2(**ENGINE))


@pytest.fixture(scope="module")
def plain_greedy(plain_run):
    return plain_run[0]


@pytest.mark.slow
def test_ngram_speculation_keeps_greedy_output_identical(make_smollm2, plain_run):
    llm = make_smollm2(**ENGINE, speculative_method="ngram", num_speculative_tokens=4)
    greedy, schedules = run(llm)
    plain_greedy, plain_schedules = plain_run
    assert greedy == plain_greedy
    spec = llm.llm_engine.stats().spec
    assert spec.accepted_tokens > 0 and spec.num_rounds > 0
    assert spec.emitted_tokens == spec.accepted_tokens + spec.num_rounds  # nothing stopped early (ignore_eos)
    mixed = [s for s in schedules if any(n for _, n, _ in s) and any(not sample for _, _, sample in s)]
    assert mixed, "some step must verify proposals beside another request's prefill chunk"
    # accepted proposals take requests through fewer steps (measured: 87 requests' steps against 125); the
    # steps themselves are as many, as long as the seeded request, which draws no proposal, runs
    assert sum(map(len, schedules)) < sum(map(len, plain_schedules))


@pytest.mark.slow
@pytest.mark.parametrize("num_layers", [None, 8])
def test_draft_model_speculation_keeps_greedy_output_identical(make_smollm2, smollm2_source, plain_greedy,
                                                               num_layers):
    # the default model drafting for itself, and a draft made of its first 8 layers (self-speculation)
    llm = make_smollm2(**ENGINE, speculative_method="draft", draft_model=smollm2_source.path,
                       draft_num_layers=num_layers, speculative_min_acceptance=0.0)
    greedy, _ = run(llm)
    assert greedy == plain_greedy
    spec = llm.llm_engine.stats().spec
    assert spec.num_rounds > 0
    if num_layers is None:
        assert spec.accepted_tokens > 0.8 * spec.draft_tokens  # the same weights agree nearly always
    assert llm.llm_engine.speculation.proposer.kv.pool.num_used_blocks == 0  # finished requests freed their draft KV


# ---------------------------------------------------------------------------------------- distribution
VOCAB = 32  # small enough that the tokens at one position fall into a few dozen well-filled categories


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2, vocab_size=VOCAB,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1))


def third_tokens(llm: LLM, count: int, **controls) -> Counter:
    """The third output token of `count` samples of one prompt (unseeded: a request with its own seed
    does not speculate; the engine's generator is seeded, so the counts are the same every run)."""
    params = [SamplingParams(max_tokens=4, ignore_eos=True, **controls) for _ in range(count)]
    outputs = llm.generate([[3, 17, 5, 9, 22]] * count, params, use_tqdm=False)
    return Counter(o.outputs[0].token_ids[2] for o in outputs)


def two_sample_p_value(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Chi-square test that two samples come from one distribution (rare categories pooled)."""
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= min_count]
    table = torch.tensor([[a[t] for t in common] + [sum(a.values()) - sum(a[t] for t in common)],
                          [b[t] for t in common] + [sum(b.values()) - sum(b[t] for t in common)]], dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.parametrize("controls", [dict(temperature=0.1),
                                      dict(temperature=0.15, top_k=12, top_p=0.9, min_p=0.02, presence_penalty=0.5)])
def test_sampling_with_a_draft_keeps_the_target_distribution(tiny_path, controls):
    # The tiny model's first layer drafts for it: the two distributions differ, so proposals are both
    # accepted and rejected. The third token is decided in the round that verifies the second and third.
    count = 2000
    engine = dict(dtype="float32", max_num_seqs=256)
    plain = third_tokens(LLM(tiny_path, **engine), count, **controls)
    llm = LLM(tiny_path, **engine, speculative_method="draft", draft_model=tiny_path, draft_num_layers=1,
              num_speculative_tokens=2, speculative_max_batch=256, speculative_min_acceptance=0.0)
    speculative = third_tokens(llm, count, **controls)
    spec = llm.llm_engine.stats().spec
    assert 0.2 * spec.draft_tokens < spec.accepted_tokens < 0.9 * spec.draft_tokens
    assert len(plain) > 5
    assert two_sample_p_value(plain, speculative) > 1e-3  # a seeded engine: this cannot flake


def test_an_aborted_request_frees_its_draft_kv_at_once(tiny_path):
    llm = LLM(tiny_path, dtype="float32", speculative_method="draft", draft_model=tiny_path,
              speculative_min_acceptance=0.0)
    engine = llm.llm_engine
    engine.add_request("a", [3, 17, 5, 9, 22], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    draft_pool = engine.speculation.proposer.kv.pool
    assert draft_pool.num_used_blocks > 0 and engine.stats().spec.num_rounds > 0
    engine.abort_request("a")
    assert draft_pool.num_used_blocks == 0
