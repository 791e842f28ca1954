"""`use_beam_search` on /v1/completions and /v1/chat/completions: HF's hypotheses through the server, and a
400 naming each field beam search cannot honour."""

from __future__ import annotations

import httpx
import pytest
import torch

from e2e.server_harness import ServerProcess
from e2e.test_server import assert_openai_error
from helpers.tiny_models import make_tiny_hf_model, smollm2_tokenizer

PROMPT = [1, 520, 9531, 42, 77]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("beam-server")
    folder = make_tiny_hf_model(root / "model")
    process = ServerProcess(str(folder), "--dtype", "float32", "--num-kv-blocks", "256",
                            log_path=root / "server.log").start()
    try:
        yield process.wait_ready().url, folder
    finally:
        process.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_completions_beam_search_gives_hfs_best_hypotheses(server):
    from transformers import AutoModelForCausalLM

    url, folder = server
    response = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "use_beam_search": True,
                                               "n": 2, "best_of": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                          num_beams=4, num_return_sequences=2, max_new_tokens=8, do_sample=False)
    tokenizer = smollm2_tokenizer()
    expected = [tokenizer.decode(row[len(PROMPT):].tolist(), skip_special_tokens=True) for row in out]
    assert [c["text"] for c in body["choices"]] == expected
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 16
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                                               "use_beam_search": True, "n": 3})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 3


def test_beam_search_refuses_what_it_cannot_honour(server):
    url, _ = server
    base = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True}
    error = assert_openai_error(post(url, "/v1/completions", {**base, "top_p": 0.5, "seed": 3}), 400)
    assert "top_p" in error["message"] and "seed" in error["message"]
    assert_openai_error(post(url, "/v1/completions", {**base, "stream": True}), 400, "stream")
    assert_openai_error(post(url, "/v1/completions", {**base, "temperature": 0.7}), 400, "temperature")
    assert_openai_error(post(url, "/v1/completions", {**base, "n": 3, "best_of": 2}), 400, "best_of")
    assert_openai_error(post(url, "/v1/completions", {**base, "best_of": 11}), 400, "best_of")
    error = assert_openai_error(post(url, "/v1/completions", {"prompt": PROMPT, "length_penalty": 2.0}), 400)
    assert "length_penalty" in error["message"] and "use_beam_search" in error["message"]
    assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
