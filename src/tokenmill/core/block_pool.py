"""A pool of fixed-size KV blocks with reference counts and a free list (no torch)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids and takes them back when their last holder lets go.

    Invariant: every block id in [0, num_blocks) is either on the free list with ref count 0,
    or off it with ref count >= 1 — never both. `check_invariants` verifies it (tests call it).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with ref count 1."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one holder to each of `blocks` (they must already be held)."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"cannot share free block {block}"
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one holder from each of `blocks`; a block whose count reaches 0 becomes free.

        Blocks are released in reverse so the tail of a sequence (least likely to be shared) is
        reused first.
        """
        for block in reversed(blocks):
            count = self.ref_counts[block]
            assert count > 0, f"double free of block {block}"
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and the ref counts disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block} has negative ref count"
            assert (count == 0) == (block in free), f"block {block}: ref {count}, free={block in free}"
