"""Anthropic's Messages API through `tokenmill serve`, driven by the official `anthropic` SDK, unmodified; and a
reasoning model's thinking and tool calls through all three chat APIs (Chat Completions, Responses, Messages).

The server runs a tiny random Qwen3 with Qwen3's chat template and `--reasoning-parser qwen3`. Greedy
output through /v1/messages and /v1/responses must be chat's for the same conversation, token for token.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess
from helpers.tiny_models import make_tiny_reasoning_model

GREEDY = {"temperature": 0}
SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                 "unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER_SCHEMA}
FAKE_THINKING = r"<think>\nI am thinking[.]\n</think>\n\nHello[.]"
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_reasoning_model(tmp_path_factory.mktemp("tiny") / "model")
    proc = ServerProcess(str(model), "--max-model-len", "512", "--num-kv-blocks", "256", "--served-model-name", "tiny",
                         "--reasoning-parser", "qwen3", log_path=tmp_path_factory.mktemp("logs") / "server.log")
    with proc.running():
        yield proc


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def openai_client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def sse_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of every event of a streamed response, as sent."""
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_text_whole_and_streamed_equal_chat_token_for_token(server, claude, openai_client):
    message = claude.messages.create(model="tiny", max_tokens=12, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    chat = openai_client.chat.completions.create(model="tiny", max_tokens=12, temperature=0,
                                                 messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and chat.choices[0].finish_reason == "length"
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens == 12
    assert claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=ASK).input_tokens == \
        chat.usage.prompt_tokens

    body = {"model": "tiny", "max_tokens": 12, "system": SYSTEM, "messages": ASK, "stream": True, **GREEDY}
    events = sse_events(f"{server.url}/v1/messages", body)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == chat.usage.prompt_tokens
    assert "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta") == \
        message.content[0].text
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 12

    with claude.messages.stream(model="tiny", max_tokens=12, system=SYSTEM, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.usage.output_tokens == 12


def test_stop_sequences_end_the_turn_and_name_the_sequence(claude):
    free = claude.messages.create(model="tiny", max_tokens=12, messages=ASK, extra_body=GREEDY).content[0].text
    word = free.split()[2]
    cut = claude.messages.create(model="tiny", max_tokens=12, messages=ASK, stop_sequences=[word], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == free[:free.index(word)]


def test_tool_round_trip_whole_and_streamed(server, claude, openai_client):
    # thinking off: a forced call's grammar starts after the thinking, which a random model never ends
    call = claude.messages.create(model="tiny", max_tokens=60, messages=ASK, tools=[WEATHER], thinking=NO_THINKING,
                                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert call.stop_reason == "tool_use"
    (use,) = [block for block in call.content if block.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)

    with claude.messages.stream(model="tiny", max_tokens=60, messages=ASK, tools=[WEATHER], thinking=NO_THINKING,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [("get_weather", use.input)]
    body = {"model": "tiny", "max_tokens": 60, "messages": ASK, "tools": [WEATHER], "stream": True,
            "thinking": NO_THINKING, "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY}
    events = sse_events(f"{server.url}/v1/messages", body)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    pieces = [data["delta"]["partial_json"] for name, data in events
              if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(pieces)) == use.input
    assert [data["delta"]["stop_reason"] for name, data in events if name == "message_delta"] == ["tool_use"]

    answered = [*ASK, {"role": "assistant", "content": call.content},  # the SDK's blocks, sent back as they came
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21."}]}]
    answer = claude.messages.create(model="tiny", max_tokens=10, messages=answered, tools=[WEATHER],
                                    extra_body=GREEDY)
    chat = openai_client.chat.completions.create(
        model="tiny", max_tokens=10, temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER_SCHEMA}}],
        messages=[*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21."}])
    text = "".join(block.text for block in answer.content if block.type == "text")
    assert text == (chat.choices[0].message.content or "")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert claude.messages.count_tokens(model="tiny", messages=answered, tools=[WEATHER]).input_tokens == \
        chat.usage.prompt_tokens


def test_thinking_becomes_thinking_blocks_whole_and_streamed(server, claude, openai_client):
    # thinking switched off, so the regex holds from the first token and can write a fake thought
    forced = {**GREEDY, "guided_regex": FAKE_THINKING}
    message = claude.messages.create(model="tiny", max_tokens=40, messages=ASK, thinking={"type": "disabled"},
                                     extra_body=forced)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
        [("thinking", "\nI am thinking.\n"), ("text", "\n\nHello.")]
    assert message.stop_reason == "end_turn"
    chat = openai_client.chat.completions.create(model="tiny", max_tokens=40, messages=ASK, temperature=0,
                                                 extra_body={"guided_regex": FAKE_THINKING,
                                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.choices[0].message.reasoning_content == "\nI am thinking.\n"
    assert chat.choices[0].message.content == "\n\nHello."

    body = {"model": "tiny", "max_tokens": 40, "messages": ASK, "stream": True, "thinking": {"type": "disabled"},
            **forced}
    events = sse_events(f"{server.url}/v1/messages", body)
    blocks = [(data["index"], data["content_block"]["type"]) for name, data in events if name == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text")]
    thinking = "".join(d["delta"].get("thinking", "") for n, d in events if n == "content_block_delta")
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert (thinking, text) == ("\nI am thinking.\n", "\n\nHello.")
    with claude.messages.stream(model="tiny", max_tokens=40, messages=ASK, thinking={"type": "disabled"},
                                extra_body=forced) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(include={"type", "thinking", "text"}) for b in final.content] == \
        [b.model_dump(include={"type", "thinking", "text"}) for b in message.content]


def test_constraints_wait_for_the_end_of_the_thinking(openai_client):
    # every token is pushed to `<think>`: the output opens a thought and never closes it, so the regex
    # (which admits no `<think>`) never starts; the answer is empty and nothing failed
    chat = openai_client.chat.completions.create(model="tiny", max_tokens=4, messages=ASK, temperature=0,
                                                 logit_bias={"49152": 100}, extra_body={"guided_regex": "Hello[.]"})
    assert chat.choices[0].message.reasoning_content == "<think>" * 3
    assert not chat.choices[0].message.content and chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, says", [
    ({"messages": ASK, "max_tokens": 5, "bogus": 1}, "'bogus' is not supported"),
    ({"messages": ASK}, "'max_tokens' is required"),
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                   "image/png", "data": "aGk="}}]}], "max_tokens": 5}, "'tiny' takes no images"),
    ({"messages": ASK, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search",
                                                   "input_schema": {}}]}, "server tool"),
    ({"messages": ASK, "max_tokens": 5, "tools": [WEATHER], "tool_choice": {"type": "tool"}}, "needs a name"),
    ({"messages": ASK, "max_tokens": 5, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "'nope'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                 "input": {}}]}], "max_tokens": 5}, "cannot hold tool_use"),
    ({"messages": ASK, "max_tokens": 5, "temperature": 3}, "temperature"),
    ({"messages": ASK, "max_tokens": 5, "guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
     "cycle"),
    ({"messages": ASK, "max_tokens": 5, "chat_template_kwargs": {"tools": []}}, "may not set tools"),
])
def test_bad_requests_get_400_in_anthropics_shape(server, body, says):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert says in response.json()["error"]["message"], response.json()
    counted = {k: v for k, v in body.items() if k in ("messages", "tools", "tool_choice", "bogus")}
    if counted.get("messages") != ASK or counted.keys() - {"messages"}:  # what count_tokens also refuses
        response = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": "tiny", **counted}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_the_sdk_raises_its_own_errors(claude):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-opus", max_tokens=5, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model="tiny", max_tokens=0, messages=ASK)
    deep = "[" * 20000 + "]" * 20000  # JSON text under the 64 KiB bound on a constraint
    with pytest.raises(anthropic.BadRequestError, match="nest"):
        claude.messages.create(model="tiny", max_tokens=5, messages=ASK, extra_body={"guided_json": deep})


def test_a_tool_use_input_nested_50000_deep_is_a_400(server):
    deep = '{"a":' * 50000 + "1" + "}" * 50000  # no client can even build this body: it is sent as text
    body = ('{"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
            '"content": [{"type": "tool_use", "id": "t", "name": "f", "input": ' + deep + '}]}]}')
    response = httpx.post(f"{server.url}/v1/messages", content=body, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert "nest" in response.json()["error"]["message"]


def test_chat_streams_thinking_as_reasoning_content_deltas(openai_client):
    stream = openai_client.chat.completions.create(
        model="tiny", max_tokens=40, messages=ASK, temperature=0, stream=True,
        extra_body={"guided_regex": FAKE_THINKING, "chat_template_kwargs": {"enable_thinking": False}})
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert thinking == "\nI am thinking.\n"
    assert "".join(d.content or "" for d in deltas) == "\n\nHello."
    assert all("think>" not in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)
    hidden = openai_client.chat.completions.create(
        model="tiny", max_tokens=40, messages=ASK, temperature=0,
        extra_body={"guided_regex": FAKE_THINKING, "chat_template_kwargs": {"enable_thinking": False},
                    "include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    assert hidden.choices[0].message.content == "\n\nHello."


def test_auto_tool_calls_in_the_models_own_syntax_stream_as_deltas(openai_client):
    # Qwen3's template names <tool_call>, so --tool-call-parser auto reads Hermes calls; the call is the model's
    # own text here (a regex writes it), not a grammar-enforced one
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    regex = re.escape("Let me check.\n" + call)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
    extra = {"guided_regex": regex, "chat_template_kwargs": {"enable_thinking": False}}
    whole = openai_client.chat.completions.create(model="tiny", max_tokens=200, messages=ASK, temperature=0,
                                                  tools=tools, tool_choice="auto", extra_body=extra)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    chunks = list(openai_client.chat.completions.create(model="tiny", max_tokens=200, messages=ASK, temperature=0,
                                                        tools=tools, tool_choice="auto", stream=True,
                                                        extra_body=extra))
    pieces = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Paris", "unit": "celsius"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me check.\n"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_responses_carry_thinking_as_reasoning_items_whole_and_streamed(server, openai_client):
    forced = {"guided_regex": FAKE_THINKING, "chat_template_kwargs": {"enable_thinking": False}}
    response = openai_client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=40,
                                              temperature=0, extra_body=forced)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "\nI am thinking.\n"
    assert response.output_text == "\n\nHello." and response.status == "completed"
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    body = {"model": "tiny", "input": ASK[0]["content"], "max_output_tokens": 40, "temperature": 0, "stream": True,
            **forced}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as stream:
        events = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]
    thinking = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thinking, text) == ("\nI am thinking.\n", "\n\nHello.")
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_greedy_text_is_the_same_through_all_three_apis(claude, openai_client):
    conversation = [{"role": "system", "content": SYSTEM}, *ASK]
    chat = openai_client.chat.completions.create(model="tiny", max_tokens=16, temperature=0, messages=conversation)
    message = claude.messages.create(model="tiny", max_tokens=16, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    response = openai_client.responses.create(model="tiny", max_output_tokens=16, temperature=0, instructions=SYSTEM,
                                              input=ASK)
    assert chat.choices[0].message.content == message.content[0].text == response.output_text
    assert chat.usage.completion_tokens == message.usage.output_tokens == response.usage.output_tokens == 16
    assert chat.usage.prompt_tokens == response.usage.input_tokens == \
        message.usage.input_tokens + message.usage.cache_read_input_tokens
