"""Reach into an engine to compute full-sequence logits, for comparisons with HF transformers."""

from __future__ import annotations

import torch

from tokenmill.attention.base import SequenceChunk
from tokenmill.core.kv_cache_manager import cdiv


@torch.inference_mode()
def model_logits(engine, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one sequence, computed through the paged KV path."""
    block_size = engine.kv_cache.block_size
    blocks = engine.kv_cache.pool.allocate(cdiv(len(ids), block_size))
    try:
        table = torch.tensor(blocks)
        positions = torch.arange(len(ids))
        slots = table[positions // block_size] * block_size + positions % block_size
        backend = engine.runner.backend
        metadata = backend.build_metadata([SequenceChunk(0, len(ids), len(ids), blocks)], slots,
                                          block_size, engine.device)
        hidden = engine.model(torch.tensor(ids), positions, engine.runner.kv_caches, metadata)
        return engine.model.compute_logits(hidden)
    finally:
        engine.kv_cache.pool.release(blocks)


@torch.inference_mode()
def hf_greedy_tokens(model, ids: list[int], count: int) -> list[int]:
    """Plain greedy decoding with HF's own KV cache; EOS is just another token (like ignore_eos)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(count):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
