"""Structured output: even a random-weight model, sampling at temperature 1, produces only valid output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.structured.spec import StructuredOutput

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["id", "status", "owner"],
     "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "status": {"enum": ["open", "closed", "stale"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                    "owner": {"type": "object", "additionalProperties": False, "required": ["name", "admin"],
                              "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                             "admin": {"type": "boolean"}}}}},
    {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "integer", "minimum": -50, "maximum": 50}},
    {"type": "object", "additionalProperties": False, "required": ["ok", "level", "weight"],
     "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
                    "weight": {"type": "number", "minimum": -2.5, "maximum": 10},
                    "note": {"type": ["string", "null"], "maxLength": 10}}},
]
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
COLOURS = ["red", "green", "blue", "dark orange"]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    return LLM(str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"))), dtype="float32", max_num_seqs=64)


def constraints():
    yield from ((StructuredOutput.json_schema(s), lambda text, s=s: jsonschema.validate(json.loads(text), s))
                for s in SCHEMAS)
    yield StructuredOutput("json_object"), lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)
    yield StructuredOutput.regex(DATE), lambda text: re.fullmatch(DATE, text) or pytest.fail(text)
    yield StructuredOutput.choice(COLOURS), lambda text: text in COLOURS or pytest.fail(text)


def test_a_hundred_sampled_outputs_all_parse_and_validate(tiny_llm):
    checks = list(constraints())
    prompts, params = [], []
    for i in range(100):
        spec, _ = checks[i % len(checks)]
        prompts.append(f"Request {i}:")
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_output=spec))
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    completed = 0
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "stop":  # a complete document; 'length' means max_tokens cut it
            checks[i % len(checks)][1](completion.text)
            completed += 1
    assert completed >= 90, f"only {completed} of 100 outputs completed within max_tokens"


def test_max_tokens_cutting_a_document_reports_length(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, structured_output=StructuredOutput.json_schema(SCHEMAS[0]))
    completion = tiny_llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3


def test_invalid_constraints_are_refused_naming_the_problem(tiny_llm):
    for spec, words in ((StructuredOutput.regex("[a-"), "invalid regex"),
                        (StructuredOutput.json_schema({"type": "objec"}), "invalid JSON schema"),
                        (StructuredOutput.grammar('root ::= "a" |'), "invalid grammar")):
        with pytest.raises(ValueError, match=words):
            tiny_llm.generate(["x"], SamplingParams(structured_output=spec), use_tqdm=False)
    assert tiny_llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # serving on


def test_grammars_compile_once_and_work_with_n_seeds_logprobs(tiny_llm):
    engine = tiny_llm.llm_engine
    spec = StructuredOutput.json_schema(SCHEMAS[2])
    before = engine.grammars.num_compilations
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=60, logprobs=2, structured_output=spec)
    first = tiny_llm.generate(["Same prompt"] * 2, params, use_tqdm=False)
    again = tiny_llm.generate(["Same prompt"], SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=60, logprobs=2,
                                                              structured_output=StructuredOutput.json_schema(SCHEMAS[2])),
                              use_tqdm=False)
    assert engine.grammars.num_compilations - before <= 1
    texts = [c.text for c in first[0].outputs]
    assert texts == [c.text for c in first[1].outputs] == [c.text for c in again[0].outputs]  # seeded
    for completion in first[0].outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), SCHEMAS[2])


GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'


def test_ebnf_grammar(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_output=StructuredOutput.grammar(GRAMMAR))
    for output in tiny_llm.generate(["g"] * 8, params, use_tqdm=False):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", completion.text), completion.text


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny_spec")))


def test_speculative_tokens_advance_the_grammar(tiny_path):
    # The tiny model drafts for itself: most proposals pass verification, and the grammar must mask
    # every verified position and follow the accepted tokens. Greedy output equals plain decoding.
    regex = StructuredOutput.regex(r"(ab|cd|[0-9]{2}){3,6}x")
    schema = StructuredOutput.json_schema(SCHEMAS[1])
    params = [SamplingParams(temperature=0, max_tokens=40, structured_output=s) for s in (regex, schema, regex)]
    prompts = ["one", "two", "three"]
    plain = LLM(tiny_path, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_path, dtype="float32", speculative_method="draft", draft_model=tiny_path,
              speculative_min_acceptance=0.0)
    speculative = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.stats().spec.accepted_tokens > 0
    for a, b in zip(plain, speculative):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"(ab|cd|[0-9]{2}){3,6}x", speculative[0].outputs[0].text)
    jsonschema.validate(json.loads(speculative[1].outputs[0].text), SCHEMAS[1])

    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_output=schema)
    for output in llm.generate(["s"] * 6, sampled, use_tqdm=False):
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS[1])


def test_a_constraint_after_a_token_leaves_the_output_free_until_it(tiny_path):
    # What a reasoning model's thinking gets: the grammar starts after the first `after_token` of the output
    # (its `</think>`). Greedy: the free tokens are the plain greedy ones up to that token, then the grammar
    # holds; drafting for itself, the speculative run walks the same tokens across the grammar's start.
    llm = LLM(tiny_path, dtype="float32")
    free = llm.generate(["one"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    start = next(i for i, token in enumerate(free) if i >= 2 and token not in free[:i])
    pattern = r"(ab|cd|[0-9]{2}){3,6}x"
    spec = StructuredOutput("regex", pattern, after_token=free[start])
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=spec)
    (plain,) = llm.generate(["one"], params, use_tqdm=False)
    assert plain.outputs[0].token_ids[:start + 1] == free[:start + 1]
    tail = llm.get_tokenizer().decode(plain.outputs[0].token_ids[start + 1:])
    assert re.fullmatch(pattern, tail) and plain.outputs[0].finish_reason == "stop"
    unused = next(token for token in range(100, 200) if token not in free)  # the grammar never starts
    never = SamplingParams(temperature=0, max_tokens=8,
                           structured_output=StructuredOutput("regex", pattern, after_token=unused))
    assert llm.generate(["one"], never, use_tqdm=False)[0].outputs[0].token_ids == free
    speculative = LLM(tiny_path, dtype="float32", speculative_method="draft", draft_model=tiny_path,
                      speculative_min_acceptance=0.0)
    assert speculative.generate(["one"], params, use_tqdm=False)[0].outputs[0].token_ids == plain.outputs[0].token_ids
