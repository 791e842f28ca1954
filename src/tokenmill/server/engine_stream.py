"""`GET /v1/engine/stream`: the live engine stream the dashboard reads, as server-sent events.

Each event is one sample (engine/live_sample.py; schema in docs/dashboard.md), every `interval_ms`
(default 250). Samples are taken only while someone is connected; at most `MAX_WATCHERS` streams are
open at once (more get 429), and each stream's first sample carries the engine's recent step log. On a server
with tenants, each sample also carries their use (`tenants`): every tenant's to an admin tenant, its own row to
another.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable, Optional

from fastapi.responses import StreamingResponse

from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.server.serving_common import APIError
from tokenmill.server.tenants import current_tenant

MAX_WATCHERS = 8
DEFAULT_INTERVAL_MS = 250
INTERVAL_RANGE_MS = (50, 10_000)


class EngineStream:
    """The open live streams of one server."""

    def __init__(self, engine: AsyncEngine,
                 tenants_usage: Optional[Callable[[], list[dict[str, Any]]]] = None) -> None:
        self.engine = engine
        self.tenants_usage = tenants_usage  # TenantGate.usage on a server with tenants
        self.watchers = 0  # touched only on the event loop

    def open(self, interval_ms: int) -> StreamingResponse:
        """A new stream; APIError 400 for an interval outside INTERVAL_RANGE_MS, 429 past MAX_WATCHERS."""
        low, high = INTERVAL_RANGE_MS
        if not low <= interval_ms <= high:
            raise APIError(400, f"interval_ms must be between {low} and {high}, got {interval_ms}",
                           param="interval_ms")
        if self.watchers >= MAX_WATCHERS:
            raise APIError(429, f"{MAX_WATCHERS} engine streams are open, the most this server keeps; retry later",
                           "rate_limit_error", headers={"Retry-After": "5"})
        self.engine.watch(+1)
        self.watchers += 1
        return StreamingResponse(self._events(interval_ms / 1000), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _tenants_seen(self) -> list[dict[str, Any]]:
        """The tenants' use this stream's tenant may see (the stream runs in its request's context)."""
        tenant = current_tenant.get()
        rows = self.tenants_usage()
        return rows if tenant is None or tenant.admin else [r for r in rows if r["tenant"] == tenant.name]

    async def _events(self, interval: float) -> AsyncIterator[str]:
        try:
            after = 0
            while True:
                sample = await self.engine.live_sample(after)
                if self.tenants_usage is not None:
                    sample["tenants"] = self._tenants_seen()
                steps = sample["scheduler"]["steps"]
                if steps:
                    after = steps[-1]["seq"]
                yield f"data: {json.dumps(sample, separators=(',', ':'))}\n\n"
                await asyncio.sleep(interval)
        except EngineDeadError as exc:
            yield f"event: engine_error\ndata: {json.dumps({'message': str(exc)})}\n\n"
        finally:  # the client left (the response task is cancelled) or the engine stopped
            self.watchers -= 1
            try:
                self.engine.watch(-1)
            except EngineDeadError:
                pass
