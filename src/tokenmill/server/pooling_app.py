"""The HTTP application of a server whose model embeds: /v1/embeddings, /v1/score, /v1/rerank, /tokenize."""

from __future__ import annotations

import asyncio
from typing import Any, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.config import ServerConfig
from tokenmill.pooling.engine import PoolingEngine
from tokenmill.server.batch_api import add_batch_api
from tokenmill.server.api_server import POOLING_PATHS, base_app, refuse
from tokenmill.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from tokenmill.server.protocol import TokenizeRequest
from tokenmill.server.request_limits import RequestLimits
from tokenmill.server.serving_common import APIError, unless_disconnected
from tokenmill.server.serving_pooling import PoolingHandler
from tokenmill.server.tenants import Tenants

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/completions/render",
                    "/v1/chat/completions/render")


class PoolingMetrics:
    """The pooling engine's counters in Prometheus' text format, named like the generation engine's."""

    def __init__(self, engine: PoolingEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        """The families, read from the engine's stats now."""
        stats = self.engine.stats()
        for name, doc, value in (("request_success", "Requests answered.", stats.requests),
                                 ("prompt_tokens", "Input tokens of answered requests.", stats.prompt_tokens),
                                 ("num_requests_rejected", "Requests refused with 429.", stats.rejected),
                                 ("pooling_steps", "Encoding steps run.", stats.steps)):
            family = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        waiting = GaugeMetricFamily("tokenmill:num_sequences_waiting", "Inputs waiting for a step.",
                                    labels=["model_name"])
        waiting.add_metric([self.model_name], stats.waiting_sequences)
        yield waiting

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


def build_pooling_app(engine: PoolingEngine, config: ServerConfig, model_name: str,
                      tenants: Optional[Tenants] = None) -> FastAPI:
    """The HTTP application over a running PoolingEngine (same middleware, errors and auth as build_app)."""
    limits = RequestLimits.from_config(config)
    handler = PoolingHandler(engine, model_name, limits)
    metrics = PoolingMetrics(engine, model_name)
    model = engine.model
    card = {"object": "model", "owned_by": "tokenmill", "root": model_name, "parent": None,
            "max_model_len": model.max_model_len}
    app, check_model = base_app(config, tenants, model_name, False, lambda: None,
                                lambda created: [{"id": model_name, "created": created, **card}], metrics.render)
    refuse(app, GENERATION_PATHS, f"the model '{model_name}' is an embedding model; it does not generate text "
                                  "(use /v1/embeddings, /v1/score or /v1/rerank)")
    add_batch_api(app, config.state_dir, config.files_max_mb, config.batch_max_concurrency)

    async def answer(body: Any, request: Request, work: Any) -> JSONResponse:
        check_model(body.model)
        return JSONResponse(await unless_disconnected(request, work(body)))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        return await answer(body, request, handler.embeddings)

    async def score(body: ScoreRequest, request: Request) -> JSONResponse:
        return await answer(body, request, handler.score)

    async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
        return await answer(body, request, handler.rerank)

    for path in POOLING_PATHS:
        if "score" in path:
            app.post(path)(score)
        elif "rerank" in path:
            app.post(path)(rerank)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.prompt is None:
            raise APIError(400, "an embedding model tokenizes a 'prompt' (it has no chat template)", param="prompt")
        tokens = (await asyncio.to_thread(model.tokenizer, body.prompt,
                                          add_special_tokens=body.add_special_tokens)).input_ids
        return {"tokens": tokens, "count": len(tokens), "max_model_len": model.max_model_len}

    return app
