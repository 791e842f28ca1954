"""Prefix-cache lookups of the KV cache manager: which cached blocks a request's prompt can start from (no
torch). A block is found in the pool, or held by a connector (the second tier) that loads it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from tokenmill.core.block_hash import KeySalt
from tokenmill.core.block_keys import BlockKey, CachedSequence

if TYPE_CHECKING:
    from tokenmill.core.block_keys import BlockKeys
    from tokenmill.core.block_pool import BlockPool
    from tokenmill.core.kv_connector import KVConnectorScheduler
    from tokenmill.core.kv_group_specs import GroupSpec

SKIPPED = -1  # in a group's cached blocks: a block before the group's window, which a hit does not need
_MISSING = -2  # a block cached in neither the pool nor a connector (never returned)


class PrefixLookup:
    """The lookups of `KVCacheManager` (its base class): they read its pool, specs, keys and connectors."""

    block_size: int
    windows: list[Optional[int]]
    specs: list[GroupSpec]
    pool: BlockPool
    block_keys: BlockKeys
    connectors: list[KVConnectorScheduler]
    enable_prefix_caching: bool
    prefix_queries: int
    prefix_hits: int
    _keys: dict[str, list[BlockKey]]
    _salts: dict[str, Optional[KeySalt]]

    @property
    def num_groups(self) -> int:
        """KV cache groups (one block table each per request)."""
        return len(self.windows)

    def held_elsewhere(self, key: tuple[int, BlockKey]) -> bool:
        """Whether a connector can load the block of `key` (group, content key) that the pool lacks."""
        return any(c.holds(key) for c in self.connectors)

    def block_key(self, parent: BlockKey, token_ids: Sequence[int], salt: Optional[KeySalt] = None) -> BlockKey:
        """The content key of a full block (core/block_keys.py)."""
        return self.block_keys.key(parent, token_ids, salt)

    def match_prefix(self, request: CachedSequence, num_tokens: int) -> tuple[list[list[Optional[int]]], int]:
        """Per group, the cached blocks of the longest cached prefix of the request's first `num_tokens`
        tokens, and how many tokens that prefix covers.

        Only whole blocks count, and never the last token: it must be recomputed to get logits. A
        windowed group needs only the blocks the next query can see; those before are SKIPPED.
        """
        blocks, num_hit = self._cached_blocks(request, num_tokens)
        if num_hit:
            self._keys[request.request_id] = self.block_keys.leading(request, num_tokens)[:num_hit]
            self._salts[request.request_id] = request.sampling_params.key_salt
        return blocks, num_hit * self.block_size

    def prompt_keys(self, request: CachedSequence, num_blocks: int) -> list[BlockKey]:
        """Keys of the request's first `num_blocks` full blocks."""
        return self.block_keys.first(request, num_blocks)

    def prefix_keys_between(self, request: CachedSequence, start: int, end: int) -> list[BlockKey]:
        """Keys of a waiting request's full blocks lying in tokens [start, end) (none when caching is off)."""
        if not self.enable_prefix_caching:
            return []
        keys = self.block_keys.leading(request, request.num_tokens)
        return keys[start // self.block_size:end // self.block_size]

    def num_cached_tokens(self, request: CachedSequence, num_tokens: int) -> int:
        """How many of the request's first `num_tokens` tokens a match would cover now (no side effects)."""
        return self._cached_blocks(request, num_tokens)[1] * self.block_size

    def _find(self, group: int, key: BlockKey) -> Optional[int]:
        """Group `group`'s pool block of content `key`; None when it waits in the second tier, else _MISSING."""
        block = self.pool.lookup((group, key))
        if block is None and not self.held_elsewhere((group, key)):
            return _MISSING
        return block

    def _cached_blocks(self, request: CachedSequence, num_tokens: int) -> tuple[list[list[Optional[int]]], int]:
        """(per group: pool blocks of the cached prefix, None where a block waits in the second tier,
        SKIPPED before a window; the prefix's length in blocks). The prefix is the longest that every
        full group holds whole and every windowed group holds from its next query's window on."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.windows], 0
        keys = self.block_keys.leading(request, num_tokens)
        found: list[list[Optional[int]]] = [[] for _ in self.windows]
        longest = len(keys)
        whole = [g for g, spec in enumerate(self.specs) if spec.needs_whole_prefix]
        for group in whole:  # these groups' hit ends at their first miss
            for key in keys[:longest]:
                block = self._find(group, key)
                if block == _MISSING:
                    break
                found[group].append(block)
            longest = len(found[group])
        partial = [g for g, spec in enumerate(self.specs) if not spec.needs_whole_prefix]
        for group in partial:
            found[group] = [self._find(group, key) for key in keys[:longest]]
        hit = next(h for h in range(longest, -1, -1)
                   if all(self.specs[g].serves(found[g], h, _MISSING) for g in partial))
        blocks = []
        for group in range(self.num_groups):
            first = self.specs[group].first_needed(hit * self.block_size)
            blocks.append([SKIPPED] * first + found[group][first:hit])
        return blocks, hit

    def record_lookup(self, request_id: str, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup (for the hit-rate metrics)."""
        self.block_keys.forget(request_id)
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

