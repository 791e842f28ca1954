"""The bytes of a prefill/decode transfer file: the K/V of some pool blocks, layer after layer.

Layout: for each layer in order, `cache[:, blocks]` of that layer's KV pages (dim 1 indexes blocks),
contiguous, in the pool's dtype. A file of k blocks holds k * (bytes of one block over every layer);
the engine writes the description beside it (engine/kv_transfer.py).
"""

from __future__ import annotations

import os

import torch


def export_blocks(kv_pages: list[torch.Tensor], blocks: list[int], path: str) -> None:
    """Write the K/V of `blocks` to `path` (atomically: readers see the whole file or none)."""
    index = torch.tensor(blocks, device=kv_pages[0].device)
    partial = f"{path}.partial"
    with open(partial, "wb") as handle:
        for cache in kv_pages:
            part = cache.index_select(1, index).contiguous().cpu()
            handle.write(part.view(torch.uint8).numpy().tobytes())
    os.replace(partial, path)


def import_blocks(kv_pages: list[torch.Tensor], path: str, file_blocks: list[int], blocks: list[int]) -> None:
    """Copy block file_blocks[i] of the file into pool block blocks[i], every layer (the engine checked
    the file against this model and the request's tokens before adopting the blocks)."""
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    raw = torch.frombuffer(data, dtype=torch.uint8)
    per_block = sum(cache.element_size() * cache.shape[0] * cache[0, 0].numel() for cache in kv_pages)
    num_file_blocks = raw.numel() // per_block
    source = torch.tensor(file_blocks)
    target = torch.tensor(blocks, device=kv_pages[0].device)
    offset = 0
    for cache in kv_pages:
        shape = (cache.shape[0], num_file_blocks, *cache.shape[2:])
        size = cache.element_size() * cache.shape[0] * num_file_blocks * cache[0, 0].numel()
        layer = raw[offset:offset + size].view(cache.dtype).view(shape)
        cache.index_copy_(1, target, layer.index_select(1, source).to(cache.device))
        offset += size
