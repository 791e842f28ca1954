"""What users rely on from the engine, on a tiny random-weight model (fast)."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_probe import model_logits
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because"
OTHERS = ["Hello", "A much longer prompt about nothing in particular, repeated. " * 3, "1 2 3"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama")
    return LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=512)


def free_blocks_are_all(llm):
    engine = llm.llm_engine
    engine.kv_cache.pool.check_invariants()
    return engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks


def test_seed_gives_the_same_text_alone_or_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].outputs[0]
    batch = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 3 + [params]
    crowded = llm.generate(OTHERS + [PROMPT], batch)[-1].outputs[0]
    assert crowded.token_ids == alone.token_ids and crowded.text == alone.text
    other_seed = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone.token_ids


def test_stop_string_across_tokens_is_cut_from_the_text(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # a stop string that starts inside token 5 and ends inside token 7
    head = tokenizer.decode(base.token_ids[:5])
    tail = tokenizer.decode(base.token_ids[:7])
    start = max(len(head) - 2, 1)
    stop = tail[start:len(tail) - 1]
    assert stop and base.text.find(stop) >= start - 1
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0].outputs[0]
    cut = base.text.find(stop)
    assert out.text == base.text[:cut]
    assert stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[:cut + len(stop)]
    assert free_blocks_are_all(llm)


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id],
                                               min_tokens=first + 3))[0].outputs[0]
    assert len(held.token_ids) >= first + 3
    assert stop_id not in held.token_ids[:first + 3]


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_n_samples_share_the_prompt_and_match_single_seeded_runs(llm):
    prompt = "Once upon a time " * 6
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    single = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert free_blocks_are_all(llm)


def test_abort_returns_blocks_and_the_engine_keeps_serving(llm):
    engine = llm.llm_engine
    for i, prompt in enumerate(OTHERS):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(max_tokens=100, ignore_eos=True, n=2))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.pool.num_free_blocks < engine.kv_cache.num_blocks
    engine.abort_request([f"abort-{i}" for i in range(len(OTHERS))])
    assert not engine.has_unfinished_requests()
    assert free_blocks_are_all(llm)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_oversized_requests_raise_with_both_numbers(llm):
    with pytest.raises(ValueError, match=r"600.*512"):
        llm.generate([5] * 600, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"512.*1010"):
        llm.generate([5] * 10, SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 10**9]], SamplingParams(max_tokens=1))
    assert free_blocks_are_all(llm)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_each_request_is_checked_against_the_scheduler_once(llm, monkeypatch):
    scheduler = llm.llm_engine.scheduler
    sizes = []
    check = scheduler.check_admissible
    monkeypatch.setattr(scheduler, "check_admissible", lambda *args: (sizes.append(args), check(*args))[1])
    outputs = llm.generate([PROMPT, "Hello"], SamplingParams(max_tokens=3, n=2, ignore_eos=True))
    assert [len(o.outputs) for o in outputs] == [2, 2]
    prompt_lens = [len(o.prompt_token_ids) for o in outputs]
    assert sizes == [(n, n + 3) for n in prompt_lens]


def test_max_tokens_none_fills_the_context(llm):
    out = llm.generate([5] * 500, SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_greedy_logprobs_rank_first(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1 and len(entry) == 3
        assert entry[token].logprob == max(e.logprob for e in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.get_tokenizer()(expected, add_special_tokens=False).input_ids
    assert "<|im_start|>assistant" in expected


def test_priority_runs_first_when_one_sequence_fits(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="llama")
    llm = LLM(str(path), dtype="float32", max_num_seqs=1, num_kv_blocks=64, schedule_policy="priority")
    engine = llm.llm_engine
    engine.add_request("low", "a b c", SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
    engine.add_request("high", "a b c", SamplingParams(max_tokens=3, ignore_eos=True), priority=-5)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_priority_needs_the_priority_policy(tmp_path):
    engine = LLM(str(make_tiny_hf_model(tmp_path, arch="llama")), dtype="float32", num_kv_blocks=64).llm_engine
    with pytest.raises(ValueError, match="schedule_policy 'priority'"):
        engine.add_request("r", "a b c", SamplingParams(max_tokens=3), priority=1)


def test_bfloat16_logits_track_float32(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="qwen2")
    ids = list(range(300, 360))
    exact = model_logits(LLM(str(path), dtype="float32").llm_engine, ids)
    bf16_engine = LLM(str(path), dtype="bfloat16").llm_engine
    assert bf16_engine.runner.kv_caches[0].dtype == torch.bfloat16
    approx = model_logits(bf16_engine, ids)
    similarity = torch.nn.functional.cosine_similarity(exact, approx, dim=-1)
    assert similarity.min() > 0.99
