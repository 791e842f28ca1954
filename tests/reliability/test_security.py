"""Who may use the server, and what one tenant can learn of another: the API key guards every route but
/health and /metrics (and /metrics too when asked), comes from a flag, the environment or a file; a
request's cache_salt keeps its prefix-cache blocks apart. In-process, on a tiny model."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import build_app

KEY = "tenant-key-123"
ROUTES = [("GET", "/v1/models"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/version"),
          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
          ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


@pytest.fixture(scope="module")
def engine(model_path):
    config = EngineConfig.from_kwargs(model=model_path, dtype="float32", num_kv_blocks=64)
    engine = AsyncEngine(lambda: LLMEngine(config), "tiny")
    yield engine
    engine.shutdown()


def client_for(engine: AsyncEngine, config: ServerConfig) -> TestClient:
    app = build_app(engine, config, engine.info.chat_template, config.resolved_tenants())
    return TestClient(app)


def test_the_key_guards_every_route_but_health_and_metrics(engine):
    client = client_for(engine, ServerConfig(api_key=KEY))
    for method, path in ROUTES:
        assert client.request(method, path).status_code == 401, path
        assert client.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_anthropic_clients_send_the_key_as_x_api_key_and_read_its_refusal_in_their_shape(engine):
    client = client_for(engine, ServerConfig(api_key=KEY))
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"anthropic-version": "2023-06-01"}
    refused = client.post("/v1/messages", json=body, headers={**headers, "x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/messages", json=body, headers={**headers, "x-api-key": KEY}).status_code == 200
    assert client.post("/v1/chat/completions", headers={"x-api-key": KEY},
                       json={"max_tokens": 2, "messages": body["messages"]}).status_code == 200
    assert "error" in client.post("/v1/chat/completions", json={}).json()  # OpenAI's shape elsewhere


def test_metrics_can_require_the_key(engine):
    client = client_for(engine, ServerConfig(api_key=KEY, metrics_require_key=True))
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_the_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    assert ServerConfig().resolved_api_key() == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert ServerConfig(api_key_file=str(key_file)).resolved_api_key() == "from-file"
    assert ServerConfig(api_key="flag").resolved_api_key() == "flag"
    monkeypatch.delenv("TOKENMILL_API_KEY")
    assert ServerConfig().resolved_api_key() is None
    with pytest.raises(ValueError, match="api_key_file"):
        ServerConfig(api_key_file=str(tmp_path / "missing")).resolved_api_key()


def test_cache_salt_keeps_prefix_blocks_apart(model_path):
    engine = LLM(model_path, dtype="float32", block_size=4, num_kv_blocks=64).llm_engine
    prompt = list(range(10, 30))

    def hits_after(salt):
        before = engine.kv_cache.prefix_hits
        engine.add_request(f"r{engine.kv_cache.prefix_queries}", None,
                           SamplingParams(max_tokens=1, cache_salt=salt), prompt_token_ids=prompt)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.kv_cache.prefix_hits - before

    assert hits_after("tenant-a") == 0
    assert hits_after("tenant-b") == 0  # same prompt, other tenant: nothing shared
    assert hits_after(None) == 0
    assert hits_after("tenant-a") > 0  # the same tenant reuses its own blocks
