"""vLLM's request controls through the routes (completions, chat, Responses, Messages): allowed_token_ids, bad_words,
truncate_prompt_tokens (the prompt's last k tokens: the usage says so) and vllm_xargs (a third-party logits
processor's arguments), and the 400s that name a bad one. The server's own app in-process over a tiny checkpoint
written without transformers, with a logits processor from the tests' helpers (~1 s)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from helpers.agreeing_drafts import write_bigram_llama
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import build_app

PROMPT = list(range(100, 120))
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # (the checkpoint has none)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = str(write_bigram_llama(tmp_path_factory.mktemp("controls")))
    config = EngineConfig.from_kwargs(model=path, num_kv_blocks=64,
                                      logits_processors=["helpers.logits_processors:OnlyToken"])
    engine = AsyncEngine(lambda: LLMEngine(config), "tiny")
    try:
        yield TestClient(build_app(engine, ServerConfig(), TEMPLATE))
    finally:
        engine.shutdown()


def _complete(client, **fields):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 0, **fields})


def test_the_controls_reach_the_sampler_from_every_route(client):
    allowed = _complete(client, allowed_token_ids=[7, 9]).json()["choices"][0]["logprobs"]["tokens"]
    tokenizer_text = {client.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (7, 9)}
    assert set(allowed) <= tokenizer_text
    forced = _complete(client, vllm_xargs={"only_token": 42}).json()["choices"][0]["text"]
    assert forced == client.post("/detokenize", json={"tokens": [42] * 5}).json()["prompt"]
    truncated = _complete(client, truncate_prompt_tokens=4).json()
    assert truncated["usage"]["prompt_tokens"] == 4
    assert _complete(client, truncate_prompt_tokens=-1).json()["usage"]["prompt_tokens"] == len(PROMPT)
    chat = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "truncate_prompt_tokens": 2, "bad_words": ["x"], "vllm_xargs": {"only_token": 42}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == 2
    forced_text = client.post("/detokenize", json={"tokens": [42] * 3}).json()["prompt"]
    assert chat.json()["choices"][0]["message"]["content"] == forced_text
    responses = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 3,
                                                   "temperature": 0, "vllm_xargs": {"only_token": 42}})
    assert responses.json()["output"][-1]["content"][0]["text"] == forced_text, responses.text
    messages = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 3, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "hi"}],
                                                 "vllm_xargs": {"only_token": 42}, "truncate_prompt_tokens": 2})
    assert messages.json()["content"][0]["text"] == forced_text, messages.text
    assert messages.json()["usage"]["input_tokens"] == 2


def test_bad_controls_are_400s_naming_them(client):
    for fields, param, said in (({"allowed_token_ids": [10 ** 9]}, None, "allowed_token_ids token ids must be <"),
                                ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
                                ({"bad_words": [""]}, "bad_words", "non-empty strings"),
                                ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 .* or >= 1"),
                                ({"allowed_token_ids": [7], "bad_words": ["x"]}, None, None)):
        response = _complete(client, **fields)
        if said is None:  # ("x" is not token 7: allowed)
            assert response.status_code == 200
            continue
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert re.search(said, error["message"]), error
        if param is not None:
            assert error["param"] == param
