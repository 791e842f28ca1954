"""Content keys of requests' full blocks, which the prefix cache and the second tier are indexed by (no torch).

A key is (hash, token ids): the hash chained over every earlier block from the seed's root (and the
request's cache salt, for the first block, and the content hashes of the images whose placeholders the
block holds) as vLLM computes it (core/block_hash.py), the token ids so
that a hit is verified token by token. Requests with different salts never share a key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Optional, Protocol, Sequence

from tokenmill.core.block_hash import KeySalt, hash_block, none_hash, resolve_seed
from tokenmill.multimodal.inputs import ImageFeature, image_keys

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams

BlockKey = Hashable  # (hash bytes, token id tuple); None stands for "no parent" where a parent is asked


class CachedSequence(Protocol):
    """What the KV cache needs of a request to key and cache its blocks."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    sampling_params: SamplingParams  # its key_salt (cache salt, LoRA adapter) keeps its blocks apart
    images: Sequence[ImageFeature]  # so do the images whose placeholders a block holds

    def token_ids_range(self, start: int, end: int) -> list[int]: ...


class BlockKeys:
    """Computes block keys, and memoises a waiting request's leading keys until `forget`."""

    def __init__(self, block_size: int, hash_seed: Optional[str] = None) -> None:
        self.block_size = block_size
        self._root = none_hash(resolve_seed(hash_seed))
        self._memo: dict[str, tuple[int, list[BlockKey]]] = {}

    def key(self, parent: BlockKey, token_ids: Sequence[int], salt: Optional[KeySalt] = None,
            images: tuple[str, ...] = ()) -> BlockKey:
        """The key of a full block of `token_ids` after the block keyed `parent` (None for a first block),
        whose tokens hold placeholders of the images hashed `images`."""
        if salt is None and images:
            salt = KeySalt()
        extra = salt.extra_keys(parent is None, images) if salt is not None else None
        digest = hash_block(self._root if parent is None else parent[0], token_ids, extra)
        return (digest, tuple(token_ids))

    def extend(self, keys: list[BlockKey], request: CachedSequence, count: int) -> list[BlockKey]:
        """`keys` (the request's first keys) grown in place to its first `count` keys."""
        while len(keys) < count:
            start = len(keys) * self.block_size
            end = start + self.block_size
            keys.append(self.key(keys[-1] if keys else None, request.token_ids_range(start, end),
                                 request.sampling_params.key_salt, image_keys(request.images, start, end)))
        return keys

    def first(self, request: CachedSequence, num_blocks: int) -> list[BlockKey]:
        """Keys of the request's first `num_blocks` full blocks (computed afresh)."""
        return self.extend([], request, num_blocks)

    def leading(self, request: CachedSequence, num_tokens: int) -> list[BlockKey]:
        """Keys of the full blocks before the last of the request's first `num_tokens` tokens (what a
        prefix hit can cover), memoised while the request waits."""
        memo = self._memo.get(request.request_id)
        if memo is not None and memo[0] == num_tokens:
            return memo[1]
        keys = self.first(request, (num_tokens - 1) // self.block_size)
        self._memo[request.request_id] = (num_tokens, keys)
        return keys

    def forget(self, request_id: str) -> None:
        """Drop the request's memo (admitted or gone)."""
        self._memo.pop(request_id, None)
