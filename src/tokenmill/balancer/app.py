"""The front of `serve --data-parallel-size N`: one port that proxies every request to a replica.

Generation requests (/v1/completions, /v1/chat/completions, /v1/messages, /v1/responses) go where
`Balancer.choose` says, except that one continuing a stored response (previous_response_id), like
GET and DELETE /v1/responses/{id}, goes to the replica that made it (`ResponseHomes`). A replica
that cannot be reached, or that fails before the first byte of its answer was passed on, is marked
down and the request is retried on another (the engines are deterministic: a retried request
answers the same); one that answers 429 is tried after the others. Once bytes have been passed on, a
failure ends that response with an OpenAI error (an SSE error event when streaming). Replicas are
watched every `_WATCH_INTERVAL_S`: one whose process ended, or whose /health fails, takes no requests
until /health answers again. A replica that was up and died is started again after 2 s, doubling up to
60 s for one that keeps dying; one that never came up is not (its start itself fails), and the front
gives up when every replica is in that state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HTTPRoute

from tokenmill.balancer.forwarding import answer_headers, request_headers
from tokenmill.balancer.kv_index import PrefixIndex
from tokenmill.balancer.policy import Balancer, Replica, Route
from tokenmill.balancer.replicas import ReplicaProcess
from tokenmill.balancer.response_homes import RESPONSES_PATH, ResponseHomes

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.2
_FIRST_RESTART_DELAY_S, _MAX_RESTART_DELAY_S = 2.0, 60.0  # a replica that keeps dying is restarted less often
_HEALTH_TIMEOUT_S = 2.0
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
_DEFAULT_MAX_TOKENS = 256  # charged for a request that does not say (its real length is unknown)


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


class PromptReader:
    """A request's prompt token ids as its replica will compute them (for prefix affinity), or None."""

    def __init__(self, tokenizer: Any, chat_template: Optional[str]) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template

    def token_ids(self, path: str, body: dict[str, Any]) -> Optional[list[int]]:
        """The first prompt's token ids; None when the body is not one the replica would accept."""
        from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
        from tokenmill.server.serving_chat import chat_prompt
        from tokenmill.server.serving_completion import prompt_items, tokenize_prompts
        from tokenmill.server.tool_calls import tool_mode
        try:
            if path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(body)
                return chat_prompt(self.tokenizer, self.chat_template, chat.messages, chat.add_generation_prompt,
                                   tool_mode(chat))[1]
            completion = CompletionRequest.model_validate(body)
            if completion.prompt_embeds is not None:  # (no token ids to route by)
                return None
            return tokenize_prompts(prompt_items(completion)[:1], self.tokenizer)[0].token_ids
        except Exception:  # the replica answers the error; the balancer only loses the affinity
            return None


class BalancerMetrics:
    """The front's own series, and every replica's series labelled engine="<rank>"."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.up = Gauge("tokenmill_dp_replica_up", "1 while the replica takes requests", ["engine"],
                        registry=self.registry)
        self.routed = Counter("tokenmill_dp_requests_routed", "generation requests sent to the replica",
                              ["engine"], registry=self.registry)
        self.retried = Counter("tokenmill_dp_requests_retried", "requests retried elsewhere after the replica "
                               "failed before answering", ["engine"], registry=self.registry)
        self.prefix_tokens = Counter("tokenmill_dp_prefix_matched_tokens", "prompt tokens routed to a replica "
                                     "whose prefix cache held them", ["engine"], registry=self.registry)
        self.restarts = Counter("tokenmill_dp_replica_restarts", "times the replica was started again after it "
                                "died", ["engine"], registry=self.registry)
        self.outstanding = Gauge("tokenmill_dp_outstanding_tokens", "prompt + max_tokens of the requests the "
                                 "replica is serving", ["engine"], registry=self.registry)
        self.indexed_blocks = Gauge("tokenmill_dp_prefix_index_blocks", "KV blocks the front's prefix index, fed "
                                    "by the replica's KV events, believes the replica holds", ["engine"],
                                    registry=self.registry)

    def render(self, replica_texts: dict[int, str], replicas: list[Replica],
               index: Optional[PrefixIndex] = None) -> bytes:
        """The exposition text: the front's series, then the replicas' (each with its engine label)."""
        for replica in replicas:
            self.outstanding.labels(str(replica.rank)).set(replica.outstanding_tokens)
            self.up.labels(str(replica.rank)).set(1 if replica.healthy else 0)
            if index is not None:
                self.indexed_blocks.labels(str(replica.rank)).set(index.num_blocks(replica.rank))
        merged: dict[str, Metric] = {}
        for rank, text in sorted(replica_texts.items()):
            for family in text_string_to_metric_families(text):
                target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                               family.unit))
                for sample in family.samples:
                    target.add_sample(sample.name, {**sample.labels, "engine": str(rank)}, sample.value,
                                      sample.timestamp, sample.exemplar)
        registry = CollectorRegistry()
        registry.register(_Fixed(list(merged.values())))
        return generate_latest(self.registry) + generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def build_balancer_app(balancer: Balancer, processes: list[ReplicaProcess], prompts: PromptReader,
                       max_body_bytes: int, on_all_exited: Callable[[], None],
                       homes: Optional[ResponseHomes] = None) -> Starlette:
    """The front's HTTP application; it watches (and restarts) the replicas while it runs, and calls
    `on_all_exited` once every replica has ended without ever coming up. `homes` remembers which replica
    stored each response, for the requests that refer to one."""
    homes = homes if homes is not None else ResponseHomes(1000 * len(processes))
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0), limits=httpx.Limits(max_connections=None))
    metrics = BalancerMetrics()

    async def watch() -> None:
        while True:
            await asyncio.gather(*(_check(p) for p in processes))
            if all(p.exited is not None and not p.ever_healthy for p in processes):
                on_all_exited()
                return
            await asyncio.sleep(_WATCH_INTERVAL_S)

    def _restart_if_due(process: ReplicaProcess) -> None:
        now = time.monotonic()
        if process.restart_at is None:
            process.restart_at = now + min(_MAX_RESTART_DELAY_S, _FIRST_RESTART_DELAY_S * 2 ** process.restarts)
            logger.warning("replica %d exited with code %s; starting it again in %.0f s", process.rank,
                           process.exited, process.restart_at - now)
        elif now >= process.restart_at:
            process.restart_at = None
            process.restarts += 1
            metrics.restarts.labels(str(process.rank)).inc()
            process.start()

    async def _check(process: ReplicaProcess) -> None:
        if process.exited is not None:
            healthy = False
            if process.ever_healthy:
                _restart_if_due(process)
        else:
            try:
                healthy = (await client.get(process.url + "/health", timeout=_HEALTH_TIMEOUT_S)).status_code == 200
            except httpx.HTTPError:
                healthy = False
        process.ever_healthy |= healthy
        if balancer.set_health(process.rank, healthy):
            logger.info("replica %d is %s", process.rank, "up" if healthy else
                        f"down (exit code {process.exited})" if process.exited is not None else "down")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            await client.aclose()

    async def health(request: Request) -> Response:
        up = sum(r.healthy for r in balancer.replicas)
        return Response(status_code=200 if up else 503)

    async def metrics_route(request: Request) -> Response:
        async def scrape(replica: Replica) -> tuple[int, str]:
            try:
                answer = await client.get(replica.url + "/metrics", timeout=_HEALTH_TIMEOUT_S)
                return replica.rank, answer.text if answer.status_code == 200 else ""
            except httpx.HTTPError:
                return replica.rank, ""
        texts = dict(await asyncio.gather(*(scrape(r) for r in balancer.replicas if r.healthy)))
        body = metrics.render({rank: text for rank, text in texts.items() if text}, balancer.replicas,
                              balancer.index)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def proxy(request: Request) -> Response:
        body = await request.body()
        if len(body) > max_body_bytes:
            return _error(413, f"the request body is larger than {max_body_bytes} bytes", "invalid_request_error")
        headers = request_headers(request)
        path = request.url.path
        url_tail = path + (f"?{request.url.query}" if request.url.query else "")
        if request.method == "POST" and path in _GENERATION_PATHS:
            return await _generate(request.method, path, url_tail, headers, body)
        route = balancer.choose(None, 0, exclude=_others(homes.home(request.method, path, None)))
        route = route or balancer.choose(None, 0)  # its home is down: another replica answers (404)
        if route is None:
            return _error(503, "no replica is up")
        try:
            answer = await client.request(request.method, route.replica.url + url_tail, headers=headers,
                                          content=body)
            return Response(answer.content, answer.status_code, answer_headers(answer))
        except httpx.HTTPError as exc:
            return _error(502, f"replica {route.replica.rank} failed: {exc.__class__.__name__}")
        finally:
            balancer.done(route)

    async def _generate(method: str, path: str, url_tail: str, headers: dict[str, str], body: bytes) -> Response:
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser: the replica says which
            payload = None
        token_ids = None
        max_tokens, salt = _DEFAULT_MAX_TOKENS, None
        if isinstance(payload, dict):
            token_ids = await asyncio.to_thread(prompts.token_ids, path, payload)
            asked = (payload.get("max_completion_tokens") or payload.get("max_tokens")
                     or payload.get("max_output_tokens"))
            max_tokens = asked if isinstance(asked, int) and asked > 0 else _DEFAULT_MAX_TOKENS
            salt = payload.get("cache_salt") if isinstance(payload.get("cache_salt"), str) else None
        tried: set[int] = set()
        busy: Optional[httpx.Response] = None
        pinned = _others(homes.home(method, path, payload))  # a continued response's replica, while it is up
        while True:
            route = balancer.choose(token_ids, max_tokens, salt, frozenset(tried) | pinned)
            if route is None and pinned:
                pinned = frozenset()
                continue
            if route is None:
                if busy is not None:
                    return Response(busy.content, busy.status_code, answer_headers(busy))
                return _error(503, "no replica is up" if not tried else
                              f"every replica failed ({len(tried)} tried)")
            rank = str(route.replica.rank)
            metrics.routed.labels(rank).inc()
            metrics.prefix_tokens.labels(rank).inc(route.matched_tokens)
            request = client.build_request(method, route.replica.url + url_tail, headers=headers, content=body)
            try:
                answer = await client.send(request, stream=True)
            except httpx.HTTPError:
                balancer.done(route)
                balancer.set_health(route.replica.rank, False)
                metrics.retried.labels(rank).inc()
                tried.add(route.replica.rank)
                continue
            if answer.status_code == 429 and len(tried) + 1 < len(balancer.replicas):
                busy = answer
                await answer.aread()
                await answer.aclose()
                balancer.done(route)
                tried.add(route.replica.rank)
                continue
            is_stream = answer.headers.get("content-type", "").startswith("text/event-stream")
            if not is_stream:
                try:
                    content = await answer.aread()
                except httpx.HTTPError:  # nothing was passed on yet: another replica answers instead
                    balancer.done(route)
                    balancer.set_health(route.replica.rank, False)
                    metrics.retried.labels(rank).inc()
                    tried.add(route.replica.rank)
                    continue
                finally:
                    await answer.aclose()
                balancer.done(route)
                if path == RESPONSES_PATH and answer.status_code == 200:
                    homes.note_answer(content, route.replica.rank)
                return Response(content, answer.status_code, answer_headers(answer))
            return StreamingResponse(_relay(answer, route, path == RESPONSES_PATH), answer.status_code,
                                     answer_headers(answer))

    def _others(rank: Optional[int]) -> frozenset[int]:
        """Every replica but `rank` (nothing when there is no rank to keep to)."""
        return frozenset() if rank is None else frozenset(r.rank for r in balancer.replicas if r.rank != rank)

    async def _relay(answer: httpx.Response, route: Route, stored: bool) -> AsyncIterator[bytes]:
        first = stored  # a Responses stream names its response in its first event
        try:
            async for chunk in answer.aiter_bytes():
                if first:
                    homes.note_stream(chunk, route.replica.rank)
                    first = False
                yield chunk
        except httpx.HTTPError as exc:
            balancer.set_health(route.replica.rank, False)
            error = {"error": {"message": f"replica {route.replica.rank} failed while streaming: "
                                          f"{exc.__class__.__name__}", "type": "server_error", "param": None,
                               "code": 502}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await answer.aclose()
            balancer.done(route)

    routes = [HTTPRoute("/health", health, methods=["GET"]),
              HTTPRoute("/metrics", metrics_route, methods=["GET"]),
              HTTPRoute("/{path:path}", proxy, methods=["GET", "POST", "DELETE", "PUT"])]
    return Starlette(routes=routes, lifespan=lifespan)

