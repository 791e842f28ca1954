"""Async scheduling gives what one step at a time gives: ids, logprobs, finish reasons and token counts, for
requests that stop on EOS, max_tokens, a stop string and min_tokens, a JSON schema, seeded sampling with and
without penalties, under preemption and with n-gram speculation (the Triton backend's graph path, where
placeholders are filled into the static input buffer, is tests/models/test_triton_backend.py's).

The tiny model's EOS is set to a token its greedy output for the first prompt holds, so that request stops
on EOS with the placeholder of its next token already scheduled."""

from __future__ import annotations

import json

import pytest

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.structured.spec import StructuredOutput

PROMPTS = ["The quick brown fox jumps over the lazy dog because", "Hello", "1 2 3 4 5 6 7",
           "A much longer prompt about nothing in particular, repeated. " * 2, "Once upon a time",
           "Give me a JSON object:", "Colours of the rainbow are", "The end"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# block_size 8, 24 blocks: the eight requests (up to 26 prompt + 64 output tokens each) cannot all fit
ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=24, max_model_len=256, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(the tiny model's path with EOS among its greedy tokens, the sampling parameters of the eight requests)."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("eos"), arch="llama")
    probe = LLM(str(path), dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first, fourth = (o.outputs[0] for o in probe.generate([PROMPTS[0], PROMPTS[3]], greedy, use_tqdm=False))
    eos = first.token_ids[9]  # the weights are the same whatever EOS is: the greedy tokens stay
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, "eos_token_id": eos, "pad_token_id": eos}))
    stop = probe.get_tokenizer().decode(fourth.token_ids[6:8])
    params = [SamplingParams(temperature=0, max_tokens=64, logprobs=2),  # EOS at its tenth token
              SamplingParams(temperature=1.0, seed=11, max_tokens=64, logprobs=1),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=64, stop=[stop], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, min_tokens=20, logprobs=0),
              SamplingParams(temperature=0, max_tokens=64, structured_output=StructuredOutput.json_schema(SCHEMA)),
              SamplingParams(temperature=0.8, seed=5, max_tokens=64, presence_penalty=0.5, logprobs=1),
              SamplingParams(temperature=1.0, seed=3, top_k=20, max_tokens=64, ignore_eos=True)]
    return str(path), params


def summary(outputs) -> list[tuple]:
    """What a user gets of each request: ids, logprobs, text, finish reason and prompt length."""
    return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs), o.outputs[0].text, o.outputs[0].finish_reason,
             len(o.prompt_token_ids)) for o in outputs]


def run(path: str, params, **options):
    """The eight requests' outputs, and how many chunks ran with a placeholder."""
    llm = LLM(path, **{**ENGINE, **options})
    engine = llm.llm_engine
    placeholders = []
    apply = engine.runner.input_batch.apply

    def counted(schedule):
        items = apply(schedule)
        placeholders.append(sum(item.placeholder for item in items))
        return items

    engine.runner.input_batch.apply = counted
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return summary(outputs), sum(placeholders), engine


@pytest.fixture(scope="module")
def one_step_at_a_time(model):
    path, params = model
    got, placeholders, engine = run(path, params, async_scheduling=False)
    assert placeholders == 0 and engine.scheduler.num_preemptions_total > 0
    return got


def test_async_scheduling_gives_every_request_what_one_step_at_a_time_gives(model, one_step_at_a_time):
    path, params = model
    got, placeholders, engine = run(path, params, async_scheduling=True)
    assert got == one_step_at_a_time
    reasons = [finish for _, _, _, finish, _ in got]
    assert reasons[0] == "stop" and len(got[0][0]) == 10  # stopped on EOS, the surplus token dropped
    assert reasons[2] == "length" and len(got[2][0]) == 7
    assert reasons[3] == "stop" and reasons[7] == "length" and len(got[7][0]) == 64
    assert placeholders > 50 and engine.scheduler.num_preemptions_total > 0
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks and not engine.scheduler.in_flight


def test_async_scheduling_with_ngram_speculation_gives_the_speculative_engines_output(model):
    path, params = model
    speculative = dict(speculative_method="ngram", num_speculative_tokens=3)
    expected, _, _ = run(path, params, async_scheduling=False, **speculative)
    got, placeholders, _ = run(path, params, async_scheduling=True, **speculative)
    assert got == expected and placeholders == 0  # every request proposes from its last token: none runs ahead


def test_async_scheduling_on_several_ranks_is_refused_at_start(model):
    path, _ = model
    with pytest.raises(ValueError, match="async_scheduling: .*one rank"):
        LLM(path, **ENGINE, async_scheduling=True, distributed_executor_backend="mp")
