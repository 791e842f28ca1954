"""The second KV tier's memory: evicted blocks' K/V wait here to be copied back instead of recomputed.

CPU pool: a memory-mapped file on disk (the OS pages it in and out). CUDA pool: pinned host memory.
The layout per layer is the attention backend's, with tier slots in place of pool blocks (dim 1).
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import torch


class KVTierStore:
    """`num_slots` block-sized slots per layer, and the copies between them and the pool."""

    def __init__(self, layer_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                 pool_device: torch.device, folder: Optional[str] = None) -> None:
        shape = (num_layers, *layer_shape)
        if pool_device.type == "cuda":
            self.data = torch.empty(shape, dtype=dtype, pin_memory=True)
            self.path = None
            return
        directory = folder or tempfile.gettempdir()
        os.makedirs(directory, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="tokenmill-kv-tier-", suffix=".bin", dir=directory)
        numel = 1
        for size in shape:
            numel *= size
        os.ftruncate(fd, numel * torch.tensor([], dtype=dtype).element_size())
        os.close(fd)
        self.data = torch.from_file(self.path, shared=True, size=numel, dtype=dtype).view(shape)
        os.unlink(self.path)  # the mapping stays valid; the file goes away with the process

    def save(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy pool blocks to tier slots: pairs of (block, slot)."""
        if not pairs:
            return
        blocks = torch.tensor([b for b, _ in pairs], device=kv_caches[0].device)
        slots = torch.tensor([s for _, s in pairs])
        for layer, cache in enumerate(kv_caches):
            self.data[layer][:, slots] = cache[:, blocks].to("cpu", non_blocking=True)

    def load(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy tier slots back into pool blocks: pairs of (slot, block)."""
        if not pairs:
            return
        slots = torch.tensor([s for s, _ in pairs])
        blocks = torch.tensor([b for _, b in pairs], device=kv_caches[0].device)
        for layer, cache in enumerate(kv_caches):
            cache[:, blocks] = self.data[layer][:, slots].to(cache.device, non_blocking=True)
