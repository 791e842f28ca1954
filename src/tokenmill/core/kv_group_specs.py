"""What one KV cache group needs of its blocks: full attention, a sliding window, chunked local attention or a
recurrent state (no torch).

The KV manager keeps one block table per group and asks the group's spec, as vLLM asks its per-type
managers (`SingleTypeKVCacheManager`): which blocks a query still sees, how many blocks a request holds
at most, and whether the group's cached blocks serve a prefix hit. A new kind of attention is one
subclass here and its case in `group_spec`.
"""

from __future__ import annotations

from typing import Optional, Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class GroupSpec:
    """One group's rules (subclasses: full attention, a sliding window, chunked local attention)."""

    # whether a prefix hit needs every one of its blocks in this group (the hit ends at the first miss)
    needs_whole_prefix: bool = True
    # whether the group keeps one state page per request instead of a block per block_size tokens
    recurrent: bool = False
    # whether a request holds every block of its table until it ends (none given back early), so that its table
    # copied out and back in is all it had: what swap preemption needs (core/swap_space.py)
    keeps_every_block: bool = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def first_needed(self, num_tokens: int) -> int:
        """Index of the first block a query at position `num_tokens` can see."""
        raise NotImplementedError

    def table_length(self, num_tokens: int) -> int:
        """Entries of a request's table in this group when it holds `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens, computed in chunks of at most `max_chunk`,
        holds at once."""
        raise NotImplementedError

    def serves(self, found: Sequence[object], num_blocks: int, missing: object) -> bool:
        """Whether the group's blocks `found` for a prefix (`missing` where a block is cached nowhere) serve
        a hit of its first `num_blocks` blocks."""
        return missing not in found[self.first_needed(num_blocks * self.block_size):num_blocks]


class FullAttentionSpec(GroupSpec):
    """Every query sees every earlier key: a request keeps all its blocks, and a hit needs them all."""

    keeps_every_block = True

    def first_needed(self, num_tokens: int) -> int:
        return 0

    def blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        return cdiv(num_tokens, self.block_size)


class SlidingWindowSpec(GroupSpec):
    """A sliding window of W tokens: a query at position p sees keys (p - W, p], so the blocks before its
    window go back to the pool, and a hit needs only the blocks its next query sees."""

    needs_whole_prefix = False

    def __init__(self, block_size: int, window: int) -> None:
        super().__init__(block_size)
        self.window = window

    def first_needed(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window + 1) // self.block_size

    def blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The chunk and the window before it, at most."""
        return min(cdiv(num_tokens, self.block_size), cdiv(self.window - 1 + max_chunk, self.block_size) + 1)


class RecurrentStateSpec(GroupSpec):
    """A recurrent state (Mamba2's conv and SSM states, as vLLM's `MambaSpec`): a request holds exactly one
    block, its state page, from its first token to its end, whatever its length; every step reads and
    overwrites it in place. So a page is never shared (no prefix hit, no fork), and a request that loses it
    (preempted by recompute) starts again from a zero state at position 0; one preempted by swapping gets its
    page's bytes back in a new page (core/swap_space.py) and goes on from its state. In a hybrid the page is `pages`
    pool blocks (core/kv_spec.py's `state_blocks`: a state larger than an attention block), held alike."""

    recurrent = True
    keeps_every_block = True  # its pages, for its whole life

    def __init__(self, block_size: int, pages: int = 1) -> None:
        super().__init__(block_size)
        if pages < 1:
            raise ValueError(f"a recurrent state takes at least one pool block, not {pages}")
        self.pages = pages

    def first_needed(self, num_tokens: int) -> int:
        return 0

    def table_length(self, num_tokens: int) -> int:
        return self.pages if num_tokens > 0 else 0

    def blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        return self.table_length(num_tokens)

    def serves(self, found: Sequence[object], num_blocks: int, missing: object) -> bool:
        """Never: the page holds the state after the request's latest token, not after a block boundary."""
        return False


class ChunkedLocalSpec(GroupSpec):
    """Chunked local attention of C positions (Llama 4): a query at position p sees keys [(p // C) * C, p], so the
    blocks wholly before its chunk go back to the pool, and a hit needs only the blocks its next query sees."""

    needs_whole_prefix = False

    def __init__(self, block_size: int, chunk: int) -> None:
        super().__init__(block_size)
        self.chunk = chunk

    def first_needed(self, num_tokens: int) -> int:
        return num_tokens // self.chunk * self.chunk // self.block_size

    def blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The step's queries and the rest of the first one's chunk before them (at most C - 1 keys), at most."""
        return min(cdiv(num_tokens, self.block_size), cdiv(self.chunk - 1 + max_chunk, self.block_size) + 1)


def group_spec(block_size: int, window: Optional[int], chunk: Optional[int] = None, recurrent: bool = False,
               state_pages: int = 1) -> GroupSpec:
    """The spec of a group with sliding window `window` or attention chunk `chunk` (both None: full attention),
    or of a recurrent state of `state_pages` pool blocks."""
    if recurrent:
        return RecurrentStateSpec(block_size, state_pages)
    if chunk is not None:
        return ChunkedLocalSpec(block_size, chunk)
    return FullAttentionSpec(block_size) if window is None else SlidingWindowSpec(block_size, window)
