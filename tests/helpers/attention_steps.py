"""One attention step of every kind a kernel must get right, on random tensors: for the kernel tests that
check a change to the softmax (a score soft cap, sinks) on every backend against a formula."""

from __future__ import annotations

import torch

from tokenmill.attention.base import SequenceChunk


def mixed_attention_step(heads: int, kv_heads: int, head_dim: int, seed: int, block_size: int = 8) -> tuple:
    """(cache, chunks, slots, q, k, v, generator): a random float32 cache [2, 40, kv_heads, block_size,
    head_dim] and one step of 13 query rows: a decode after 69 cached tokens, a 6-token chunk from position 0,
    a 5-token chunk after 25 cached tokens and a decode at position 1; each row's K/V slot in `slots`. The
    generator, seeded with `seed`, has drawn the cache, q, k and v in that order; draw more from it after."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, 40, kv_heads, block_size, head_dim, generator=gen)
    chunks = [SequenceChunk(0, 1, 70, list(range(0, 9))), SequenceChunk(1, 6, 6, [9]),
              SequenceChunk(7, 5, 30, [10, 11, 12, 13]), SequenceChunk(12, 1, 2, [14])]
    slots = torch.tensor([8 * block_size + 5] + [9 * block_size + i for i in range(6)]
                         + [13 * block_size + i for i in range(1, 6)] + [14 * block_size + 1])
    q = torch.randn(13, heads, head_dim, generator=gen)
    k, v = torch.randn(2, 13, kv_heads, head_dim, generator=gen)
    return cache, chunks, slots, q, k, v, gen
