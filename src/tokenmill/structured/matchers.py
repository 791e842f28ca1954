"""The runner's grammar state per request: masks constrained rows' logits, advances with accepted tokens."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tokenmill.structured.compiler import GrammarCache
from tokenmill.structured.spec import StructuredOutput


class GrammarMatchers:
    """One xgrammar matcher per constrained request, created at its first sampled token.

    `mask` sets to -inf, in place, every logit the grammar forbids at each position to be sampled,
    before any sampling control sees them. With speculative proposals the matcher walks through them
    to mask every verified position, then rolls back; `advance` then feeds it the tokens actually kept.
    A matcher terminates when its grammar is complete (no stop token needed): the tokens after that
    point are cut and the request finishes.
    """

    def __init__(self, cache: GrammarCache) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.cache = cache
        self.matchers: dict[str, Any] = {}

    def drop(self, request_id: str) -> None:
        """Forget a finished request's matcher."""
        self.matchers.pop(request_id, None)

    def _matcher(self, request_id: str, spec: StructuredOutput) -> Any:
        matcher = self.matchers.get(request_id)
        if matcher is None:
            matcher = self._xgr.GrammarMatcher(self.cache.compile(spec), terminate_without_stop_token=True)
            self.matchers[request_id] = matcher
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, str, StructuredOutput, list[int]]]) -> None:
        """Mask, in place, logits rows first .. first + len(proposals) of each (first, request id, spec,
        proposals): row first + i is the position after proposals[:i]."""
        bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.cache.vocab_size)
        masked: list[int] = []
        for first, request_id, spec, proposals in rows:
            matcher = self._matcher(request_id, spec)
            advanced = 0
            for i in range(len(proposals) + 1):
                if matcher.is_terminated():
                    break  # the grammar is complete: whatever follows is cut by `advance`
                matcher.fill_next_token_bitmask(bitmask, first + i)
                masked.append(first + i)
                if i == len(proposals) or not matcher.accept_token(proposals[i]):
                    break  # a proposal the grammar forbids is rejected at its own (masked) position
                advanced += 1
            if advanced:
                matcher.rollback(advanced)
        if masked:
            apply_bitmask(logits, bitmask, masked)

    def fork(self, request_id: str) -> Optional[Any]:
        """A copy of the request's matcher in its current state (None before its first token), for a
        draft to propose only what the grammar allows."""
        matcher = self.matchers.get(request_id)
        return None if matcher is None else matcher.fork()

    def mask_with(self, logits: torch.Tensor, rows: list[tuple[int, Any]]) -> None:
        """Mask, in place, logits row r by matcher m's next allowed tokens, for each (r, m) whose matcher
        has not terminated."""
        bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.cache.vocab_size)
        masked = []
        for row, matcher in rows:
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
                masked.append(row)
        if masked:
            apply_bitmask(logits, bitmask, masked)

    def advance(self, request_id: str, tokens: list[int]) -> tuple[list[int], bool]:
        """Feed the step's tokens to the request's matcher: (the tokens up to where the grammar
        completed, whether it did)."""
        matcher = self.matchers[request_id]
        for index, token in enumerate(tokens):
            if matcher.is_terminated():
                return tokens[:index], True
            if not matcher.accept_token(token):
                raise RuntimeError(f"request {request_id}: token {token} was sampled although its grammar forbids it")
        return tokens, matcher.is_terminated()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, t] = -inf where bit t of bitmask[r] is 0, for each r in rows (xgrammar's kernel)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
