"""The gate every request of a server with keys passes: whose key it is (401 when no tenant's), whether the tenant's
limits let it run now (429 with Retry-After), and, while it is handled, the tenant it is served for.

Plain ASGI, so streamed responses pass through untouched: Starlette's BaseHTTPMiddleware relays every chunk
through a memory stream and a task switch (measured at batch 1: TPOT 12.5 -> 11.7 ms, two alternating pairs).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.config import ServerConfig
from tokenmill.engine.admission import Client, current_client
from tokenmill.server.serving_common import error_response
from tokenmill.server.tenant_limits import TenantBudget
from tokenmill.server.tenants import Tenant, Tenants, current_tenant

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class TenantMetrics:
    """Use and latency per tenant. The tenant label takes only names from the tenants file (a bounded set)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["tenant"]
        self.requests = Counter("tokenmill:tenant_requests_total", "Requests a tenant sent past the key check, by "
                                "HTTP status.", ["tenant", "status"], registry=r)
        self.refused = Counter("tokenmill:tenant_rate_limited_total", "Requests refused with 429 by one of the "
                               "tenant's limits.", ["tenant", "limit"], registry=r)
        self.in_flight = Gauge("tokenmill:tenant_requests_in_flight", "A tenant's requests being handled.", labels,
                               registry=r)
        self.tokens = Counter("tokenmill:tenant_tokens_total", "Tokens a tenant's requests used, by kind (prompt, "
                              "generation).", ["tenant", "kind"], registry=r)
        self.ttft = Histogram("tokenmill:tenant_time_to_first_token_seconds", "Time to a request's first output "
                              "token, per tenant.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill:tenant_e2e_request_latency_seconds", "Time from a request's arrival at the "
                             "engine to its end, per tenant.", labels, buckets=_LATENCY_BUCKETS, registry=r)

    def observe(self, tenant: str, what: str, value: float) -> None:
        """What a tenant's budget hears from the engine (TenantBudget's `observe`)."""
        if what in ("prompt_tokens", "generation_tokens"):
            self.tokens.labels(tenant, what.removesuffix("_tokens")).inc(value)
        elif what == "ttft":
            self.ttft.labels(tenant).observe(value)
        elif what == "e2e":
            self.e2e.labels(tenant).observe(value)


class TenantGate:
    """The tenants and their budgets; `reload` swaps in a new tenants file's without dropping a connection."""

    def __init__(self, tenants: Tenants, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.metrics = TenantMetrics()
        self.budgets: dict[str, TenantBudget] = {}
        self.tenants = tenants
        self._set(tenants)

    def _set(self, tenants: Tenants) -> None:
        budgets = {}
        for tenant in tenants.tenants:
            budget = self.budgets.get(tenant.name) or TenantBudget(tenant, self.clock, self.metrics.observe)
            budget.tenant = tenant  # the new limits apply to the use already counted
            budgets[tenant.name] = budget
        self.budgets, self.tenants = budgets, tenants

    def reload(self, tenants: Tenants) -> None:
        """Serve `tenants` from now on. A tenant that stays keeps its windows; requests in flight finish as they
        began; a removed tenant's key is refused from now on."""
        self._set(tenants)
        logger.info("tenants reloaded from %s: %s", tenants.source, ", ".join(tenants.names))

    def render_metrics(self) -> bytes:
        """The per-tenant series in Prometheus' text format."""
        return generate_latest(self.metrics.registry)

    def usage(self) -> list[dict[str, Any]]:
        """Each tenant's use now (the dashboard's table): in flight, requests and tokens in the last minute against
        its limits, and the median time to first token of its last requests (ms; None before any)."""
        now = self.clock()
        rows = []
        for name, b in self.budgets.items():
            ttfts = sorted(b.recent_ttft)
            rows.append({"tenant": name, "in_flight": b.in_flight, "requests_last_minute": b.requests.total(now),
                         "tokens_last_minute": b.tokens.total(now), "requests_per_minute": b.tenant.requests_per_minute,
                         "tokens_per_minute": b.tenant.tokens_per_minute,
                         "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None})
        return rows


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key a request presents: `Authorization: Bearer <key>` or Anthropic's `x-api-key: <key>`."""
    found = dict(headers)
    if b"x-api-key" in found:
        return found[b"x-api-key"]
    bearer = found.get(b"authorization", b"")
    return bearer[7:] if bearer[:7].lower() == b"bearer " else b""


class TenantGateMiddleware:
    """401 for a request whose key is no tenant's (every path but `open_paths` and those under `open_prefix`);
    429 with Retry-After and x-ratelimit-* headers when one of the tenant's limits refuses a POST; otherwise the
    request is handled with `current_tenant` and the engine's `current_client` set to its tenant, and its answer
    carries the tenant's x-ratelimit-* headers. Only POSTs count against requests per minute and concurrency:
    they are what makes the engine work.

    Invariant: a request that arrives with `current_tenant` already set comes from in-process work that a
    tenant's request started (a batch's lines, server/batch_lines.py): a network request's task is made in the
    server's own context, where it is unset. Such a request is handled as that tenant's, with no key."""

    def __init__(self, app: Any, gate: TenantGate, open_paths: frozenset[str], open_prefix: str) -> None:
        self.app, self.gate, self.open_paths, self.open_prefix = app, gate, open_paths, open_prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or path in self.open_paths or path.startswith(self.open_prefix)
                or current_tenant.get() is not None):
            await self.app(scope, receive, send)
            return
        tenant = self.gate.tenants.identify(presented_key(scope["headers"]))
        if tenant is None:
            await error_response(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or "
                                 "'x-api-key: <key>')", "authentication_error", path=path)(scope, receive, send)
            return
        budget = self.gate.budgets[tenant.name]
        counted = scope.get("method") == "POST"
        if counted:
            refusal = budget.admit()
            if refusal is not None:
                self.gate.metrics.refused.labels(tenant.name, refusal.limit).inc()
                self.gate.metrics.requests.labels(tenant.name, "429").inc()
                headers = {**budget.headers(), "Retry-After": str(refusal.retry_s)}
                await error_response(429, refusal.message, "rate_limit_error", headers=headers,
                                     path=path)(scope, receive, send)
                return
        await self._handle(tenant, budget, counted, scope, receive, send)

    async def _handle(self, tenant: Tenant, budget: TenantBudget, counted: bool, scope: dict, receive: Any,
                      send: Any) -> None:
        status = ["500"]

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
                extra = [(k.encode(), v.encode()) for k, v in budget.headers().items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        tenant_token, client_token = act_as(budget)
        in_flight = self.gate.metrics.in_flight.labels(tenant.name)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            current_client.reset(client_token)
            current_tenant.reset(tenant_token)
            in_flight.dec()
            if counted:
                budget.release()
            self.gate.metrics.requests.labels(tenant.name, status[0]).inc()


def act_as(budget: TenantBudget) -> tuple:
    """Handle what follows in this context as `budget`'s tenant's: `current_tenant` and the engine's `current_client`
    set (the tokens that reset them are returned)."""
    tenant = budget.tenant
    return current_tenant.set(tenant), current_client.set(Client(tenant.share, tenant.priority, budget,
                                                                 tenant.isolate_cache))


def check_tenant_model(model: str) -> None:
    """Raise a 403 APIError when the request's tenant may not use `model`."""
    from tokenmill.server.serving_common import APIError

    tenant = current_tenant.get()
    if tenant is not None and not tenant.may_use(model):
        raise APIError(403, f"tenant '{tenant.name}' may not use the model '{model}'", "permission_error", "model")


def server_tenants(config: ServerConfig) -> Optional[Tenants]:
    """The tenants a server serves: its tenants file's, else one admin tenant for its API key, else None (an open
    server). ValueError for a file that cannot be read or is wrong."""
    if config.tenants_file is not None:
        return Tenants.from_file(config.tenants_file)
    api_key = config.resolved_api_key()
    return Tenants.single_key(api_key) if api_key else None
