"""Lines of OpenAI's batch input format run through the server's own routes, in-process: each line
`{"custom_id", "method": "POST", "url", "body"}` is posted to the app (chat completions, completions, embeddings,
Responses) exactly as a client's request would be, at most `max_concurrency` at once, queued in the engine below
every interactive request (engine/admission.py's batch_work), and answered by one output
line in OpenAI's shape: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A line
that fails (bad JSON, an unknown url, a body the route refuses) gets its own output line, with the route's error
body (status 400 and so on) or, for a line that is no request at all, `error`; the other lines go on.

`tokenmill run-batch` (cli/run_batch.py) drives it over files.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from tokenmill.engine.admission import batch_work

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


@dataclass(frozen=True)
class BatchLine:
    """One input line: its number (from 1) and what it asks, or why it is no request (`problem`)."""

    number: int
    custom_id: Optional[str]
    url: Optional[str] = None
    body: Optional[dict[str, Any]] = None
    problem: Optional[str] = None


def parse_line(number: int, text: str) -> BatchLine:
    """Line `number` of a batch file, checked: JSON with a string custom_id, method POST, a url this server batches
    and an object body; a streamed body is refused (a batch answers whole)."""
    try:
        item = json.loads(text)
    except ValueError as exc:
        return BatchLine(number, None, problem=f"line {number} is not JSON: {exc}")
    if not isinstance(item, dict):
        return BatchLine(number, None, problem=f"line {number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, problem=f"line {number} has no custom_id (a non-empty string)")
    url, body = item.get("url"), item.get("body")
    problem = (f"method must be POST, got {item.get('method')!r}" if item.get("method", "POST") != "POST"
               else f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}" if url not in BATCH_URLS
               else "body must be a JSON object" if not isinstance(body, dict)
               else "stream is not supported in a batch: each line is answered whole" if body.get("stream")
               else None)
    return BatchLine(number, custom_id, url, body, None if problem is None else f"line {number}: {problem}")


def output_line(custom_id: Optional[str], status: Optional[int] = None, body: Any = None,
                error: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """One output line in OpenAI's batch output shape."""
    response = None if status is None else {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}",
                                            "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


async def run_lines(app: Any, lines: Iterable[BatchLine], write: Callable[[dict[str, Any]], None],
                    max_concurrency: int, headers: Optional[dict[str, str]] = None,
                    done: Callable[[BatchLine, dict[str, Any]], None] = lambda line, result: None) -> dict[str, int]:
    """Post every line to `app` (at most `max_concurrency` in flight) and hand each output line to `write` (in the
    order they finish) and then, with its input line, to `done`. Returns the counts: completed (status 200) and failed."""
    import httpx

    counts = {"completed": 0, "failed": 0}
    slots = asyncio.Semaphore(max_concurrency)
    transport = httpx.ASGITransport(app=app)

    async def one(client: httpx.AsyncClient, line: BatchLine) -> None:
        batch_work.set(True)  # (this task's context: the routes run in it, in-process)
        async with slots:
            if line.problem is not None:
                result = output_line(line.custom_id, error={"code": "invalid_request", "message": line.problem})
            else:
                try:
                    response = await client.post(line.url, json=line.body, headers=headers)
                    result = output_line(line.custom_id, response.status_code, response.json())
                except Exception as exc:  # that line's alone
                    result = output_line(line.custom_id, error={"code": "internal_error",
                                                                "message": f"{type(exc).__name__}: {exc}"})
            ok = result["response"] is not None and result["response"]["status_code"] == 200
            counts["completed" if ok else "failed"] += 1
            write(result)
            done(line, result)

    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        pending: set[asyncio.Task] = set()
        try:
            for line in lines:
                while len(pending) >= 4 * max_concurrency:  # the lines read ahead stay bounded
                    finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    _raise_any(finished)
                pending.add(asyncio.create_task(one(client, line)))
            if pending:
                finished, pending = await asyncio.wait(pending)
                _raise_any(finished)
        finally:  # cancelled (or failed): the lines still running end with it, their requests aborted
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
    return counts


def _raise_any(tasks: set[asyncio.Task]) -> None:
    """What a finished task raised beyond its line (writing the output failed): the run cannot go on."""
    for task in tasks:
        if task.exception() is not None:
            raise task.exception()
