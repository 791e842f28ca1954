"""What happened to the prefix cache's blocks, recorded for KV-cache events (no torch).

The KV cache manager records here, when events are on, every full block that becomes findable in
the primary pool and every one evicted from it. The engine drains the log once per step and
publishes it (engine/kv_event_publisher.py) in vLLM's event format, so a prefix-aware router knows
which replica holds which prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from tokenmill.core.block_hash import ExtraKeys, KeySalt
from tokenmill.core.kv_connector import EVENTS, KVConnectorScheduler


@dataclass
class BlocksStored:
    """Consecutive full blocks of one request became findable in group `group`; `parent` is the hash of
    the block before the first (None for a sequence's first block)."""

    group: int
    hashes: list[bytes]
    parent: Optional[bytes]
    token_ids: list[int]
    extra_keys: list[ExtraKeys] = field(default_factory=list)  # one entry per block


@dataclass
class BlocksRemoved:
    """Blocks of group `group` were evicted: no request finds them in the pool any more."""

    group: int
    hashes: list[bytes]


@dataclass
class AllBlocksCleared:
    """Every cached block is gone (a new engine, or a reset)."""


KVEvent = Union[BlocksStored, BlocksRemoved, AllBlocksCleared]


class KVEventLog(KVConnectorScheduler):
    """The events since the last `drain`, in the order they happened: a connector that hears the pool's
    news (core/kv_connector.py) and moves no data.

    Invariant: its length is bounded by the blocks touched in one step (the engine drains it after
    every step), and removals of one group that follow each other share one event.
    """

    name = EVENTS

    def __init__(self) -> None:
        super().__init__()
        self._events: list[KVEvent] = [AllBlocksCleared()]

    def stored(self, group: int, keys: Sequence[tuple[bytes, tuple[int, ...]]], parent: Optional[bytes],
               extra_keys: Sequence[ExtraKeys]) -> None:
        """Record blocks of content keys `keys` (digest, token ids) registered in `group`."""
        if keys:
            self._events.append(BlocksStored(group, [digest for digest, _ in keys], parent,
                                             [t for _, tokens in keys for t in tokens], list(extra_keys)))

    def blocks_stored(self, group: int, keys: Sequence[tuple[bytes, tuple[int, ...]]], indices: Sequence[int],
                      salt: Optional[KeySalt]) -> None:
        """Record that group `group`'s blocks of one request at `indices` (ascending positions in its
        chain `keys`) became findable: one event per run of consecutive blocks, each run's parent the
        block before it, each with the request's extra keys (its salt's)."""
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first = run[0]
            self.stored(group, [keys[i] for i in run], keys[first - 1][0] if first else None,
                        [salt.extra_keys(i == 0) if salt is not None else None for i in run])

    def block_evicted(self, block: int, key: tuple[int, tuple[bytes, tuple[int, ...]]]) -> None:
        """Record the eviction of a block of `key` (group, (hash, token ids))."""
        group, (digest, _) = key
        last = self._events[-1] if self._events else None
        if isinstance(last, BlocksRemoved) and last.group == group:
            last.hashes.append(digest)
        else:
            self._events.append(BlocksRemoved(group, [digest]))

    def cleared(self) -> None:
        """Record that every cached block is gone (a prefix-cache reset)."""
        self._events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events
