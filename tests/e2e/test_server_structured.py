"""Structured output and tool calling through `tokenmill serve`, driven by the openai client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess
from helpers.tiny_models import make_tiny_hf_model

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model"))
    server = ServerProcess(model, "--max-model-len", "512", "--num-kv-blocks", "256", "--served-model-name", "tiny",
                           log_path=tmp_path_factory.mktemp("logs") / "tiny.log")
    with server.running():
        yield OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0), server.url


def test_response_formats_on_completions_and_chat(tiny):
    client, _ = tiny
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    done = 0
    for seed in range(6):
        text = client.completions.create(model="tiny", prompt="A person:", max_tokens=60, temperature=1.0, seed=seed,
                                         extra_body={"response_format": fmt})
        chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=1.0, seed=seed,
                                              response_format={"type": "json_object"})
        if text.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text.choices[0].text), PERSON)
            done += 1
        if chat.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(chat.choices[0].message.content), dict)
            done += 1
    assert done >= 6


def test_guided_choice_and_regex_streamed_and_whole(tiny):
    client, _ = tiny
    choices = ["alpha", "beta gamma", "delta"]
    for seed in range(4):
        stream = client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, temperature=1.0, seed=seed,
                                           stream=True, extra_body={"guided_choice": choices})
        chunks = [c for c in stream if c.choices]
        assert "".join(c.choices[0].text for c in chunks) in choices
        assert chunks[-1].choices[0].finish_reason == "stop"
        reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=20, temperature=1.0, seed=seed,
                                               extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
        content = reply.choices[0].message.content
        assert len(content) == 6 and content[2] == "-" and content[:2].isupper() and content[3:].isdigit()


CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize("body, mentions", [
    ({"guided_json": {"type": "objec"}}, "invalid JSON schema"),
    ({"guided_regex": "[a-"}, "invalid regex"),
    ({"guided_grammar": "root ::= "}, "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "only one output constraint"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
    ({"tool_choice": "required"}, "requires tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, 'invalid parameters: Unsupported type "objec"'),
    # schemas that compile but admit nothing: $refs in a cycle, at the root, behind a required property, in
    # response_format and in a forced tool's parameters; a regex no text matches
    ({"guided_json": CYCLE}, "$ref #/$defs/a, #/$defs/b can only be finished through one another"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CYCLE}}}, "a cycle"),
    ({"guided_json": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}},
     "$ref # can only be finished through itself"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": CYCLE}, "required": ["x"], "$defs": CYCLE["$defs"]}}}],
      "tool_choice": "required"}, "tool 'f' has invalid parameters: no finite JSON value satisfies it"),
    ({"guided_regex": "[^\\s\\S]+"}, "it admits no output"),
    # an assistant's tool call whose arguments nest 50,000 deep (a parser would recurse once per level)
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 50000 + "]" * 50000}}]}, {"role": "tool", "tool_call_id": "c", "content": "1"}]},
     "tool call arguments is JSON nested more than 100 levels deep"),
])
def test_bad_constraints_are_400_naming_the_problem(tiny, body, mentions):
    _, url = tiny
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert mentions in response.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "still", "max_tokens": 2}).status_code == 200


def test_forced_tool_calls_whole_and_streamed(tiny):
    client, _ = tiny
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named,
                                           max_tokens=80, temperature=1.0, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                            max_tokens=80, temperature=1.0, seed=2, stream=True)
    chunks = [c for c in stream if c.choices]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    tool = WEATHER if calls[0].function.name == "get_weather" else CLOCK
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_go_back_into_the_conversation(tiny):
    client, _ = tiny
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=5, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.tool_calls is None and reply.usage.completion_tokens == 5


@pytest.mark.slow
def test_the_default_model_calls_the_required_tool(tmp_path):
    server = ServerProcess(None, "--max-model-len", "2048", log_path=tmp_path / "default.log")
    server.start()
    try:
        client = OpenAI(base_url=f"{server.wait_ready().url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="smollm2-135m-instruct", messages=ASK, tools=[WEATHER, CLOCK],
                                               tool_choice="required", max_tokens=60, temperature=0)
    finally:
        server.terminate()
        server.stop()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert "paris" in arguments["city"].lower()
