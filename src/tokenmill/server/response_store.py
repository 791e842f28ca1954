"""The responses /v1/responses keeps (`store: true`), for GET, DELETE and `previous_response_id`.

A bounded, in-memory store: past `max_entries` the oldest response is dropped. Each entry keeps the
response object and the whole conversation it ended (its input and its output, as chat messages, without
the `instructions`, which OpenAI does not carry over), so a later request continues it. A conversation
shares its message dicts with the one it continued, so a long chain costs a list of references per turn.
It is only touched on the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenmill.server.serving_common import APIError


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the Response object as served, and the conversation it ended."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """At most `max_entries` responses by id, the oldest dropped first."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep `response` (by its id) and the conversation it ended, dropping the oldest past the bound."""
        self._entries[response["id"]] = StoredResponse(response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        """Drop a response; False when it was not stored."""
        return self._entries.pop(response_id, None) is not None

    def continued(self, previous_response_id: str) -> list[dict[str, Any]]:
        """The conversation a request with `previous_response_id` continues; a 400 naming the field when
        that response is not stored here."""
        stored = self._entries.get(previous_response_id)
        if stored is None:
            raise APIError(400, f"previous response '{previous_response_id}' is not stored here: it was never "
                                "stored (store: false), was deleted, or was dropped as the oldest of the "
                                f"{self.max_entries} this server keeps", param="previous_response_id")
        return stored.conversation

    def found(self, response_id: str) -> StoredResponse:
        """The stored response; a 404 (not_found_error) when it is not stored."""
        stored = self._entries.get(response_id)
        if stored is None:
            raise APIError(404, f"no response with id '{response_id}' is stored here", "not_found_error",
                           param="response_id")
        return stored
