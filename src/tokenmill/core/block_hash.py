"""Content hashes of full KV blocks, computed as vLLM does with `--prefix-caching-hash-algo sha256_cbor` (no torch).

A block's hash is SHA-256 over the canonical CBOR encoding of (parent hash, the block's token ids,
extra keys), where the first block's parent is `none_hash(seed)`. A LoRA request's blocks all carry
`("lora", name, path)` in their extra keys, and its first block also its cache salt as
`("cache_salt", salt)` (vLLM's order). The hashes depend only on the seed and the tokens:
every process and every restart given the same seed computes the same hashes, and so do vLLM and
the routers that index vLLM's KV events (llm-d's KV indexer) given the same seed.

The seed: `--prefix-caching-hash-seed`, else $PYTHONHASHSEED, else vLLM's default "vllm-none-hash".
Events carry a hash as `external_hash`: its last 8 bytes as an unsigned big-endian integer, as vLLM
publishes them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import cbor2

from tokenmill import envs

DEFAULT_SEED = "vllm-none-hash"
ExtraKeys = Optional[tuple[tuple[str, ...], ...]]


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `value`."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def resolve_seed(seed: Optional[str]) -> str:
    """The seed given, else $PYTHONHASHSEED, else vLLM's default."""
    if seed is not None:
        return seed
    return envs.python_hash_seed() or DEFAULT_SEED


def none_hash(seed: str) -> bytes:
    """The parent hash of every first block."""
    return sha256_cbor(seed)


@dataclass(frozen=True)
class KeySalt:
    """What keeps a request's blocks apart from others' with the same tokens: its cache salt and its LoRA
    adapter (name, path)."""

    cache_salt: Optional[str] = None
    lora: Optional[tuple[str, str]] = None

    def extra_keys(self, first: bool, images: tuple[str, ...] = ()) -> ExtraKeys:
        """The extra keys of the request's first block (`first`) or of a later one, whose tokens hold
        placeholders of the images of content hashes `images` (vLLM's order: LoRA, images, cache salt)."""
        keys = [("lora", *self.lora)] if self.lora else []
        keys += [("image", digest) for digest in images]
        if first and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None


def salt_keys(cache_salt: Optional[str]) -> ExtraKeys:
    """The extra keys of a request's first block: its cache salt, if any."""
    return KeySalt(cache_salt).extra_keys(True)


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys = None) -> bytes:
    """The hash of a full block whose predecessor hashed to `parent` (`none_hash(seed)` for the first)."""
    return sha256_cbor((parent, tuple(token_ids), extra_keys))


def external_hash(digest: bytes) -> int:
    """The hash as KV events carry it: its last 8 bytes, an unsigned big-endian integer."""
    return int.from_bytes(digest[-8:], "big")


def prompt_block_hashes(root: bytes, token_ids: Sequence[int], block_size: int,
                        cache_salt: Optional[str] = None) -> list[bytes]:
    """The chained hashes of the full blocks before the prompt's last token (those a prefix hit can cover)."""
    hashes, parent = [], root
    for index in range((len(token_ids) - 1) // block_size):
        start = index * block_size
        parent = hash_block(parent, token_ids[start:start + block_size], salt_keys(cache_salt) if index == 0 else None)
        hashes.append(parent)
    return hashes
