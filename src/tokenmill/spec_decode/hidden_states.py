"""The target's hidden states an EAGLE-3 head or an MTP layer reads: recorded by the target's runner at every
step, held per request until the draft consumes them."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tokenmill.attention.base import SequenceChunk
from tokenmill.worker.request_state import BatchItem


class HiddenStates:
    """Per request, the draft-ready hidden rows of the positions [first, end) the draft has not read yet.

    `rows_of(hidden)` turns a step's final hidden states [T, hidden] into the draft's rows [T, draft hidden]
    (EAGLE-3: `fc` of the target's three taps; MTP: the states themselves). A step's chunk overwrites what was held
    from its first position on (a verification's rejected positions, a recomputation after preemption); a chunk
    that does not continue what is held (a prefix-cache hit, a swapped-in request) replaces it, and the draft
    then lacks the positions before it (`rows` answers None: that request does not speculate).

    Bound: at most one row per token the target holds in its KV cache, each draft-hidden wide; a finished
    request's rows go at the runner's next step (`drop`).
    """

    def __init__(self, rows_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.rows_of = rows_of
        self._held: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request id -> (first position, row blocks)

    def record(self, batch: list[BatchItem], chunks: list[SequenceChunk], hidden: torch.Tensor) -> None:
        """Keep the rows of the step's chunks (the target runner calls it after every forward pass)."""
        rows = self.rows_of(hidden)
        for item, chunk in zip(batch, chunks):
            self._put(item.request_id, item.start, rows[chunk.query_start:chunk.query_start + chunk.query_len].clone())

    def drop(self, request_ids) -> None:
        """Forget the rows of requests that ended."""
        for request_id in request_ids:
            self._held.pop(request_id, None)

    def _put(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        held = self._held.get(request_id)
        if held is not None:
            first, blocks = held
            if first <= start <= first + sum(len(b) for b in blocks):
                kept = torch.cat(blocks)[:start - first] if start > first else rows[:0]
                self._held[request_id] = (first, [kept, rows] if len(kept) else [rows])
                return
        self._held[request_id] = (start, [rows])

    def holds(self, request_id: str, first: int, end: int) -> bool:
        """Whether the rows of positions [first, end) are held."""
        held = self._held.get(request_id)
        return held is not None and held[0] <= first and held[0] + sum(len(b) for b in held[1]) >= end

    def take(self, request_id: str, first: int, end: int) -> Optional[torch.Tensor]:
        """The rows of positions [first, end) (None unless held); the rows before end - 1 are let go (the last
        stays: a request that proposes again before it advances reads it once more)."""
        if not self.holds(request_id, first, end):
            return None
        start, blocks = self._held[request_id]
        rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        self._held[request_id] = (end - 1, [rows[end - 1 - start:]])
        return rows[first - start:end - start]
