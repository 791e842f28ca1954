"""A GPT-OSS model behind the server's routes: its prompts are harmony's tokens, its harmony output comes back as
a tool call through Chat Completions (whole and streamed), Responses and Messages, and what the harmony path
does not do yet is refused with a 400 naming the field.

The model is a tiny GPT-OSS with GPT-OSS's vocabulary, wired as a bigram table that greedily writes one
scripted harmony tool call (tests/helpers/harmony_models.py), with an o200k tokenizer written offline. The app
is the server's own (`build_app`, as `tokenmill serve --reasoning-parser openai_gptoss --tool-call-parser
openai` builds it) run in-process: a `tokenmill serve` subprocess would cost ~10 s of imports and start-up
for nothing this file checks. The app builds harmony's vocabulary file from the engine's tokenizer (loaded
from the checkpoint, as a server loads it) into a fresh cache (TOKENMILL_CACHE_DIR, only while the app is
built: the engine's kernels come from the usual cache). Cost: about 6 s of CPU (the 201088-token tokenizer written
and loaded, the model's 201088-row tables, harmony's vocabulary read twice)."""

from __future__ import annotations

import json

import anthropic
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from helpers.harmony_models import make_scripted_gpt_oss, o200k_file
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import build_app
from tokenmill.server.protocol import ChatMessage, Tool
from tokenmill.server.tool_calls import ToolMode

CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tokenmill.server.harmony import Harmony  # imports openai-harmony: not at collection

    # the test's own harmony reads o200k from bpe-openai's copy, to script the model before it exists
    reference = tmp_path_factory.mktemp("tiktoken")
    (reference / "o200k_base.tiktoken").write_bytes(o200k_file())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(reference))
        import openai_harmony

        harmony = Harmony(openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS))
    prompt = harmony.prompt_ids([ChatMessage.model_validate(m) for m in ASK],
                                ToolMode([Tool.model_validate(WEATHER)], "auto"))
    script = harmony.encoding.encode(CALL, allowed_special="all")
    model = make_scripted_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), script, after=prompt[-1])
    config = EngineConfig.from_kwargs(model=str(model), max_model_len=256, num_kv_blocks=64)
    engine = AsyncEngine(lambda: LLMEngine(config), "oss")
    cache = tmp_path_factory.mktemp("cache")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TOKENMILL_CACHE_DIR", str(cache))
            patch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
            app = build_app(engine, ServerConfig(reasoning_parser="openai_gptoss", tool_call_parser="openai"),
                            engine.info.chat_template)
        yield TestClient(app), cache, prompt, script
    finally:
        engine.shutdown()


def test_the_vocabulary_file_is_built_from_the_models_tokenizer(setup):
    _, cache, _, _ = setup
    assert (cache / "harmony" / "o200k_base.tiktoken").read_bytes() == o200k_file()


def test_the_prompt_is_harmonys_rendering(setup):
    client, _, prompt, _ = setup
    rendered = client.post("/v1/chat/completions/render", json={"model": "oss", "messages": ASK, "tools": [WEATHER]})
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == prompt


def test_a_harmony_tool_call_through_chat_responses_and_messages(setup):
    http, _, prompt, script = setup
    client = OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=http)
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

    claude = anthropic.Anthropic(base_url="http://testserver", api_key="none", max_retries=0, http_client=http)
    message = claude.messages.create(
        model="oss", max_tokens=40, system="Be brief.", messages=ASK[1:], extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "description": "The weather in a city.",
                "input_schema": WEATHER["function"]["parameters"]}])
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("extra, says", [
    ({"tool_choice": "required"}, "tool_choice 'required' is not supported for GPT-OSS's harmony format"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice naming function 'get_weather' is not supported for GPT-OSS's harmony format"),
    ({"response_format": {"type": "json_object"}},
     "response_format json_object is not supported for GPT-OSS's harmony format"),
    ({"guided_regex": "[a-z]+"}, "guided_regex is not supported for GPT-OSS's harmony format"),
    ({"use_beam_search": True, "tools": None}, "use_beam_search is not supported for GPT-OSS's harmony format"),
])
def test_forced_calls_constraints_and_beam_search_are_refused_for_now(setup, extra, says):
    client, _, _, _ = setup
    answer = client.post("/v1/chat/completions",
                         json={"model": "oss", "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **extra})
    assert answer.status_code == 400 and says in answer.json()["error"]["message"], answer.text


def test_responses_and_messages_refuse_them_in_their_own_shapes(setup):
    client, _, _, _ = setup
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}
    answer = client.post("/v1/messages", json={"model": "oss", "max_tokens": 4, "messages": ASK[1:], "tools": [tool],
                                               "tool_choice": {"type": "any"}})
    assert answer.status_code == 400 and answer.json()["type"] == "error", answer.text
    assert "tool_choice 'required' is not supported for GPT-OSS's harmony format" in answer.json()["error"]["message"]
    answer = client.post("/v1/responses", json={"model": "oss", "input": "Weather in Paris?", "max_output_tokens": 4,
                                                "text": {"format": {"type": "json_schema", "name": "w",
                                                                    "schema": {"type": "object"}}}})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "response_format json_schema is not supported for GPT-OSS's harmony format" in message
