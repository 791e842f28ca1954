"""Sizing the KV pool from free GPU memory: one profiling forward pass of a full step measures the peak
that weights and activations take, and the KV cache gets what `gpu_memory_utilization` leaves."""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenmill.attention.base import AttentionBackend, SequenceChunk

logger = logging.getLogger(__name__)
_GIB = 1 << 30


def blocks_for_budget(total: int, free: int, reserved: int, peak: int, utilization: float,
                      block_bytes: int) -> int:
    """KV blocks that fit in `utilization` of the device's `total` bytes once this process's peak
    allocation (`peak`: weights and a full step's activations) and the memory outside PyTorch's
    allocator (`total - free - reserved`: the CUDA context, other processes) are taken out. ValueError
    when none fits, naming the figures."""
    outside = max(total - free - reserved, 0)
    budget = int(total * utilization) - peak - outside
    if budget < block_bytes:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no memory for the KV cache: "
                         f"{peak / _GIB:.2f} GiB peak for weights and activations and {outside / _GIB:.2f} GiB "
                         f"outside PyTorch, of {total / _GIB:.2f} GiB; raise --gpu-memory-utilization or lower "
                         "--max-num-batched-tokens")
    return budget // block_bytes


@torch.inference_mode()
def profile_kv_blocks(model: Any, backend: AttentionBackend, cache_shape: tuple[int, ...], cache_dtype: torch.dtype,
                      num_tokens: int, num_logit_rows: int, block_size: int, block_bytes: int,
                      utilization: float, device: torch.device) -> int:
    """Run one forward pass of `num_tokens` prompt tokens (and the head on `num_logit_rows` rows) over a
    scratch cache, then size the pool with `blocks_for_budget`. `cache_shape`: one layer's scratch cache
    of enough blocks for `num_tokens`."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    caches = [torch.zeros(cache_shape, dtype=cache_dtype, device=device) for _ in model.layers]
    chunk = SequenceChunk(0, num_tokens, num_tokens, list(range(cache_shape[1])))
    metadata = backend.build_metadata([chunk], torch.arange(num_tokens), block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    hidden = model(ids, positions, caches, [metadata] * len(caches))
    if hidden is not None:
        model.compute_logits(hidden[-min(num_logit_rows, num_tokens):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    blocks = blocks_for_budget(total, free, torch.cuda.memory_reserved(device), peak, utilization, block_bytes)
    logger.info("KV pool sized from GPU memory: %.2f GiB peak for weights and a %d-token step, %d blocks "
                "(%.2f GiB) at gpu_memory_utilization %.2f", peak / _GIB, num_tokens, blocks,
                blocks * block_bytes / _GIB, utilization)
    return blocks
