"""Bookkeeping of the second KV tier: where evicted blocks' contents wait to be reused (no torch).

The store itself (a memory-mapped file, or pinned host memory next to a GPU) belongs to the runner;
this class only decides which content key lives in which slot, in LRU order.

Invariant: a slot read in the current step (`take`) is not reused before `end_step`, so a copy into
the tier scheduled in the same step can never overwrite data a load of that step still has to read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

from tokenmill.core.kv_connector import TIER, KVConnectorScheduler


class SecondaryTier:
    """An LRU map from block content keys to slots of a secondary store."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self._released_after_step: list[int] = []
        self.num_saves = 0
        self.num_hits = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    @property
    def num_used(self) -> int:
        """Slots holding a block's content."""
        return len(self._slots)

    def save(self, key: Hashable) -> Optional[int]:
        """The slot to copy an evicted block with content `key` into, or None when no copy is needed
        (the tier already holds it, or has no room that is not in use this step)."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return None
        if not self._free:
            if not self._slots:
                return None
            _, slot = self._slots.popitem(last=False)
        else:
            slot = self._free.pop()
        self._slots[key] = slot
        self.num_saves += 1
        return slot

    def take(self, key: Hashable) -> int:
        """Remove `key` (it is going back to the primary pool) and return its slot, freed after the step."""
        slot = self._slots.pop(key)
        self._released_after_step.append(slot)
        self.num_hits += 1
        return slot

    def end_step(self) -> None:
        """The step's copies are done: slots read in it may be reused."""
        self._free.extend(self._released_after_step)
        self._released_after_step.clear()

    def clear(self) -> None:
        """Forget every block's content (a prefix-cache reset); the slots read this step stay busy until its
        end."""
        self._free.extend(self._slots.values())
        self._slots.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if a slot is both used and free, or lost."""
        used = list(self._slots.values())
        everything = used + self._free + self._released_after_step
        assert len(everything) == len(set(everything)) == self.num_slots, "tier slots lost or duplicated"


class TierConnector(KVConnectorScheduler):
    """The second tier's scheduler half: an evicted block's contents out to its slot (phase `out`, before
    the block is reused), a hit's slot back into the block allocated for it (phase `into`)."""

    name = TIER

    def __init__(self, tier: SecondaryTier) -> None:
        super().__init__()  # pending: (pool block, slot) saves out, (slot, pool block) loads in
        self.tier = tier

    def block_evicted(self, block: int, key: Hashable) -> None:
        """The pool evicted `block` of content `key`: keep its contents in the tier where there is room."""
        slot = self.tier.save(key)
        if slot is not None:
            self.pending.out.append((block, slot))

    def holds(self, key: Hashable) -> bool:
        """Whether the tier keeps the contents of `key`."""
        return key in self.tier

    def claim(self, key: Hashable) -> int:
        """Take `key`'s slot out of the tier for a hit (its contents stay until `load`'s copy has run)."""
        return self.tier.take(key)

    def load(self, slot: int, block: int) -> None:
        """Copy a hit's contents from `slot` into the pool's `block`."""
        self.pending.into.append((slot, block))

    def end_step(self) -> None:
        self.tier.end_step()
