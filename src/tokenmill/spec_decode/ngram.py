"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's last n tokens (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.spec_decode.controller import Draft

if TYPE_CHECKING:
    from tokenmill.request import Request


class NgramProposer:
    """Proposes up to k tokens per request from its own prompt and output, no model involved.

    For n from `max_n` down to `min_n`, the last n tokens are looked up in the sequence before them; the
    latest match wins and its continuation (up to k tokens, never past the sequence's end) is proposed.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """The proposal for one sequence; empty when no suffix of length >= min_n occurred before."""
        length = len(token_ids)
        if k < 1 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # window i covers tokens[i:i+n]; i <= length-1-n, so at least one token follows every match
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []

    def propose(self, wanted: list[tuple["Request", int]]) -> dict[str, Draft]:
        """Proposals for (request, most tokens) pairs, looked up in each request's prompt + output."""
        result = {}
        for request, room in wanted:
            proposal = self.propose_one(request.prompt_token_ids + request.output_token_ids, room)
            if proposal:
                result[request.request_id] = Draft(proposal)
        return result

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""
