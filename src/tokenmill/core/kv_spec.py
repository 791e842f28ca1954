"""What each layer keeps in the KV cache, and how layers are grouped to share one block pool (no torch).

Layers that keep the same thing per token (full attention, a sliding window of W tokens, chunked local attention
of C positions, an MLA latent) form a group, and each group has its own block table per request: a sliding-window
(or chunked) group lets go of the blocks that fall out of its window (before its current chunk) while the
full-attention group keeps every block.

All groups draw from one pool (vLLM's hybrid allocator). For that, every group has the same number of
layers (`layers_per_group`, the greatest common divisor of the kinds' layer counts), so a pool block is
one page of `layers_per_group` layers for every group alike: the runner keeps `layers_per_group` cache
tensors, and the layer at position j of group g reads and writes tensor j through group g's tables.
Invariant: a pool block belongs to at most one group's table at a time (or to none: free or cached).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Optional


# a one-byte (int8 or fp8) cache row's float32 scale, after its head_dim values (attention/kv_quant.py)
QUANTIZED_SCALE_BYTES = 4


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per token: K and V of `num_kv_heads` x `head_dim` (for MLA, one head of
    the latent plus the RoPE key, stored once: it is the key and its first values are the value), and,
    for a sliding-window layer, its window (a query sees the `sliding_window` latest keys, itself
    included), for a chunked local layer (Llama 4) its chunk (a query at p sees keys from (p // chunk) * chunk)."""

    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_window: Optional[int] = None
    mla_latent: Optional[tuple[int, int]] = None  # (kv_lora_rank, qk_rope_head_dim) of an MLA layer
    quantized: Optional[str] = None  # "int8" / "fp8" rows: head_dim one-byte values and a float32 scale (kv_quant.py)
    attention_chunk: Optional[int] = None

    @property
    def kind(self) -> str:
        """"full attention", "sliding window", "chunked local attention" or "MLA latent"."""
        if self.mla_latent is not None:
            return "MLA latent"
        if self.attention_chunk is not None:
            return "chunked local attention"
        return "full attention" if self.sliding_window is None else "sliding window"

    @property
    def planes(self) -> int:
        """Planes of one layer's cache tensor: 2 (keys, values), or 1 for an MLA latent, whose keys are
        also its values (the attention backends read values from the last plane)."""
        return 1 if self.mla_latent is not None else 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes one layer of this spec keeps per cached token."""
        row = self.head_dim + QUANTIZED_SCALE_BYTES if self.quantized else self.head_dim * self.dtype_bytes
        return self.planes * self.num_kv_heads * row

    def describe(self) -> str:
        """The spec in words, e.g. "sliding window of 512 tokens"."""
        if self.mla_latent is not None:
            rank, rope = self.mla_latent
            return f"MLA latent (rank {rank} + RoPE key {rope})"
        if self.attention_chunk is not None:
            return f"chunked local attention of {self.attention_chunk} tokens"
        return self.kind if self.sliding_window is None else f"sliding window of {self.sliding_window} tokens"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (global indices, in model order) that share one block table per request."""

    spec: KVCacheSpec
    layers: tuple[int, ...]

    @property
    def sliding_window(self) -> Optional[int]:
        """The group's window (None: it keeps every token)."""
        return self.spec.sliding_window

    @property
    def attention_chunk(self) -> Optional[int]:
        """The group's attention chunk (None: no chunks)."""
        return self.spec.attention_chunk


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's layers split into groups of `layers_per_group` layers each (see the module docstring)."""

    groups: tuple[KVCacheGroup, ...]

    @property
    def layers_per_group(self) -> int:
        """Layers in each group: a pool block is a page of this many layers."""
        return len(self.groups[0].layers)

    @property
    def windows(self) -> list[Optional[int]]:
        """Each group's sliding window (None for groups that keep every token)."""
        return [group.sliding_window for group in self.groups]

    @property
    def chunks(self) -> list[Optional[int]]:
        """Each group's attention chunk (None for groups without chunks)."""
        return [group.attention_chunk for group in self.groups]

    def place(self, layer: int) -> tuple[int, int]:
        """(group, position in the group) of global layer `layer`: it uses cache tensor `position`
        through the tables of `group`."""
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index, group.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV cache group")

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one pool block: `block_size` tokens of `layers_per_group` layers."""
        return block_size * self.layers_per_group * self.groups[0].spec.bytes_per_token

    def describe(self) -> str:
        """Memory per token, per group, as the engine reports it at start."""
        kinds: dict[KVCacheSpec, int] = {}
        for group in self.groups:
            kinds[group.spec] = kinds.get(group.spec, 0) + 1
        parts = []
        for spec, count in kinds.items():
            layers = count * self.layers_per_group
            per_token = layers * spec.bytes_per_token
            reach = "every token" if spec.sliding_window is None else f"at most its {spec.sliding_window} latest tokens"
            if spec.attention_chunk is not None:
                reach = f"at most its current chunk's {spec.attention_chunk} tokens"
            parts.append(f"{spec.describe()}: {count} group(s), {layers} layers, {per_token / 1024:.1f} KiB per "
                         f"token, for {reach}")
        return "; ".join(parts)


def group_layers(specs: list[KVCacheSpec]) -> KVCacheLayout:
    """Group layers of equal spec into groups of equal size (in model order within each kind).

    ValueError if the kinds cache different amounts per token: one pool's blocks must fit every group.
    """
    if not specs:
        raise ValueError("a model without layers has no KV cache")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    shapes = {(spec.planes, spec.num_kv_heads, spec.head_dim, spec.dtype_bytes) for spec in by_spec}
    if len(shapes) > 1:
        raise ValueError(f"layers cache K/V of different shapes (planes, kv heads, head dim, bytes: {sorted(shapes)}): "
                         "one KV block pool cannot hold them")
    size = 0
    for layers in by_spec.values():
        size = gcd(size, len(layers))
    groups = [KVCacheGroup(spec, tuple(layers[i:i + size]))
              for spec, layers in by_spec.items() for i in range(0, len(layers), size)]
    return KVCacheLayout(tuple(groups))


def single_group(num_layers: int, spec: KVCacheSpec) -> KVCacheLayout:
    """Every layer in one full-attention-like group (a draft model's cache, or a test's)."""
    return KVCacheLayout((KVCacheGroup(spec, tuple(range(num_layers))),))
