"""The runner's grammar state per request: masks constrained rows' logits, advances with accepted tokens."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tokenmill.core.sched_output import GrammarMasks
from tokenmill.structured.compiler import GrammarCache
from tokenmill.structured.spec import StructuredOutput


class GrammarMatchers:
    """One xgrammar matcher per constrained request, created at its first sampled token.

    These live with the engine, not the runner: `masks` gives, for the step's constrained rows, the
    bitmasks the runner applies to the logits before any sampling control sees them (with speculative
    proposals the matcher walks through them to mask every verified position, then rolls back);
    after the step `advance` feeds each matcher the tokens actually kept.
    A matcher terminates when its grammar is complete (no stop token needed): the tokens after that
    point are cut and the request finishes.
    A spec with `after_token` leaves the output free until that token (the end of a model's thinking) has
    been kept; `awaiting` holds the requests still before it, whose positions are not masked.
    """

    def __init__(self, cache: GrammarCache) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.cache = cache
        self.matchers: dict[str, Any] = {}
        self.awaiting: dict[str, int] = {}  # request id -> the token after which its grammar starts

    def drop(self, request_id: str) -> None:
        """Forget a finished request's matcher."""
        self.matchers.pop(request_id, None)
        self.awaiting.pop(request_id, None)

    def _matcher(self, request_id: str, spec: StructuredOutput) -> Any:
        matcher = self.matchers.get(request_id)
        if matcher is None:
            matcher = self._xgr.GrammarMatcher(self.cache.compile(spec), terminate_without_stop_token=True)
            self.matchers[request_id] = matcher
            if spec.after_token is not None:
                self.awaiting[request_id] = spec.after_token
        return matcher

    def masks(self, rows: list[tuple[str, StructuredOutput, list[int]]]) -> Optional[GrammarMasks]:
        """The bitmasks of each (request id, spec, proposals)'s positions to sample this step: its
        position after proposals[:i] for i = 0 .. len(proposals), stopping at a completed grammar or
        after a proposal the grammar forbids (that proposal is then rejected at its own, masked
        position). None when no row is constrained."""
        if not rows:
            return None
        total = sum(len(proposals) + 1 for _, _, proposals in rows)
        bitmask = self._xgr.allocate_token_bitmask(total, self.cache.vocab_size)
        placed: dict[str, tuple[int, int]] = {}
        next_row = 0
        for request_id, spec, proposals in rows:
            matcher = self._matcher(request_id, spec)
            advanced = count = 0
            free = self._free_positions(request_id, proposals)
            if free > len(proposals):  # the grammar does not start within this step: nothing to mask
                placed[request_id] = (next_row, 0)
                continue
            bitmask[next_row:next_row + free] = -1  # positions up to the grammar's start take any token
            count = free
            for i in range(free, len(proposals) + 1):
                if matcher.is_terminated():
                    break  # the grammar is complete: whatever follows is cut by `advance`
                matcher.fill_next_token_bitmask(bitmask, next_row + count)
                count += 1
                if i == len(proposals) or not matcher.accept_token(proposals[i]):
                    break
                advanced += 1
            if advanced:
                matcher.rollback(advanced)
            placed[request_id] = (next_row, count)
            next_row += count
        return GrammarMasks(bitmask[:next_row].clone(), placed)

    def _free_positions(self, request_id: str, proposals: list[int]) -> int:
        """How many of the step's positions (after proposals[:i], i = 0 .. len) come before the request's
        grammar starts: 0 when it has started; len(proposals) + 1 when no proposal is its start token."""
        start = self.awaiting.get(request_id)
        if start is None:
            return 0
        return proposals.index(start) + 1 if start in proposals else len(proposals) + 1

    def fork(self, request_id: str) -> Optional[Any]:
        """A copy of the request's matcher in its current state (None before its first token, or while its
        grammar has not started), for a draft to propose only what the grammar allows."""
        matcher = self.matchers.get(request_id)
        return None if matcher is None or request_id in self.awaiting else matcher.fork()

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
        start = self.awaiting.get(request_id)
        if start is not None:
            if start not in tokens:
                return tokens, False
            del self.awaiting[request_id]
            free = tokens.index(start) + 1
            kept, completed = self.advance(request_id, tokens[free:])
            return tokens[:free] + kept, completed
        for index, token in enumerate(tokens):
            if matcher.is_terminated():
                return tokens[:index], True
            if not matcher.accept_token(token):
                raise RuntimeError(f"request {request_id}: token {token} was sampled although its grammar forbids it")
        return tokens, matcher.is_terminated()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, t] = -inf where bit t of bitmask[r] is 0, for each r in rows (xgrammar's kernel;
    bitmask has a row per logits row)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def apply_masks(logits: torch.Tensor, masks: GrammarMasks, rows: list[tuple[int, str]]) -> None:
    """Apply `masks` in place to `logits`: for each (first logits row, request id), that request's
    masked positions, in order from the first row."""
    targets, sources = [], []
    for first, request_id in rows:
        start, count = masks.rows.get(request_id, (0, 0))
        targets.extend(range(first, first + count))
        sources.extend(range(start, start + count))
    if not targets:
        return
    full = torch.full((logits.shape[0], masks.bitmask.shape[1]), -1, dtype=torch.int32)
    full[targets] = masks.bitmask[sources]
    apply_bitmask(logits, full, targets)
