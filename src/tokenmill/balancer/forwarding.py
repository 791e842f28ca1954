"""What a front (the data-parallel balancer, the disaggregation proxy) passes on of a request and an answer."""

from __future__ import annotations

import httpx
from starlette.requests import Request

# connection-level headers, which belong to one hop and are never passed on
HOP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive"})


def request_headers(request: Request) -> dict[str, str]:
    """The client's headers to send upstream (its API key and trace context included)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}


def answer_headers(answer: httpx.Response) -> dict[str, str]:
    """The upstream answer's headers to send back. Its body is passed on decoded (`content`,
    `aiter_bytes`), so its content-encoding no longer applies."""
    return {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
