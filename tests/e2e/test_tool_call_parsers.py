"""`--tool-call-parser`: a model family's own call syntax, asked for in the prompt and read back from the
output (tool_choice auto), through `tokenmill serve` and the openai client."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess
from helpers.tiny_models import make_tiny_hf_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]


@pytest.fixture(scope="module")
def pythonic(tmp_path_factory):
    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")
    server = ServerProcess(str(model), "--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "tiny",
                           "--tool-call-parser", "pythonic", log_path=tmp_path_factory.mktemp("logs") / "server.log")
    with server.running():
        yield server


def forced(text: str) -> dict:
    """extra_body that makes the model write exactly `text` (a regex of its characters)."""
    return {"guided_regex": re.escape(text)}


def test_the_prompt_asks_for_the_familys_syntax_and_its_calls_come_back(pythonic):
    # SmolLM2's template renders no tools, so the system message lists them in pythonic syntax
    rendered = httpx.post(f"{pythonic.url}/v1/chat/completions/render",
                          json={"messages": ASK, "tools": TOOLS}, timeout=30).json()
    tokenizer_text = httpx.post(f"{pythonic.url}/detokenize", json={"tokens": rendered["token_ids"]}, timeout=30).json()
    assert "func_name1(" in tokenizer_text["prompt"] and '"name": "get_weather"' in tokenizer_text["prompt"]

    client = OpenAI(base_url=f"{pythonic.url}/v1", api_key="none", max_retries=0)
    text = '[get_weather(city="Paris", days=2)]'
    whole = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                           extra_body=forced(text))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120,
                                                 temperature=0, stream=True, extra_body=forced(text)))
    pieces = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert pieces and pieces[0].function.name == "get_weather" and pieces[0].id.startswith("call_")
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Paris", "days": 2}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_call_that_does_not_parse_stays_text(pythonic):
    client = OpenAI(base_url=f"{pythonic.url}/v1", api_key="none", max_retries=0)
    for text in ('[get_weather(city=Paris)]', '[unknown_tool(a=1)]', '[get_weather("Paris")]'):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                               extra_body=forced(text))
        assert reply.choices[0].message.content == text and not reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "stop"
