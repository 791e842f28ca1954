"""A pool of fixed-size KV blocks: reference counts, an LRU free list, and a content-addressed cache (no torch)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional

BlockKey = Hashable  # identifies a full block's content: see core/block_keys.py


class BlockPool:
    """Hands out KV block ids and takes them back when their last holder lets go.

    A full block may be registered under the key of its content; it then stays findable after its
    last holder releases it, until the pool needs the memory and evicts it.

    Invariants (`check_invariants` verifies them; tests call it after every operation):
    - every block id is on the free list with ref count 0, or off it with ref count >= 1 — never both;
    - the free list is in LRU order: allocation takes (and evicts, if cached) from the front,
      release appends at the back, and a cache hit on a free block unlinks it — all O(1);
    - the front of the free list is the blocks never handed out, [_fresh_from, num_blocks) in id order (kept as a
      bound, not listed: a tiny model's default pool has 100k+ blocks), then `_released` in LRU order;
    - `cached[key] == block` exactly when `keys[block] == key`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._fresh_from = 0
        self._released: OrderedDict[int, None] = OrderedDict()
        self.keys: list[Optional[BlockKey]] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}
        self.num_evictions = 0
        # called with (block, key) just before a cached block is handed out again: the last moment
        # its content can be saved elsewhere (the second KV tier)
        self.on_evict: Optional[Callable[[int, BlockKey], None]] = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return self.num_blocks - self._fresh_from + len(self._released)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free list, each with ref count 1.

        A cached block taken this way is evicted: its content key is forgotten.
        """
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            if self._fresh_from < self.num_blocks:
                block = self._fresh_from
                self._fresh_from += 1
            else:
                block, _ = self._released.popitem(last=False)
                self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        key = self.keys[block]
        if key is not None:
            if self.on_evict is not None:
                self.on_evict(block, key)
            del self.cached[key]
            self.keys[block] = None
            self.num_evictions += 1

    def share(self, blocks: list[int]) -> None:
        """Add one holder to each of `blocks`; a free (cached) block is taken off the free list."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._released[block]  # a block with a holder or a key was handed out: never fresh
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one holder from each of `blocks`; a block whose count reaches 0 becomes free.

        Blocks are released in reverse so a sequence's tail is evicted before its prefix, which
        other requests are more likely to share.
        """
        for block in reversed(blocks):
            count = self.ref_counts[block]
            assert count > 0, f"double free of block {block}"
            self.ref_counts[block] = count - 1
            if count == 1:
                self._released[block] = None

    def lookup(self, key: BlockKey) -> Optional[int]:
        """The block holding content `key`, if cached."""
        return self.cached.get(key)

    def register(self, block: int, key: BlockKey) -> bool:
        """Make a full, held block findable under `key`; False (and no change) if another block already
        has that key or this block has one."""
        assert self.ref_counts[block] > 0, f"only a held block can be registered, not {block}"
        if key in self.cached or self.keys[block] is not None:
            return False
        self.cached[key] = block
        self.keys[block] = key
        return True

    def forget_cached(self) -> int:
        """Forget every content key (no block is findable any more); the blocks stay where they are. Only while
        no block is held (a holder's block would be registered again as it finishes). Returns how many keys."""
        assert self.num_used_blocks == 0, "the prefix cache is reset only while no request holds a block"
        forgotten = len(self.cached)
        for block in self.cached.values():
            self.keys[block] = None
        self.cached.clear()
        return forgotten

    def free_list(self) -> list[int]:
        """The free blocks in LRU order: the next allocation takes from the front."""
        return [*range(self._fresh_from, self.num_blocks), *self._released]

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list, ref counts and cache disagree."""
        for block, count in enumerate(self.ref_counts):
            free = block >= self._fresh_from or block in self._released
            assert count >= 0, f"block {block} has negative ref count"
            assert (count == 0) == free, f"block {block}: ref {count}, free={free}"
            assert block < self._fresh_from or self.keys[block] is None, f"never handed out, yet block {block} has a key"
        for key, block in self.cached.items():
            assert self.keys[block] == key, f"cache entry for block {block} disagrees with its key"
        assert sum(k is not None for k in self.keys) == len(self.cached)
