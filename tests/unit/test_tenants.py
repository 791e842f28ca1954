"""Tenants without an engine: keys known only by salted hashes, the tenants file's checks, the windows that
limit requests and tokens per minute (on a clock the test moves), and the gate in front of an app: 401, 429 with
Retry-After and x-ratelimit-* headers, the tenant seen by the handler, and a reload that keeps the windows."""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tokenmill.engine.admission import current_client
from tokenmill.server.tenant_gate import TenantGate, TenantGateMiddleware
from tokenmill.server.tenant_limits import SlidingWindow, TenantBudget
from tokenmill.server.tenants import Tenant, Tenants, current_tenant, hash_key, tenant_from_dict

KEY_A, KEY_B = "tm-key-of-tenant-a-0123456789", "tm-key-of-tenant-b-0123456789"


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_known_by_a_salted_hash_and_only_its_own_key_finds_its_tenant():
    first, second = hash_key(KEY_A), hash_key(KEY_A)
    assert first != second and KEY_A not in first  # a new salt each time; never the key
    tenants = Tenants([Tenant("a", first), Tenant("b", hash_key(KEY_B))])
    assert tenants.identify(KEY_A.encode()).name == "a" and tenants.identify(KEY_B.encode()).name == "b"
    for wrong in (b"", b"x", KEY_A.encode()[:-1], KEY_A.encode() + b" ", b"k" * 100_000, "ключ-🔑".encode()):
        assert tenants.identify(wrong) is None


@pytest.mark.parametrize("entry, message", [
    ({"key_hash": "x"}, r"tenants\[0\].name is required"),
    ({"name": "a"}, r"tenants\[0\].key_hash is required"),
    ({"name": "a", "key_hash": "plain-key"}, "what `tokenmill hash-key` prints"),
    ({"name": "../etc", "key_hash": None}, "letters, digits"),
    ({"name": "a", "key_hash": None, "tokens_per_minute": "2000"}, r"tokens_per_minute must be an integer >= 1"),
    ({"name": "a", "key_hash": None, "requests_per_minute": True}, r"requests_per_minute must be an integer"),
    ({"name": "a", "key_hash": None, "max_concurrent": 0}, r"max_concurrent must be an integer >= 1"),
    ({"name": "a", "key_hash": None, "admin": "yes"}, r"admin must be true or false"),
    ({"name": "a", "key_hash": None, "weight": -1}, r"weight must be a number"),
    ({"name": "a", "key_hash": None, "models": "m"}, r"models must be a list"),
    ({"name": "a", "key_hash": None, "quota": 5}, r"unknown field\(s\) quota"),
])
def test_a_wrong_tenant_entry_is_refused_naming_the_field(entry, message):
    entry = {k: (hash_key(KEY_A) if k == "key_hash" and v is None else v) for k, v in entry.items()}
    with pytest.raises(ValueError, match=message):
        tenant_from_dict(entry, 0)


def test_the_tenants_file_reads_json_and_yaml_and_refuses_duplicates(tmp_path):
    entries = [{"name": "a", "key_hash": hash_key(KEY_A), "tokens_per_minute": 2000, "models": ["m"]},
               {"name": "ops", "key_hash": hash_key(KEY_B), "admin": True, "weight": 2}]
    (tmp_path / "t.json").write_text(json.dumps({"tenants": entries}))
    (tmp_path / "t.yaml").write_text("tenants:\n" + "".join(
        f"  - name: {e['name']}\n    key_hash: '{e['key_hash']}'\n" for e in entries))
    from_json = Tenants.from_file(str(tmp_path / "t.json"))
    assert from_json.names == ("a", "ops") and from_json.tenants[0].models == ("m",)
    assert from_json.tenants[1].admin and from_json.tenants[1].weight == 2.0
    assert Tenants.from_file(str(tmp_path / "t.yaml")).identify(KEY_B.encode()).name == "ops"
    (tmp_path / "dup.json").write_text(json.dumps({"tenants": entries + entries[:1]}))
    with pytest.raises(ValueError, match="unique: a"):
        Tenants.from_file(str(tmp_path / "dup.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="does not parse"):
        Tenants.from_file(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="cannot be read"):
        Tenants.from_file(str(tmp_path / "missing.json"))


def test_a_window_forgets_what_is_a_minute_old_and_says_when_it_will_be_below_a_limit():
    window = SlidingWindow()
    window.add(700, 10.2)
    window.add(500, 30.0)
    window.add(900, 30.5)  # the same second: one total
    assert window.total(30.9) == 2100
    assert window.seconds_until_below(2000, 31.0) == pytest.approx(39.0)  # second 10 leaves at 70
    assert window.seconds_until_below(1000, 31.0) == pytest.approx(59.0)  # then second 30 at 90
    assert window.seconds_until_below(2200, 31.0) == 0.0
    assert window.total(70.0) == 1400 and window.total(90.0) == 0


def test_a_tenant_past_its_tokens_per_minute_is_refused_until_the_window_moves():
    clock = Clock()
    budget = TenantBudget(Tenant("a", hash_key(KEY_A), tokens_per_minute=2000), clock)
    assert budget.admit() is None
    budget.prompt(1500)
    clock.now += 20
    budget.finished(600, 20.0)  # 2,100 tokens in the window
    budget.release()
    refusal = budget.admit()
    assert refusal.limit == "tokens_per_minute" and refusal.retry_s == 40  # the prompt's 1,500 leave at +60 s
    assert budget.headers()["x-ratelimit-remaining-tokens"] == "0"
    clock.now += 40
    assert budget.admit() is None  # 600 left in the window


def test_requests_per_minute_and_requests_at_once():
    clock = Clock()
    budget = TenantBudget(Tenant("a", hash_key(KEY_A), requests_per_minute=3, max_concurrent=2), clock)
    assert budget.admit() is None and budget.admit() is None
    assert budget.admit().limit == "max_concurrent"
    budget.release()
    clock.now += 5
    assert budget.admit() is None  # the third of the minute
    budget.release()
    budget.release()
    refusal = budget.admit()
    assert refusal.limit == "requests_per_minute" and refusal.retry_s == 55
    headers = budget.headers()
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in headers  # no tokens limit, no tokens headers


def _gated_app(gate: TenantGate) -> TestClient:
    async def who(request):
        tenant, client = current_tenant.get(), current_client.get()
        if client is not None and client.usage is not None:
            client.usage.prompt(int(request.query_params.get("tokens", "0")))
        return JSONResponse({"tenant": tenant.name if tenant else None,
                             "share": [client.share.name, client.share.weight] if client else None,
                             "priority": client.priority if client else None})

    app = Starlette(routes=[Route("/work", who, methods=["GET", "POST"]), Route("/health", who)])
    app = TenantGateMiddleware(app, gate, frozenset({"/health"}), "/static/")
    return TestClient(app)


def test_the_gate_names_the_tenant_refuses_unknown_keys_and_answers_429_with_when_to_retry():
    clock = Clock()
    gate = TenantGate(Tenants([Tenant("a", hash_key(KEY_A), tokens_per_minute=100, priority=2, weight=3.0),
                               Tenant("b", hash_key(KEY_B))]), clock)
    with _gated_app(gate) as http:
        assert http.get("/health").json()["tenant"] is None  # open path: no key, no tenant
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY_A}"},
                        {"x-api-key": ""}, {"Authorization": "Bearer " + "k" * 50_000}):
            answer = http.post("/work", headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"
        answer = http.post("/work?tokens=120", headers={"Authorization": f"Bearer {KEY_A}"})
        assert answer.json() == {"tenant": "a", "share": ["a", 3.0], "priority": 2}
        assert answer.headers["x-ratelimit-limit-tokens"] == "100"
        refused = http.post("/work", headers={"x-api-key": KEY_A})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "60"
        assert refused.json()["error"]["type"] == "rate_limit_error" and "tokens per minute" in \
            refused.json()["error"]["message"]
        assert http.get("/work", headers={"x-api-key": KEY_A}).status_code == 200  # a GET does no work
        assert http.post("/work", headers={"x-api-key": KEY_B}).json()["tenant"] == "b"  # b is not limited
        clock.now += 60
        assert http.post("/work", headers={"x-api-key": KEY_A}).status_code == 200
    metrics = gate.render_metrics().decode()
    assert 'tokenmill:tenant_rate_limited_total{limit="tokens_per_minute",tenant="a"} 1.0' in metrics
    assert 'tokenmill:tenant_tokens_total{kind="prompt",tenant="a"} 120.0' in metrics


def test_a_reload_keeps_a_staying_tenants_window_and_refuses_a_removed_tenants_key():
    clock = Clock()
    gate = TenantGate(Tenants([Tenant("a", hash_key(KEY_A), requests_per_minute=1), Tenant("b", hash_key(KEY_B))]),
                      clock)
    with _gated_app(gate) as http:
        assert http.post("/work", headers={"x-api-key": KEY_A}).status_code == 200
        gate.reload(Tenants([Tenant("a", hash_key(KEY_A), requests_per_minute=2)]))
        assert http.post("/work", headers={"x-api-key": KEY_A}).status_code == 200  # the new limit
        assert http.post("/work", headers={"x-api-key": KEY_A}).status_code == 429  # the kept window
        assert http.post("/work", headers={"x-api-key": KEY_B}).status_code == 401


def test_two_tenants_cap_a_steps_prompt_tokens_at_tenant_step_tokens():
    from tokenmill.config import EngineConfig, ServerConfig
    from tokenmill.server.launch import tenant_step_budget
    from tokenmill.server.tenants import Tenant, Tenants, hash_key

    engine = EngineConfig.from_kwargs(model="x", max_num_batched_tokens=2048)
    two = Tenants([Tenant(name, hash_key(f"key-of-{name}-long-enough")) for name in ("a", "b")])
    one = Tenants([Tenant("a", hash_key("key-of-a-long-enough"))])
    lowered = tenant_step_budget(engine, ServerConfig(), two)
    assert lowered.scheduler.max_num_prompt_tokens == 512 and lowered.scheduler.max_num_batched_tokens == 2048
    assert tenant_step_budget(engine, ServerConfig(), one) is engine  # one tenant: nobody to wait for
    assert tenant_step_budget(engine, ServerConfig(), None) is engine
    assert tenant_step_budget(engine, ServerConfig(tenant_step_tokens=0), two) is engine
    with pytest.raises(ValueError, match="tenant_step_tokens must be >= 0"):
        ServerConfig(tenant_step_tokens=-1).validate()
