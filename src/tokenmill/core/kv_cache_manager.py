"""Block tables: which KV blocks hold each request's tokens, and prefix reuse across requests (no torch)."""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from tokenmill.core.block_pool import BlockKey, BlockPool
from tokenmill.core.secondary_tier import SecondaryTier

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams

_ROOT = b"tokenmill-prefix-root"


class CachedSequence(Protocol):
    """What the manager needs of a request to cache its blocks."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    sampling_params: SamplingParams  # its cache_salt keeps the request's blocks apart from unsalted ones

    def token_ids_range(self, start: int, end: int) -> list[int]: ...


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to block tables and grows or frees them through the block pool.

    Token i of a request lives in block `table[i // block_size]` at offset `i % block_size`, so its
    cache slot is `table[i // block_size] * block_size + i % block_size`.
    Invariant: a table always has exactly cdiv(tokens allocated, block_size) blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = False, cache_salt: str = "", secondary_slots: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._salt = cache_salt.encode()
        # keys of each request's leading full blocks whose content is known (computed or cache hit)
        self._keys: dict[str, list[BlockKey]] = {}
        self._lookup_memo: dict[str, tuple[int, list[BlockKey]]] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found (in either tier)
        # Second tier: cached blocks evicted from the pool are copied there and copied back on a hit.
        # Copies are queued here while scheduling and carried out by the runner before the step's
        # forward pass: all (block -> slot) saves first, then all (slot -> block) loads.
        self.tier = SecondaryTier(secondary_slots) if enable_prefix_caching and secondary_slots > 0 else None
        self._pending_saves: list[tuple[int, int]] = []
        self._pending_loads: list[tuple[int, int]] = []
        if self.tier is not None:
            self.pool.on_evict = self._save_to_tier
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

    def can_admit(self, request_id: str, num_tokens: int, cached_blocks: Sequence[Optional[int]] = ()) -> bool:
        """Whether a waiting request can get blocks for `num_tokens` (the first of them being
        `cached_blocks`, a prefix-cache match) and leave the watermark free."""
        return self._num_free_after(request_id, num_tokens, cached_blocks) >= self.watermark_blocks

    def _num_free_after(self, request_id: str, num_tokens: int, cached_blocks: Sequence[Optional[int]]) -> int:
        in_pool = [b for b in cached_blocks if b is not None]  # None: a second-tier hit, needs a block
        revived = sum(1 for b in in_pool if self.pool.ref_counts[b] == 0)  # they leave the free list
        needed = max(0, self.blocks_for(num_tokens) - len(self.tables.get(request_id, ())) - len(in_pool))
        return self.pool.num_free_blocks - revived - needed

    def allocate_slots(self, request_id: str, num_tokens: int, cached_blocks: Sequence[Optional[int]] = ()) -> bool:
        """Grow the request's table to hold `num_tokens` tokens, starting with `cached_blocks` (from
        `match_prefix`) when it has none yet; False (and no change) if the pool is short."""
        if self._num_free_after(request_id, num_tokens, cached_blocks) < 0:
            return False
        table = self.tables.setdefault(request_id, [])
        if cached_blocks:
            assert not table, "cached blocks can only start a table"
            keys = self._keys[request_id]
            # Claim every hit before allocating anything: an allocation may evict a pool block, and
            # saving that to a full tier may push out the LRU tier entry — which must not be ours.
            self.pool.share([b for b in cached_blocks if b is not None])
            tier_slots = {i: self.tier.take(keys[i]) for i, b in enumerate(cached_blocks) if b is None}
            for index, block in enumerate(cached_blocks):
                if block is None:
                    (block,) = self.pool.allocate(1)
                    self.pool.register(block, keys[index])
                    self._pending_loads.append((tier_slots[index], block))
                table.append(block)
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def _save_to_tier(self, block: int, key: BlockKey) -> None:
        slot = self.tier.save(key)
        if slot is not None:
            self._pending_saves.append((block, slot))

    def take_pending_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The second-tier copies this step needs: ((block, slot) saves, (slot, block) loads)."""
        saves, loads = self._pending_saves, self._pending_loads
        self._pending_saves, self._pending_loads = [], []
        return saves, loads

    def end_step(self) -> None:
        """The runner has done the step's copies."""
        if self.tier is not None:
            self.tier.end_step()

    # ------------------------------------------------------------------ prefix cache
    def block_key(self, parent: BlockKey, token_ids: Sequence[int], request_salt: Optional[str] = None) -> BlockKey:
        """The content key of a full block: a SHA-256 chained over every earlier block (and the
        cache salt, then the request's own salt, if any, for the first block), paired with the block's
        own token ids so a hit is verified token by token. Requests with different salts never share."""
        if parent is not None:
            parent_digest = parent[0]
        else:
            parent_digest = _ROOT + self._salt + (b"\0request-salt\0" + request_salt.encode() if request_salt else b"")
        tokens = tuple(token_ids)
        digest = hashlib.sha256(parent_digest + struct.pack(f"<{len(tokens)}q", *tokens)).digest()
        return (digest, tokens)

    def _prefix_keys(self, request: CachedSequence, num_tokens: int) -> list[BlockKey]:
        """Keys of the request's full blocks before its last token (memoised while it waits)."""
        memo = self._lookup_memo.get(request.request_id)
        if memo is not None and memo[0] == num_tokens:
            return memo[1]
        keys: list[BlockKey] = []
        for index in range((num_tokens - 1) // self.block_size):
            start = index * self.block_size
            keys.append(self.block_key(keys[-1] if keys else None,
                                       request.token_ids_range(start, start + self.block_size),
                                       request.sampling_params.cache_salt))
        self._lookup_memo[request.request_id] = (num_tokens, keys)
        return keys

    def match_prefix(self, request: CachedSequence, num_tokens: int) -> tuple[list[Optional[int]], int]:
        """The cached blocks holding the longest cached prefix of the request's first `num_tokens`
        tokens, and how many tokens they cover.

        Only whole blocks count, and never the last token: it must be recomputed to get logits.
        """
        blocks = self._cached_blocks(request, num_tokens)
        if blocks:
            self._keys[request.request_id] = self._prefix_keys(request, num_tokens)[:len(blocks)]
        return blocks, len(blocks) * self.block_size

    def prefix_keys_between(self, request: CachedSequence, start: int, end: int) -> list[BlockKey]:
        """Keys of a waiting request's full blocks lying in tokens [start, end) (none when caching is off)."""
        if not self.enable_prefix_caching:
            return []
        keys = self._prefix_keys(request, request.num_tokens)
        return keys[start // self.block_size:end // self.block_size]

    def num_cached_tokens(self, request: CachedSequence, num_tokens: int) -> int:
        """How many of the request's first `num_tokens` tokens a match would cover now (no side effects)."""
        return len(self._cached_blocks(request, num_tokens)) * self.block_size

    def _cached_blocks(self, request: CachedSequence, num_tokens: int) -> list[Optional[int]]:
        """Pool blocks of the cached prefix, None where a block's content waits in the second tier."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[Optional[int]] = []
        for key in self._prefix_keys(request, num_tokens):
            block = self.pool.lookup(key)
            if block is None and not (self.tier is not None and key in self.tier):
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, request_id: str, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup (for the hit-rate metrics)."""
        self._lookup_memo.pop(request_id, None)
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_computed_blocks(self, request: CachedSequence) -> None:
        """Register the request's full blocks whose K/V are now computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys.setdefault(request.request_id, [])
        table = self.tables.get(request.request_id, [])
        full = min(request.num_computed_tokens // self.block_size, len(table))
        while len(keys) < full:
            index = len(keys)
            start = index * self.block_size
            key = self.block_key(keys[-1] if keys else None,
                                 request.token_ids_range(start, start + self.block_size),
                                 request.sampling_params.cache_salt)
            self.pool.register(table[index], key)
            keys.append(key)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those holding its first `num_tokens` tokens (the slots of
        rejected speculative tokens). Those blocks were allocated for this request alone and never cached."""
        table = self.tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        if table is not None and len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (shared blocks just lose one holder)."""
        table = self.tables.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._lookup_memo.pop(request_id, None)
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
        parent_keys = self._keys.get(parent_id, [])
        self._keys[child_id] = parent_keys[:num_shared_blocks]
        return num_shared_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return self.pool.num_used_blocks / self.pool.num_blocks
