"""The responses /v1/responses keeps (`store: true`), for GET, DELETE and `previous_response_id`.

A bounded store: past `max_entries` responses, or `max_bytes` (each counted as the UTF-8 JSON of its response and
its conversation), the oldest are dropped. Each entry keeps the response object and the
whole conversation it ended (its input and its output, as chat messages, without the `instructions`, which OpenAI
does not carry over), so a later request continues it. In memory by default, where a conversation shares its
message dicts with the one it continued (a long chain costs a list of references per turn); with `--state-dir` in
the state database (server/durable_state.py), so a restarted server continues a conversation. A tenant's responses
are its own: they are kept under `<tenant>/<id>`, so another tenant's id is not found. It is only touched on the
event loop.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.server.serving_common import APIError
from tokenmill.server.tenants import current_tenant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the Response object as served, and the conversation it ended."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class MemoryResponses:
    """Stored responses in memory, oldest first (the `ResponseStore`'s shelf without a state folder)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]], size: int) -> None:
        """Store (or replace, as the newest) the response and its conversation, counted as `size` bytes."""
        self.delete(response_id)
        self._entries[response_id] = (response, conversation, size)
        self._bytes += size

    def get(self, response_id: str) -> Optional[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """(response, conversation), or None."""
        entry = self._entries.get(response_id)
        return None if entry is None else entry[:2]

    def delete(self, response_id: str) -> bool:
        """Drop one; False when it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[2]
        return entry is not None

    def keep_newest(self, count: int, max_bytes: int) -> int:
        """Drop the oldest until at most `count` are kept, holding at most `max_bytes`; how many were dropped."""
        dropped = 0
        while self._entries and (len(self._entries) > count or self._bytes > max_bytes):
            self._bytes -= self._entries.popitem(last=False)[1][2]
            dropped += 1
        return dropped


class ResponseStore:
    """At most `max_entries` responses by id, the oldest dropped first; kept in the state database under
    `state_dir` when one is given, else in memory."""

    def __init__(self, max_entries: int, state_dir: Optional[str] = None, max_bytes: int = 256 << 20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries and max_bytes must be >= 1, got {max_entries} and {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        if state_dir is None:
            self._shelf: Any = MemoryResponses()
        else:
            from tokenmill.server.durable_state import SqliteResponses

            self._shelf = SqliteResponses(state_dir)
            self._shelf.keep_newest(max_entries, max_bytes)  # (a restart with smaller bounds)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep `response` (by its id) and the conversation it ended, dropping the oldest past the bounds; one that
        alone is larger than max_bytes is not kept (a log line says so), and the others stay."""
        size = len(json.dumps(response).encode()) + len(json.dumps(conversation).encode())
        if size > self.max_bytes:
            logger.warning("response %s was not kept: it and its conversation take %d bytes, more than the %d the "
                           "store holds (--max-stored-responses-mb)", response["id"], size, self.max_bytes)
            return
        self._shelf.put(_key(response["id"]), response, conversation, size)
        self._shelf.keep_newest(self.max_entries, self.max_bytes)

    def delete(self, response_id: str) -> bool:
        """Drop a response; False when it was not stored."""
        return self._shelf.delete(_key(response_id))

    def continued(self, previous_response_id: str) -> list[dict[str, Any]]:
        """The conversation a request with `previous_response_id` continues; a 400 naming the field when
        that response is not stored here."""
        stored = self._shelf.get(_key(previous_response_id))
        if stored is None:
            raise APIError(400, f"previous response '{previous_response_id}' is not stored here: it was never "
                                "stored (store: false), was deleted, or was dropped as the oldest of the "
                                f"{self.max_entries} (and {self.max_bytes >> 20} MiB) this server keeps",
                           param="previous_response_id")
        return stored[1]

    def found(self, response_id: str) -> StoredResponse:
        """The stored response; a 404 (not_found_error) when it is not stored."""
        stored = self._shelf.get(_key(response_id))
        if stored is None:
            raise APIError(404, f"no response with id '{response_id}' is stored here", "not_found_error",
                           param="response_id")
        return StoredResponse(*stored)


def _key(response_id: str) -> str:
    """Where the request's tenant keeps `response_id` (response ids hold no '/')."""
    tenant = current_tenant.get()
    return response_id if tenant is None else f"{tenant.name}/{response_id}"
