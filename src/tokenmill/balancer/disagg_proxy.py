"""`tokenmill disagg-proxy`: one port in front of a prefill server and a decode server.

For each /v1/completions or /v1/chat/completions request (with n = 1), the proxy first sends it to the
prefill server with max_tokens 1, not streamed, and `kv_transfer_params: {"do_remote_decode": true}`;
then it sends the original request to the decode server with the `kv_transfer_params` the prefill
server answered, and passes the decode server's answer (streamed or not) back. When the prefill server
fails or answers no usable transfer, the decode server prefills itself: the answer is the same, only
slower. A prefill answer of 4xx (the request itself is bad) is passed back as it is. Every other path
goes to the decode server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from typing import Any, AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenmill.balancer.forwarding import answer_headers, request_headers

logger = logging.getLogger(__name__)

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server runs it: one token, not streamed, its blocks written for transfer."""
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    return prefill


def build_proxy_app(prefill_url: str, decode_url: str) -> Starlette:
    """The proxy's HTTP application."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    counts = {"disaggregated": 0, "local_prefill": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.aclose()

    async def generate(request: Request, headers: dict[str, str], body: bytes) -> Response:
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser: the replica says which
            payload = None
        if isinstance(payload, dict) and payload.get("n", 1) == 1 and "kv_transfer_params" not in payload:
            transfer = None
            try:
                answer = await client.post(prefill_url + request.url.path, json=prefill_body(payload), headers=headers)
                if 400 <= answer.status_code < 500:
                    return Response(answer.content, answer.status_code, answer_headers(answer))
                if answer.status_code == 200:
                    transfer = answer.json().get("kv_transfer_params")
            except (httpx.HTTPError, ValueError) as exc:
                logger.warning("the prefill server failed (%s): the decode server prefills", exc)
            if transfer and transfer.get("do_remote_prefill"):
                counts["disaggregated"] += 1
                body = json.dumps({**payload, "kv_transfer_params": transfer}).encode()
            else:
                counts["local_prefill"] += 1
        return await forward(request, headers, body)

    async def forward(request: Request, headers: dict[str, str], body: bytes) -> Response:
        url = decode_url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = client.build_request(request.method, url, headers=headers, content=body)
        try:
            answer = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": {"message": f"the decode server failed: {exc.__class__.__name__}",
                                           "type": "server_error", "param": None, "code": 502}}, 502)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_bytes():
                    yield chunk
            finally:
                await answer.aclose()

        return StreamingResponse(relay(), answer.status_code, answer_headers(answer))

    async def proxy(request: Request) -> Response:
        body = await request.body()
        headers = request_headers(request)
        if request.method == "POST" and request.url.path in _GENERATION_PATHS:
            return await generate(request, headers, body)
        return await forward(request, headers, body)

    async def stats(request: Request) -> Response:
        return JSONResponse(counts)

    routes = [Route("/disagg/stats", stats, methods=["GET"]),
              Route("/{path:path}", proxy, methods=["GET", "POST", "DELETE", "PUT"])]
    return Starlette(routes=routes, lifespan=lifespan)



def add_disagg_proxy_parser(sub: argparse._SubParsersAction) -> None:
    """The `tokenmill disagg-proxy` subcommand."""
    p = sub.add_parser("disagg-proxy", help="pair a prefill server and a decode server behind one port",
                       description="Serve the OpenAI API on one port: each completion is prefilled on --prefill "
                                   "(max_tokens 1, its KV blocks written for transfer) and generated on --decode "
                                   "from those blocks. Both servers need the same model, flags and "
                                   "--kv-transfer-config folder (docs/scale-out.md). GET /disagg/stats counts "
                                   "the requests disaggregated and those the decode server prefilled itself.")
    p.add_argument("--prefill", required=True, metavar="URL", help="the prefill server, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL", help="the decode server, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.set_defaults(func=_run, log_level_default="INFO")


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_proxy_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False)
    return 0
