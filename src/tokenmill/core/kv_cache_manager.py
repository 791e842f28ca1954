"""Block tables: which KV blocks hold each request's tokens, and prefix reuse across requests (no torch)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from tokenmill.core.block_hash import KeySalt
from tokenmill.core.block_keys import BlockKey, BlockKeys, CachedSequence
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_connector import KVConnectorScheduler, overrides
from tokenmill.core.kv_events import KVEventLog
from tokenmill.core.kv_group_specs import cdiv, group_spec
from tokenmill.core.kv_transfer_connector import TransferConnector
from tokenmill.core.prefix_lookup import SKIPPED, PrefixLookup
from tokenmill.core.secondary_tier import SecondaryTier, TierConnector


_PLACEHOLDER = 0  # the table entry of a skipped block: never read (no query's window reaches it), never released


class KVCacheManager(PrefixLookup):
    """Maps request ids to block tables, one per KV cache group, and grows or frees them through one pool;
    registers computed full blocks for reuse (looked up through `PrefixLookup`, core/prefix_lookup.py).

    Token i of a request lives, for the layers of group g, in block `tables[g][i // block_size]` at
    offset `i % block_size` (see core/kv_spec.py). A sliding-window group of window W lets go of the
    blocks no later query can see: a query at position p sees keys (p - W, p] (a chunked group of chunk C: keys
    [(p // C) * C, p]).
    A recurrent-state group (`state_groups`, core/kv_group_specs.py's RecurrentStateSpec) holds `state_pages`
    blocks per request (one, or a hybrid's state spread over attention-sized blocks), its state page, for the
    request's life; its pages are never cached (prefix caching is refused
    with such a group) nor shared (`fork` shares nothing then).
    Invariants: every table of a request has exactly `specs[g].table_length(tokens allocated)` entries
    (cdiv(tokens, block_size) for attention, `state_pages` for a state); the
    first `released[g]` entries of group g's table are held no more (blocks given back or placeholders)
    and no backend reads them; every later entry holds one reference to its block.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = False, hash_seed: Optional[str] = None, secondary_slots: int = 0,
                 windows: Sequence[Optional[int]] = (None,), record_events: bool = False,
                 state_groups: frozenset[int] = frozenset(), state_pages: int = 1,
                 chunks: Sequence[Optional[int]] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if state_groups and enable_prefix_caching:
            raise ValueError("prefix caching of recurrent states is not supported: a state page holds the state "
                             "after a request's latest token, not at block boundaries; turn prefix_caching off")
        self.block_size = block_size
        self.windows = list(windows)  # each group's sliding window, None for full attention
        # each group's rules; `chunks`: each group's attention chunk (Llama 4's chunked layers), none when empty
        chunks = list(chunks) or [None] * len(self.windows)
        if len(chunks) != len(self.windows):
            raise ValueError(f"{len(chunks)} attention chunks for {len(self.windows)} KV cache groups")
        self.specs = [group_spec(block_size, window, chunk, g in state_groups, state_pages)
                      for g, (window, chunk) in enumerate(zip(self.windows, chunks))]
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[list[int]]] = {}
        self.released: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.block_keys = BlockKeys(block_size, hash_seed)
        # keys of each request's leading full blocks whose content is known (computed or cache hit);
        # group g's block of content key k is cached in the pool (and the tier) under (g, k)
        self._keys: dict[str, list[BlockKey]] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found (in either tier)
        # Second tier: cached blocks evicted from the pool are copied there and copied back on a hit,
        # by its connector (core/kv_connector.py): saves before the step's loads and forward pass.
        self.tier = SecondaryTier(secondary_slots) if enable_prefix_caching and secondary_slots > 0 else None
        self.tier_connector = TierConnector(self.tier) if self.tier is not None else None
        # prefill/decode transfer: blocks adopted from a file into the prefix cache, prompts exported to one
        self.transfer = TransferConnector(self)
        # blocks made findable and evicted, for KV-cache events (drained by the engine every step)
        self.events = KVEventLog() if record_events and enable_prefix_caching else None
        # the connectors that hear the pool's news and supply hits it lacks, in the order they hear it
        self.connectors = [c for c in (self.events, self.tier_connector) if c is not None]
        self._hear_stored = [c for c in self.connectors if overrides(c, "blocks_stored")]
        self._hear_evicted = [c for c in self.connectors if overrides(c, "block_evicted")]
        self._salts: dict[str, Optional[KeySalt]] = {}  # the key salt of requests that start with hits
        if self._hear_evicted:
            self.pool.on_evict = self._on_evict
        # New requests are admitted only while this many blocks stay free, so requests already
        # running can grow a little before anyone has to be preempted.
        self.watermark_blocks = int(watermark * num_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, in the pool and the second tier (after a weight update their K/V are the old
        weights'), as vLLM's reset_prefix_cache: False, and nothing changed, while a request holds blocks."""
        if self.pool.num_used_blocks:
            return False
        self.pool.forget_cached()
        if self.tier is not None:
            self.tier.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    @property
    def num_blocks(self) -> int:
        """Size of the pool."""
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (in one group's table)."""
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most pool blocks a request of `num_tokens` tokens, computed in chunks of at most
        `max_chunk`, holds at once over all groups (a windowed group holds the chunk and the window
        before it)."""
        return sum(spec.blocks_held(num_tokens, max_chunk) for spec in self.specs)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group (the live lists; callers must not modify them)."""
        return self.tables.get(request_id) or [[] for _ in self.windows]

    def can_admit(self, request_id: str, num_tokens: int, cached: Sequence[Sequence[Optional[int]]] = ()) -> bool:
        """Whether a waiting request can get blocks for `num_tokens` (the first of them being `cached`,
        a prefix-cache match) and leave the watermark free."""
        return self._num_free_after(request_id, num_tokens, cached) >= self.watermark_blocks

    def _num_free_after(self, request_id: str, num_tokens: int, cached: Sequence[Sequence[Optional[int]]]) -> int:
        free = self.pool.num_free_blocks
        tables = self.tables.get(request_id)
        for group in range(self.num_groups):
            hits = cached[group] if cached else ()
            in_pool = [b for b in hits if b is not None and b != SKIPPED]  # None: a second-tier hit, needs a block
            skipped = sum(1 for b in hits if b == SKIPPED)
            free -= sum(1 for b in in_pool if self.pool.ref_counts[b] == 0)  # they leave the free list
            have = len(tables[group]) if tables else 0
            free -= max(0, self.specs[group].table_length(num_tokens) - have - len(in_pool) - skipped)
        return free

    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached: Sequence[Sequence[Optional[int]]] = ()) -> bool:
        """Grow the request's tables to hold `num_tokens` tokens, starting with `cached` (from
        `match_prefix`, one list per group) when it has none yet; False (and no change) if the pool is short."""
        if self._num_free_after(request_id, num_tokens, cached) < 0:
            return False
        if request_id not in self.tables:
            self.tables[request_id] = [[] for _ in self.windows]
            self.released[request_id] = [0] * self.num_groups
        tables = self.tables[request_id]
        if cached and any(cached):
            assert not any(tables), "cached blocks can only start a table"
            self._start_with_hits(request_id, cached)
        for spec, table in zip(self.specs, tables):
            needed = spec.table_length(num_tokens)
            if needed > len(table):
                table.extend(self.pool.allocate(needed - len(table)))
        return True

    def _start_with_hits(self, request_id: str, cached: Sequence[Sequence[Optional[int]]]) -> None:
        keys = self._keys[request_id]
        # Claim every hit before allocating anything: an allocation may evict a pool block, and
        # saving that to a full tier may push out the LRU tier entry — which must not be ours.
        for hits in cached:
            self.pool.share([b for b in hits if b is not None and b != SKIPPED])
        claimed = {(g, i): self._claim((g, keys[i]))
                   for g, hits in enumerate(cached) for i, b in enumerate(hits) if b is None}
        for group, hits in enumerate(cached):
            table = self.tables[request_id][group]
            loaded = []
            for index, block in enumerate(hits):
                if block == SKIPPED:
                    block = _PLACEHOLDER
                    self.released[request_id][group] = index + 1
                elif block is None:
                    (block,) = self.pool.allocate(1)
                    self.pool.register(block, (group, keys[index]))
                    connector, entry = claimed[group, index]
                    connector.load(entry, block)
                    loaded.append(index)
                table.append(block)
            self._record_stored(request_id, group, keys, loaded)

    def _claim(self, key: tuple[int, BlockKey]) -> tuple[KVConnectorScheduler, Any]:
        connector = next(c for c in self.connectors if c.holds(key))
        return connector, connector.claim(key)

    def _record_stored(self, request_id: str, group: int, keys: Sequence[BlockKey], indices: Sequence[int]) -> None:
        for connector in self._hear_stored:
            connector.blocks_stored(group, keys, indices, self._salts.get(request_id))

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks of windowed groups that no query from position `num_computed_tokens` on can
        see (cached ones stay findable until evicted)."""
        tables = self.tables.get(request_id)
        if tables is None:
            return
        released = self.released[request_id]
        for group, table in enumerate(tables):
            first = min(self.specs[group].first_needed(num_computed_tokens), len(table))
            if first > released[group]:
                self.pool.release(table[released[group]:first])
                released[group] = first

    def _on_evict(self, block: int, key: tuple[int, BlockKey]) -> None:
        for connector in self._hear_evicted:
            connector.block_evicted(block, key)

    def record_adopted(self, request_id: str, keys: Sequence[BlockKey], indices: Sequence[int],
                       salt: Optional[KeySalt]) -> None:
        """Blocks adopted from a transfer (keys[i] for i in `indices`, group 0) became findable: their events."""
        self._salts[request_id] = salt
        self._record_stored(request_id, 0, keys, indices)

    def cache_computed_blocks(self, request: CachedSequence) -> None:
        """Register the request's full blocks whose K/V are now computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys.setdefault(request.request_id, [])
        tables = self.tables.get(request.request_id)
        if tables is None:
            return
        released = self.released[request.request_id]
        full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        first_new = len(keys)
        self.block_keys.extend(keys, request, full)
        registered: list[list[int]] = [[] for _ in tables]
        for index in range(first_new, len(keys)):
            for group, table in enumerate(tables):
                if index >= released[group] and self.pool.register(table[index], (group, keys[index])):
                    registered[group].append(index)
        if self._hear_stored and len(keys) > first_new:
            self._salts[request.request_id] = request.sampling_params.key_salt
            for group, indices in enumerate(registered):
                self._record_stored(request.request_id, group, keys, indices)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those holding its first `num_tokens` tokens (the slots of
        rejected speculative tokens). Those blocks were allocated for this request alone and never cached."""
        tables = self.tables.get(request_id)
        for group, table in enumerate(tables or ()):
            keep = self.specs[group].table_length(num_tokens)
            if len(table) > keep:
                released = self.released[request_id]
                self.pool.release(table[max(keep, released[group]):])
                released[group] = min(released[group], keep)
                del table[keep:]

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (shared blocks just lose one holder)."""
        tables = self.tables.pop(request_id, None)
        released = self.released.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._salts.pop(request_id, None)
        self.block_keys.forget(request_id)
        for group, table in enumerate(tables or ()):
            self.pool.release(table[released[group]:])

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give `child_id` shared references to the parent's blocks holding its first tokens.

        Only whole blocks are shared: returns the number of tokens shared, the largest multiple of
        block_size <= num_tokens (0 if a windowed group of the parent no longer holds what the child's
        first query sees). The child writes everything after that into blocks of its own, so no block
        is ever written by two requests. With a recurrent-state group nothing is shared (0): a state page
        belongs to one request, and the child computes its state from the start.
        """
        tables = self.tables.get(parent_id) or [[] for _ in self.windows]
        released = self.released.get(parent_id) or [0] * self.num_groups
        shared = min(num_tokens // self.block_size, len(tables[0]))
        if any(spec.recurrent for spec in self.specs):
            shared = 0
        if any(released[g] > self.specs[g].first_needed(shared * self.block_size) for g in range(self.num_groups)):
            shared = 0
        self.tables[child_id], self.released[child_id] = [], []
        for table, given_back in zip(tables, released):
            start = min(given_back, shared)
            self.pool.share(table[start:shared])
            self.tables[child_id].append([_PLACEHOLDER] * start + table[start:shared])
            self.released[child_id].append(start)
        self._keys[child_id] = self._keys.get(parent_id, [])[:shared]
        return shared * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return self.pool.num_used_blocks / self.pool.num_blocks
