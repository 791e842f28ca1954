"""The FastAPI app: OpenAI endpoints, tokenizer endpoints, health, version, metrics, auth, errors."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.tracing import TRACE_HEADERS, incoming_trace
from tokenmill.multimodal.media import MediaPolicy
from tokenmill.server.batch_api import add_batch_api
from tokenmill.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest)
from tokenmill.server.engine_stream import DEFAULT_INTERVAL_MS, EngineStream
from tokenmill.server.lora_routes import ServedModels, add_lora_routes
from tokenmill.server.rl_routes import add_rl_routes
from tokenmill.server.pages import PAGES, STATIC_PREFIX, mount_pages
from tokenmill.server.harmony import harmony_for
from tokenmill.server.reasoning import reasoning_parser
from tokenmill.server.request_limits import RequestLimits
from tokenmill.server.serving_chat import ChatHandler
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.serving_responses import ResponsesHandler, add_responses_routes
from tokenmill.server.serving_messages import MessagesHandler, add_messages_routes
from tokenmill.server.serving_common import (ENGINE_ERRORS, APIError, ClientDisconnected, engine_error_response,
                                             error_response, new_id, respond)
from tokenmill.server.serving_completion import CompletionHandler, prompt_items, tokenize_prompts
from tokenmill.server.tool_calls import tool_mode
from tokenmill.server.tenant_gate import TenantGate, TenantGateMiddleware, check_tenant_model
from tokenmill.server.tenants import Tenants, current_tenant
from tokenmill.server.transport import add_cors
from tokenmill.structured.json_text import MAX_NESTING
from tokenmill.version import __version__

logger = logging.getLogger(__name__)

_error = error_response


class BodyLimitMiddleware:
    """Answers 413 to a request whose body is larger than `max_bytes` (by its Content-Length, or once
    the bytes read pass the limit), before the body is parsed."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # the app's handlers answer it (FastAPI re-raises HTTPException)
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than this server takes ({self.max_bytes} bytes)"

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        await _error(413, self._message(), "invalid_request_error", path=scope.get("path", ""))(scope, receive, send)


# FastAPI's 400 when decoding a body raises anything but a JSON syntax error (a RecursionError past about
# 1,000 levels, a UnicodeDecodeError)
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"


# the names pydantic gives a union's branches in an error's location ("str", "list[...]", "function-after[...]")
_BRANCH_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "null"}


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """(message, param) of the error a request's body most specifically fails: the deepest location (a
    field inside the branch of a union the body meant), named without the union's branch names."""
    error = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
    loc = [str(part) for part in error.get("loc", ())
           if part != "body" and not (isinstance(part, str) and ("[" in part or part in _BRANCH_NAMES))]
    param = ".".join(loc) or None
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    if kind == "extra_forbidden":
        return f"'{param}' is not supported by this server", param
    if kind == "missing":
        return f"'{param}' is required", param
    if kind == "value_error":
        return str(error.get("msg")).removeprefix("Value error, "), param
    return f"'{param}': {error.get('msg')}" if param else str(error.get("msg")), param


class TraceHeadersMiddleware:
    """Keeps an HTTP request's W3C trace headers for the engine requests it starts (engine/tracing.py)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                       if k.decode("latin-1") in TRACE_HEADERS}
            if "traceparent" in headers:
                incoming_trace.set(headers)
        await self.app(scope, receive, send)


def rendered_params(body: Any, max_tokens: Optional[int]) -> dict[str, Any]:
    """The sampling parameters a render endpoint reports (APIError 400 when the request's are invalid)."""
    try:
        params = body.sampling_params(max_tokens, None)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return {name: getattr(params, name) for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed",
                                                     "max_tokens", "min_tokens", "ignore_eos", "stop",
                                                     "stop_token_ids", "repetition_penalty",
                                                     "presence_penalty", "frequency_penalty")}


def base_app(config: ServerConfig, tenants: Optional[Tenants], model_name: str, tracing: bool,
             fault: Callable[[], Optional[str]], model_cards: Callable[[int], list[dict[str, Any]]],
             render_metrics: Callable[[], bytes]) -> tuple[FastAPI, Callable[[Optional[str]], None]]:
    """What every tokenmill server has, whatever its model does: the middleware (body limit, tracing, the
    tenants' gate when `tenants` are given: app.state.tenant_gate), the OpenAI-shaped error handlers, /health
    (503 while `fault()` says why), /version, /v1/models (`model_cards(created)`, those the tenant may use) and
    /metrics. Returns the app and the check of a body's `model`."""
    app = FastAPI(title="tokenmill", version=__version__)
    app.state.tenant_gate = gate = TenantGate(tenants) if tenants is not None else None
    started = int(time.time())
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(config.max_request_body_mb * (1 << 20)))
    if tracing:
        app.add_middleware(TraceHeadersMiddleware)
    if gate is not None:  # added last, so it runs first: no body of an unauthenticated request is read
        open_paths = {"/health", *PAGES} | (set() if config.metrics_require_key else {"/metrics"})
        app.add_middleware(TenantGateMiddleware, gate=gate, open_paths=frozenset(open_paths),
                           open_prefix=STATIC_PREFIX)
    add_cors(app, config)  # outermost: a browser's preflight carries no key, and a 401 still gets its CORS headers

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param, path=request.url.path)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param, exc.headers, request.url.path)

    async def on_engine_error(request: Request, exc: Exception) -> JSONResponse:
        return engine_error_response(exc, request.url.path)

    for engine_error in ENGINE_ERRORS:
        app.add_exception_handler(engine_error, on_engine_error)

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == _FASTAPI_PARSE_ERROR:  # the JSON parser failed other than on syntax
            detail = (f"the request body could not be parsed: it is not UTF-8 JSON text, or it nests deeper than "
                      f"the parser follows (a body may nest at most {MAX_NESTING} levels)")
        return _error(exc.status_code, detail, type_, path=request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error(500, "internal server error", "internal_error", path=request.url.path)

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'.",
                           "not_found_error", "model")
        check_tenant_model(model_name)

    @app.get("/health")
    async def health() -> Response:
        reason = fault()
        if reason is None:
            return Response(status_code=200)
        return _error(503, reason, "service_unavailable")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        tenant = current_tenant.get()
        return {"object": "list", "data": [card for card in model_cards(started)
                                           if tenant is None or tenant.may_use(card["id"])]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics() + (gate.render_metrics() if gate is not None else b""),
                        media_type=CONTENT_TYPE_LATEST)

    return app, check_model


def refuse(app: FastAPI, paths: tuple[str, ...], message: str) -> None:
    """Answer POSTs to `paths` with a 400 saying `message` (routes of the other kind of model)."""
    async def refused() -> None:
        raise APIError(400, message, param="model")

    for path in paths:
        app.post(path, include_in_schema=False)(refused)


POOLING_PATHS = ("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank")


def build_app(engine: AsyncEngine, config: ServerConfig, chat_template: Optional[str],
              tenants: Optional[Tenants] = None) -> FastAPI:
    """The HTTP application over a running AsyncEngine; with `tenants`, every route but /health (and
    /metrics, unless config.metrics_require_key) requires a tenant's key."""
    model_name = engine.model_name
    limits = RequestLimits.from_config(config)
    served = ServedModels(model_name, engine.info.loras)
    completions = CompletionHandler(engine, model_name, limits, served.adapter)
    harmony = harmony_for(engine.info.architecture, engine.tokenizer, config.reasoning_parser,
                          config.tool_call_parser)
    if harmony is not None:  # GPT-OSS: harmony renders its prompts and reads its thinking and calls
        chat = ChatHandler(engine, model_name, chat_template, limits, served.adapter,
                           media=MediaPolicy.from_config(config), harmony=harmony)
    else:
        chat = ChatHandler(engine, model_name, chat_template, limits, served.adapter,
                           reasoning_parser(config.reasoning_parser, engine.tokenizer), config.tool_call_parser,
                           MediaPolicy.from_config(config))
    app, _ = base_app(
        config, tenants, model_name, engine.tracer is not None,
        lambda: None if engine.is_alive else engine.fault or "the engine is not running",
        lambda created: served.cards(created, {"max_model_len": engine.info.max_model_len}), engine.metrics.render)
    gate = app.state.tenant_gate
    live = EngineStream(engine, gate.usage if gate is not None else None)
    add_lora_routes(app, served, config.state_dir)
    add_rl_routes(app, engine, config.enable_sleep_mode)
    add_batch_api(app, config.state_dir, config.files_max_mb, config.batch_max_concurrency)

    def check_model(name: Optional[str]) -> None:
        served.adapter(name)  # 404 for a name this server does not serve
        check_tenant_model(name or model_name)  # 403 for one the tenant may not use
    refuse(app, POOLING_PATHS, f"the model '{model_name}' generates text; it does not embed or score (serve an "
                               "embedding model for /v1/embeddings, /v1/score and /v1/rerank)")

    mount_pages(app)

    @app.get("/v1/engine/stream", include_in_schema=False)  # an endless stream: docs/dashboard.md describes it
    async def engine_stream(interval_ms: int = DEFAULT_INTERVAL_MS) -> Response:
        return live.open(interval_ms)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            tokens = await chat.prompt_ids(body.messages, body.add_generation_prompt)
        else:
            tokens = (await asyncio.to_thread(engine.tokenizer, body.prompt,
                                              add_special_tokens=body.add_special_tokens)).input_ids
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = engine.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    # vLLM's render endpoints: the token ids a request's prompt becomes, computed without generating;
    # routers (vllm-router) call them to place a request by its prefix
    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        check_model(body.model)
        limits.check(body)
        params = rendered_params(body, body.max_tokens)
        prompts = await asyncio.to_thread(tokenize_prompts, prompt_items(body), engine.tokenizer)
        return [{"request_id": new_id("cmpl"), "token_ids": p.token_ids, "sampling_params": params,
                 "model": model_name} for p in prompts]

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        check_model(body.model)
        limits.check(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = rendered_params(body, max_tokens)
        try:
            tools = tool_mode(body)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tools") from None
        tokens = await chat.prompt_ids(body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs)
        return {"request_id": new_id("chatcmpl"), "token_ids": tokens, "sampling_params": params,
                "model": model_name}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await respond(completions, body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await respond(chat, body, request)

    store = ResponseStore(config.max_stored_responses, config.state_dir,
                          int(config.max_stored_responses_mb * (1 << 20)))
    add_responses_routes(app, ResponsesHandler(chat, store), check_model)

    add_messages_routes(app, MessagesHandler(chat, engine.info.sampling_defaults), check_model)

    return app
