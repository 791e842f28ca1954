"""A GPT-OSS model through `tokenmill serve`: its prompts are harmony's tokens and its harmony output comes back
as a tool call through Chat Completions (whole and streamed), Responses and Messages.

The model is a tiny GPT-OSS with GPT-OSS's vocabulary, wired as a bigram table that greedily writes one
scripted harmony tool call (tests/helpers/harmony_models.py): the server's tokenizer is the o200k one built
offline; harmony's vocabulary file is built from it into a fresh cache (TOKENMILL_CACHE_DIR) here, as the
server does from a real checkpoint (the server keeps the usual cache: a fresh one would rebuild the kernels). Cost: about 15 s (building the 201088-token tokenizer, one server start)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess
from helpers.harmony_models import make_scripted_gpt_oss, o200k_tokenizer
from tokenmill.server.harmony import Harmony
from tokenmill.server.protocol import ChatMessage, Tool
from tokenmill.server.tool_calls import ToolMode

CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CACHE_DIR", str(cache))
        patch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
        harmony = Harmony.load(o200k_tokenizer())  # builds o200k_base.tiktoken under the cache from the tokenizer
    assert (cache / "harmony" / "o200k_base.tiktoken").is_file()
    prompt = harmony.prompt_ids([ChatMessage.model_validate(m) for m in ASK],
                                ToolMode([Tool.model_validate(WEATHER)], "auto"))
    script = harmony.encoding.encode(CALL, allowed_special="all")
    model = make_scripted_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), script, after=prompt[-1])
    proc = ServerProcess(str(model), "--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "oss",
                         log_path=tmp_path_factory.mktemp("logs") / "server.log")
    with proc.running():
        yield proc, prompt, script


def test_the_prompt_is_harmonys_rendering(setup):
    server, prompt, _ = setup
    rendered = httpx.post(f"{server.url}/v1/chat/completions/render",
                          json={"model": "oss", "messages": ASK, "tools": [WEATHER]}, timeout=60)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == prompt


def test_a_harmony_tool_call_through_chat_responses_and_messages(setup):
    server, prompt, script = setup
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40)
    choice = chat.choices[0]
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == len(script)
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]

    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model="oss", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40, stream=True) if c.choices]
    streamed = [call for d in deltas for call in (d.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in streamed] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert "".join(d.content or "" for d in deltas) == ""

    response = client.responses.create(model="oss", input="Weather in Paris?", instructions="Be brief.",
                                       tools=[{"type": "function", **WEATHER["function"]}], temperature=0,
                                       max_output_tokens=40)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in response.output] == \
        [("function_call", "get_weather", {"city": "Paris"})]

    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = claude.messages.create(
        model="oss", max_tokens=40, system="Be brief.", messages=ASK[1:], extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "description": "The weather in a city.",
                "input_schema": WEATHER["function"]["parameters"]}])
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "Paris"})]


def test_forced_calls_and_constraints_are_refused_for_now(setup):
    server, _, _ = setup
    for extra in ({"tool_choice": "required"}, {"response_format": {"type": "json_object"}}):
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                            json={"model": "oss", "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **extra})
        assert answer.status_code == 400 and "harmony" in answer.text, answer.text
