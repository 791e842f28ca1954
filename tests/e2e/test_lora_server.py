"""`tokenmill serve --enable-lora`: adapters chosen by `model`, listed by /v1/models, loaded and unloaded at
run time through vLLM's routes; concurrent requests of several adapters and the base give PEFT's tokens."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from e2e.server_harness import ServerProcess
from e2e.test_server import assert_openai_error
from helpers.engine_probe import hf_greedy_tokens
from helpers.tiny_models import make_random_lora, make_tiny_hf_model, smollm2_tokenizer

PROMPT = [1, 520, 9531, 42, 77, 5]
TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_hf_model(root / "base")
    adapters = {"qv": make_random_lora(base, root / "qv", 4, ["q_proj", "v_proj"], 1),
                "mlp": make_random_lora(base, root / "mlp", 2, ["gate_proj", "up_proj", "down_proj"], 2),
                "big": make_random_lora(base, root / "big", 8, ALL, 3)}
    server = ServerProcess(str(base), "--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank",
                           "4", "--lora-modules", f"qv={adapters['qv']}", "--served-model-name", "base",
                           "--num-kv-blocks", "256", log_path=root / "server.log").start()
    try:
        yield server.wait_ready().url, base, adapters
    finally:
        server.stop()


@pytest.fixture(scope="module")
def oracle(setup):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, base, adapters = setup
    tokens = {}
    for name in (None, "qv", "mlp"):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name])).eval()
        tokens[name] = hf_greedy_tokens(model, PROMPT, TOKENS)
    return tokens


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_adapters_by_model_name_and_runtime_loading(setup, oracle):
    url, _, adapters = setup
    listed = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [("base", None), ("qv", "base")]
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none")

    async def run(model: str) -> str:
        reply = await client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert reply.model == model and reply.usage.completion_tokens == TOKENS
        return reply.choices[0].text

    assert post(url, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}).status_code == 200

    async def mixed():  # base and two adapters at once, twice each: one batch, three groups
        return await asyncio.gather(*(run(m) for m in ["base", "qv", "mlp"] * 2))
    results = asyncio.run(mixed())
    tokenizer = smollm2_tokenizer()
    for model, text in zip(["base", "qv", "mlp"] * 2, results):
        assert text == tokenizer.decode(oracle[None if model == "base" else model], skip_special_tokens=True), model
    assert oracle["qv"] != oracle[None] and oracle["mlp"] != oracle[None]  # each adapter changes the answer
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
    error = assert_openai_error(post(url, "/v1/completions", {"model": "mlp", "prompt": "hi"}), 404, "model")
    assert "'base', 'qv'" in error["message"]


def test_bad_adapter_requests(setup):
    url, _, adapters = setup
    error = assert_openai_error(post(url, "/v1/load_lora_adapter", {"lora_name": "big",
                                                                     "lora_path": str(adapters["big"])}), 400)
    assert "rank 8 is above --max-lora-rank 4" in error["message"]
    assert_openai_error(post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}), 400,
                        "lora_path")
    assert_openai_error(post(url, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(adapters["qv"])}),
                        400, "lora_name")
    assert_openai_error(post(url, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}), 404, "lora_name")
    error = assert_openai_error(post(url, "/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}), 404, "model")
    assert "'base'" in error["message"] and "'qv'" in error["message"]
