"""Who may use the server, and what one tenant can learn of another: the API key guards every route but
/health and /metrics (and /metrics too when asked), comes from a flag, the environment or a file; a
request's cache_salt keeps its prefix-cache blocks apart. In-process, on a tiny model."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import build_app
from tokenmill.server.tenant_gate import server_tenants
from tokenmill.server.tenants import hash_key

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
    app = build_app(engine, config, engine.info.chat_template, server_tenants(config))
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


KEY_USER, KEY_OPS = "tm-user-key-0123456789abcdef", "tm-ops-key-0123456789abcdef"


@pytest.fixture(scope="module")
def tenants_client(engine, tmp_path_factory):
    """A server of two tenants on the tiny engine: "user" (a tokens-per-minute limit, the served model only) and
    "ops" (admin), its stored responses in a state folder."""
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "tenants.json").write_text(json.dumps({"tenants": [
        {"name": "user", "key_hash": hash_key(KEY_USER), "tokens_per_minute": 40, "models": ["tiny"]},
        {"name": "ops", "key_hash": hash_key(KEY_OPS), "admin": True}]}))
    config = ServerConfig(tenants_file=str(folder / "tenants.json"), state_dir=str(folder / "state"))
    app = build_app(engine, config, engine.info.chat_template, server_tenants(config))
    return app, TestClient(app)


def _as(key):
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_uses_its_models_its_stored_responses_and_no_operational_route(tenants_client):
    _, client = tenants_client
    assert [m["id"] for m in client.get("/v1/models", headers=_as(KEY_USER)).json()["data"]] == ["tiny"]
    assert client.get("/v1/models", headers=_as("tm-nobody-0123456789abcdef")).status_code == 401
    # admin routes: the ops tenant's only
    refused = client.get("/is_paused", headers=_as(KEY_USER))
    assert refused.status_code == 403 and "not an admin tenant" in refused.json()["error"]["message"]
    assert client.get("/is_paused", headers=_as(KEY_OPS)).json() == {"is_paused": False}
    # a stored response is its tenant's: another tenant neither reads, continues nor deletes it
    stored = client.post("/v1/responses", headers=_as(KEY_OPS), json={"model": "tiny", "input": "hi",
                                                                      "max_output_tokens": 2}).json()
    assert client.get(f"/v1/responses/{stored['id']}", headers=_as(KEY_OPS)).status_code == 200
    assert client.get(f"/v1/responses/{stored['id']}", headers=_as(KEY_USER)).status_code == 404
    assert client.delete(f"/v1/responses/{stored['id']}", headers=_as(KEY_USER)).status_code == 404
    continued = client.post("/v1/responses", headers=_as(KEY_USER), json={
        "model": "tiny", "input": "more", "previous_response_id": stored["id"], "max_output_tokens": 2})
    assert continued.status_code == 400 and continued.json()["error"]["param"] == "previous_response_id"


def test_a_tenant_past_its_tokens_per_minute_gets_429_with_retry_after_then_is_served_again(tenants_client):
    app, client = tenants_client
    body = {"model": "tiny", "prompt": list(range(5, 25)), "max_tokens": 24, "ignore_eos": True}
    first = client.post("/v1/completions", headers=_as(KEY_USER), json=body)
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-tokens"] == "40"
    assert first.json()["usage"]["total_tokens"] == 44  # what the window counted: prompt and output
    refused = client.post("/v1/completions", headers=_as(KEY_USER), json=body)
    assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert client.post("/v1/completions", headers=_as(KEY_OPS), json=body).status_code == 200  # ops: no limit
    budget = app.state.tenant_gate.budgets["user"]
    later = budget.clock() + int(refused.headers["Retry-After"])
    budget.clock = lambda: later  # the window has moved on by Retry-After
    assert client.post("/v1/completions", headers=_as(KEY_USER), json=body).status_code == 200
    metrics = client.get("/metrics").text
    assert 'tokenmill:tenant_tokens_total{kind="generation",tenant="user"} 48.0' in metrics
    assert 'tokenmill:tenant_requests_total{status="429",tenant="user"} 1.0' in metrics


def test_a_model_the_tenant_may_not_use_is_a_403(engine, tmp_path):
    (tmp_path / "t.yaml").write_text(f"tenants:\n  - name: narrow\n    key_hash: '{hash_key(KEY_USER)}'\n"
                                     "    models: [other-model]\n")
    config = ServerConfig(tenants_file=str(tmp_path / "t.yaml"))
    client = TestClient(build_app(engine, config, engine.info.chat_template, server_tenants(config)))
    refused = client.post("/v1/chat/completions", headers=_as(KEY_USER),
                          json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "model"
    assert client.get("/v1/models", headers=_as(KEY_USER)).json()["data"] == []


def test_a_tenant_with_isolate_cache_shares_prefix_blocks_with_no_other_tenant(engine, tmp_path):
    """isolate_cache: the same prompt another tenant sent (and one with the other tenant's own cache_salt) finds
    none of its blocks; the tenant's own next request does, and the other tenants still share theirs."""
    keys = {name: f"tm-{name}-key-0123456789abcdef" for name in ("iso", "open", "also")}
    (tmp_path / "t.json").write_text(json.dumps({"tenants": [
        {"name": name, "key_hash": hash_key(key), "isolate_cache": name == "iso"} for name, key in keys.items()]}))
    config = ServerConfig(tenants_file=str(tmp_path / "t.json"))
    client = TestClient(build_app(engine, config, engine.info.chat_template, server_tenants(config)))

    def cached(name, **extra):
        body = {"model": "tiny", "prompt": list(range(300, 340)), "max_tokens": 1, **extra}
        answer = client.post("/v1/completions", headers=_as(keys[name]), json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("open") == 0
    assert cached("iso") == 0 and cached("iso", cache_salt="s") == 0  # not the open tenant's blocks
    assert cached("iso") > 0 and cached("iso", cache_salt="s") > 0  # its own
    assert cached("also") > 0  # tenants without isolation share as before
    assert cached("open", cache_salt="s") == 0  # nor does another tenant reach iso's salted blocks by its salt
    with pytest.raises(ValueError, match=r"isolate_cache must be true or false"):
        from tokenmill.server.tenants import tenant_from_dict
        tenant_from_dict({"name": "x", "key_hash": hash_key(keys["iso"]), "isolate_cache": "yes"}, 0)


def test_a_wrong_tenants_file_on_reload_keeps_the_tenants(tmp_path, caplog):
    from tokenmill.server.launch import reload_tenants
    from tokenmill.server.tenant_gate import TenantGate
    from tokenmill.server.tenants import Tenants

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tenants": [{"name": "a", "key_hash": hash_key(KEY_USER)}]}))
    gate = TenantGate(Tenants.from_file(str(path)))
    path.write_text(json.dumps({"tenants": [{"name": "a", "key_hash": hash_key(KEY_USER), "admin": "yes"}]}))
    reload_tenants(gate, str(path))
    assert gate.tenants.names == ("a",) and "not reloaded" in caplog.text and "admin must be" in caplog.text
    path.write_text(json.dumps({"tenants": [{"name": "b", "key_hash": hash_key(KEY_OPS)}]}))
    reload_tenants(gate, str(path))
    assert gate.tenants.identify(KEY_USER.encode()) is None and gate.tenants.identify(KEY_OPS.encode()).name == "b"
    with pytest.raises(ValueError, match="tenants_file or an API key"):
        ServerConfig(tenants_file=str(path), api_key="k").validate()
