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

A recurrent layer (Mamba2's mixer) keeps no per-token cache but one state per request (`StateCacheSpec`):
its group's table holds one pool block for the request's whole life, the state page, whatever its length.
Budget rule: state pages and attention blocks come from one pool and so from one memory budget.
- All recurrent (Mamba2): a pool block is one request's state of `layers_per_group` layers.
- Hybrid (Granite 4.0-H: recurrent layers beside attention layers): a pool block is an attention block (block_size
  tokens of `layers_per_group` layers, nothing padded), and a request's state takes `state_blocks(block_size)`
  whole blocks of each state group's table: the state of the layer at position j lives in the bytes of cache
  tensor j at those blocks (the runner gathers them, `layers/paged_state.py`). The cost: the unused tail of the
  last of those blocks (under one block per request and state group) and a gather and a scatter of the state per
  layer and step. vLLM instead raises the attention block size until one attention page holds a whole state and
  pads the state page up to it: no copies, but a block of hundreds of tokens (a short request holds them all) and
  a cache layout whose block is one contiguous range of bytes, which the attention backends here do not keep
  (their tensors are [planes, blocks, ...]). Keeping each kind in tensors of its own, one row per pool block,
  would count every block's bytes twice (the sum of the two pages: a block serves one kind at a time).
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

    recurrent = False  # a per-token cache (StateCacheSpec: one state per request)

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
class StateCacheSpec:
    """What one recurrent layer (a Mamba2 mixer, or Qwen3-Next's Gated DeltaNet) keeps per request, whatever its
    length: the convolution's last `conv_kernel - 1` inputs of `conv_dim` channels (compute dtype) and the state of
    `num_heads` x `head_dim` x `state_size` (float32, as the scan or delta rule computes it; the DeltaNet's is a
    key_head_dim x value_head_dim matrix per value head). Its bytes live in the runner's state tensors
    (worker/model_runner.py), row = the request's state page (its group's one pool block)."""

    conv_kernel: int
    conv_dim: int
    num_heads: int
    head_dim: int
    state_size: int
    dtype_bytes: int
    ssm_dtype_bytes: int = 4
    sliding_window: Optional[int] = None  # (none: read alike with KVCacheSpec by KVCacheGroup)
    quantized: Optional[str] = None  # states are never one-byte rows
    mla_latent: Optional[tuple[int, int]] = None
    attention_chunk: Optional[int] = None

    kind = "recurrent state"
    recurrent = True

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's state of one request."""
        return ((self.conv_kernel - 1) * self.conv_dim * self.dtype_bytes
                + self.num_heads * self.head_dim * self.state_size * self.ssm_dtype_bytes)

    def describe(self) -> str:
        """The spec in words."""
        return (f"recurrent state (conv {self.conv_kernel - 1}x{self.conv_dim}, SSM {self.num_heads}x{self.head_dim}"
                f"x{self.state_size})")


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (global indices, in model order) that share one block table per request."""

    spec: "KVCacheSpec | StateCacheSpec"
    layers: tuple[int, ...]

    @property
    def sliding_window(self) -> Optional[int]:
        """The group's window (None: it keeps every token)."""
        return self.spec.sliding_window

    @property
    def recurrent(self) -> bool:
        """Whether the group keeps one state page per request (no per-token cache)."""
        return self.spec.recurrent

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
    def state_groups(self) -> frozenset[int]:
        """Indices of the groups that keep a recurrent state page per request."""
        return frozenset(index for index, group in enumerate(self.groups) if group.recurrent)

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

    @property
    def attention_spec(self) -> "Optional[KVCacheSpec]":
        """The spec whose K/V shape every attention group shares (None: every layer is recurrent)."""
        return next((group.spec for group in self.groups if not group.recurrent), None)

    @property
    def state_spec(self) -> "Optional[StateCacheSpec]":
        """The recurrent layers' state (None: no recurrent layer)."""
        return next((group.spec for group in self.groups if group.recurrent), None)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one pool block: `block_size` tokens of `layers_per_group` layers, or, with no attention at
        all, one request's state of `layers_per_group` recurrent layers (see the module docstring)."""
        attention = self.attention_spec
        if attention is None:
            return self.layers_per_group * self.groups[0].spec.page_bytes
        return block_size * self.layers_per_group * attention.bytes_per_token

    def state_blocks(self, block_size: int) -> int:
        """Pool blocks a request's state takes in each state group's table: 1 with no attention (a block is a
        state page), else as many attention blocks as one layer's state needs (each position's cache tensor
        holds one layer of the group: a block of it has block_size x one layer's bytes per token)."""
        attention, state = self.attention_spec, self.state_spec
        if state is None or attention is None:
            return 1
        return -(-state.page_bytes // (block_size * attention.bytes_per_token))

    def describe(self, block_size: Optional[int] = None) -> str:
        """Memory per token, per group, as the engine reports it at start (with `block_size`, a hybrid's state
        also in pool blocks)."""
        kinds: dict = {}
        for group in self.groups:
            kinds[group.spec] = kinds.get(group.spec, 0) + 1
        parts = []
        for spec, count in kinds.items():
            layers = count * self.layers_per_group
            if spec.recurrent:
                blocks = ""
                if block_size is not None and self.attention_spec is not None:
                    blocks = f" ({self.state_blocks(block_size)} pool block(s) in each of its {count} group(s))"
                parts.append(f"{spec.describe()}: {count} group(s), {layers} layers, "
                             f"{layers * spec.page_bytes / 1024:.1f} KiB per request whatever its length, 0 per "
                             f"token{blocks}")
                continue
            per_token = layers * spec.bytes_per_token
            reach = "every token" if spec.sliding_window is None else f"at most its {spec.sliding_window} latest tokens"
            if spec.attention_chunk is not None:
                reach = f"at most its current chunk's {spec.attention_chunk} tokens"
            parts.append(f"{spec.describe()}: {count} group(s), {layers} layers, {per_token / 1024:.1f} KiB per "
                         f"token, for {reach}")
        return "; ".join(parts)


def group_layers(specs: list) -> KVCacheLayout:
    """Group layers of equal spec (`KVCacheSpec` or `StateCacheSpec`) into groups of equal size (in model
    order within each kind).

    ValueError if the attention kinds cache different amounts per token (one pool's blocks must fit every group),
    or recurrent layers keep states of different shapes. A hybrid's recurrent layers form groups of the same size
    as its attention groups (a state group's blocks hold its layers' states: see the module docstring).
    """
    if not specs:
        raise ValueError("a model without layers has no KV cache")
    states = {spec for spec in specs if spec.recurrent}
    if len(states) > 1:
        raise ValueError("recurrent layers of different state shapes cannot share one pool")
    if len(states) == len(set(specs)):  # every layer recurrent: one group, a block per request
        return KVCacheLayout((KVCacheGroup(specs[0], tuple(range(len(specs)))),))
    by_spec: dict = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    shapes = {(spec.planes, spec.num_kv_heads, spec.head_dim, spec.dtype_bytes) for spec in by_spec
              if not spec.recurrent}
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
