"""Block tables: which KV blocks hold each request's tokens (no torch)."""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to block tables and grows or frees them through the block pool.

    Token i of a request lives in block `table[i // block_size]` at offset `i % block_size`, so its
    cache slot is `table[i // block_size] * block_size + i % block_size`.
    Invariant: a table always has exactly cdiv(tokens allocated, block_size) blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}
        # New requests are admitted only while this many blocks stay free, so requests already
        # running can grow a little before anyone has to be preempted.
        self.watermark_blocks = int(watermark * num_blocks)

    @property
    def num_blocks(self) -> int:
        """Size of the pool."""
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block table (the live list; callers must not modify it)."""
        return self.tables.get(request_id, [])

    def _new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(request_id, ())))

    def can_admit(self, request_id: str, num_tokens: int) -> bool:
        """Whether a waiting request can get blocks for `num_tokens` and leave the watermark free."""
        needed = self._new_blocks_needed(request_id, num_tokens)
        return self.pool.num_free_blocks - needed >= self.watermark_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` tokens; False (and no change) if the pool is short."""
        needed = self._new_blocks_needed(request_id, num_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        if needed:
            self.tables.setdefault(request_id, []).extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (shared blocks just lose one holder)."""
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.release(table)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give `child_id` shared references to the parent's blocks holding its first tokens.

        Only whole blocks are shared: returns the number of tokens shared, the largest multiple of
        block_size <= num_tokens. The child writes everything after that into blocks of its own,
        so no block is ever written by two requests.
        """
        num_shared_blocks = min(num_tokens // self.block_size, len(self.tables.get(parent_id, ())))
        shared = self.tables[parent_id][:num_shared_blocks] if num_shared_blocks else []
        self.pool.share(shared)
        self.tables[child_id] = list(shared)
        return num_shared_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return self.pool.num_used_blocks / self.pool.num_blocks
