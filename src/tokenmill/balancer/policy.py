"""Where the next request goes: the healthy replica with the least work left once this request is added.

A replica's work is its outstanding tokens (the prompt and max_tokens of every request it is serving,
counted when routed, dropped when answered) plus the prompt tokens this request would have to compute
there: its prompt minus the leading blocks the replica's prefix cache holds (from its KV events).
So a request goes where its prefix is cached unless that replica is busier by more than the prefix
saves; ties go to the replica with fewer requests in flight, then to the lowest rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from tokenmill.balancer.kv_index import PrefixIndex
from tokenmill.core.block_hash import external_hash, none_hash, prompt_block_hashes, resolve_seed


@dataclass
class Replica:
    """One engine process and what the balancer knows of it."""

    rank: int
    url: str
    healthy: bool = False
    outstanding_tokens: int = 0
    in_flight: int = 0
    num_routed: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens routed here that its cache was believed to hold


@dataclass(frozen=True)
class Route:
    """A routing decision: the replica, and the tokens it was charged."""

    replica: Replica
    cost_tokens: int
    matched_tokens: int


class Balancer:
    """Chooses replicas and keeps their load counts (thread-safe)."""

    def __init__(self, replicas: Sequence[Replica], index: Optional[PrefixIndex], block_size: int,
                 hash_seed: Optional[str]) -> None:
        self.replicas = list(replicas)
        self.index = index
        self.block_size = block_size
        self._root = none_hash(resolve_seed(hash_seed))
        self._lock = threading.Lock()

    def prompt_hashes(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> list[int]:
        """The external hashes of the prompt's full blocks before its last token (what a hit can cover)."""
        return [external_hash(h) for h in prompt_block_hashes(self._root, token_ids, self.block_size, cache_salt)]

    def choose(self, token_ids: Optional[Sequence[int]], max_tokens: int, cache_salt: Optional[str] = None,
               exclude: frozenset[int] = frozenset()) -> Optional[Route]:
        """Pick a healthy replica not in `exclude` for a request of prompt `token_ids` (None: unknown, then
        load alone decides) and charge it; None when there is none."""
        hashes = self.prompt_hashes(token_ids, cache_salt) if token_ids and self.index is not None else []
        prompt_len = len(token_ids) if token_ids else 0
        with self._lock:
            best: Optional[tuple[tuple[int, int, int], Replica, int]] = None
            for replica in self.replicas:
                if not replica.healthy or replica.rank in exclude:
                    continue
                matched = self.index.matched_blocks(replica.rank, hashes) * self.block_size if hashes else 0
                key = (replica.outstanding_tokens + prompt_len - matched, replica.in_flight, replica.rank)
                if best is None or key < best[0]:
                    best = (key, replica, matched)
            if best is None:
                return None
            _, replica, matched = best
            cost = prompt_len + max_tokens
            replica.outstanding_tokens += cost
            replica.in_flight += 1
            replica.num_routed += 1
            replica.num_prefix_hit_tokens += matched
            return Route(replica, cost, matched)

    def done(self, route: Route) -> None:
        """The request routed by `route` ended (answered, failed or retried elsewhere)."""
        with self._lock:
            route.replica.outstanding_tokens -= route.cost_tokens
            route.replica.in_flight -= 1

    def set_health(self, rank: int, healthy: bool) -> bool:
        """Mark replica `rank` up or down; True if that changed."""
        with self._lock:
            replica = self.replicas[rank]
            changed = replica.healthy != healthy
            replica.healthy = healthy
        if changed and not healthy and self.index is not None:
            self.index.forget(rank)
        return changed
