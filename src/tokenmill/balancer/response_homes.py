"""Which replica keeps each stored response, so the data-parallel front sends what refers to one there.

Each replica stores its own /v1/responses answers (server/response_store.py). A request that continues
one (`previous_response_id`) or reads or deletes one (`GET`/`DELETE /v1/responses/{id}`) must reach the
replica that made it; the front notes the id of every response a replica sends back (the `id` of a whole
answer, or the one in a stream's first event, `response.created`) and remembers the newest
`max_entries`.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any, Optional

RESPONSES_PATH = "/v1/responses"
_STREAMED_ID = re.compile(rb'"response":\{"id":"(resp_[0-9a-f]+)"')
_ID = re.compile(r"^resp_[0-9a-f]+$")


class ResponseHomes:
    """Response id -> the rank of the replica that made it, for the newest `max_entries` responses."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._homes: OrderedDict[str, int] = OrderedDict()

    def note(self, response_id: str, rank: int) -> None:
        """Remember that replica `rank` made `response_id`."""
        self._homes[response_id] = rank
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)

    def note_answer(self, body: bytes, rank: int) -> None:
        """Note the id of a whole /v1/responses answer (nothing for an error or anything else)."""
        try:
            answer = json.loads(body)
        except ValueError:
            return
        if isinstance(answer, dict) and isinstance(answer.get("id"), str) and _ID.match(answer["id"]):
            self.note(answer["id"], rank)

    def note_stream(self, first_bytes: bytes, rank: int) -> None:
        """Note the id in the first bytes of a streamed /v1/responses answer (its response.created event)."""
        found = _STREAMED_ID.search(first_bytes)
        if found:
            self.note(found.group(1).decode(), rank)

    def home(self, method: str, path: str, payload: Any) -> Optional[int]:
        """The replica a request must reach: the maker of the response it continues, reads or deletes;
        None when it refers to none, or to one this front did not see made."""
        if path == RESPONSES_PATH and method == "POST" and isinstance(payload, dict):
            referred = payload.get("previous_response_id")
        elif path.startswith(RESPONSES_PATH + "/") and method in ("GET", "DELETE"):
            referred = path[len(RESPONSES_PATH) + 1:]
        else:
            return None
        return self._homes.get(referred) if isinstance(referred, str) else None
