"""The second KV tier's memory: evicted blocks' K/V wait here to be copied back instead of recomputed.

CPU pool: a memory-mapped file on disk (the OS pages it in and out). CUDA pool: pageable host memory,
which the OS commits only as slots are written, with copies through one bounded pinned staging buffer
(`CudaCopier`), page-locked on the first copy: a swap space of gigabytes pins nothing until it is used,
and then only `STAGING_BYTES`.
The layout per layer is the attention backend's, with tier slots in place of pool blocks (dim 1).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Iterator, Optional, Protocol

import torch

STAGING_BYTES = 64 << 20  # the pinned buffer of a CUDA store: its copies go by batches of this size

# a batch of one copy: (layer, first pair, end pair) pieces, together no larger than the staging buffer
Batch = list[tuple[int, int, int]]


class Copier(Protocol):
    """What the CUDA path needs of the device: pinned buffers, asynchronous copies and events."""

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def to_device(self, src: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def record(self) -> Any: ...

    def wait(self, event: Any) -> None: ...


class CudaCopier:
    """`Copier` on CUDA: the copies run on the current stream, ordered after the steps that wrote the
    blocks and before those that read them; an event marks when the host may touch their buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host buffer."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start copying device `src` into pinned `dst` (complete once a later event is waited on)."""
        dst.copy_(src, non_blocking=True)

    def to_device(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Start copying pinned `src` to `device` (`src` is read until a later event completes)."""
        return src.to(device, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        """An event after the work queued so far on the current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        """Block the host until `event` has completed."""
        event.synchronize()


class KVTierStore:
    """`num_slots` block-sized slots per layer, and the copies between them and the pool.

    CUDA invariants: `save` returns only once its copies have landed in `data`; the staging buffer is
    written (by either direction) only after the last `load`'s copies out of it have completed.
    `copier` replaces `CudaCopier` (tests)."""

    def __init__(self, layer_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                 pool_device: torch.device, folder: Optional[str] = None, copier: Optional[Copier] = None,
                 staging_bytes: int = STAGING_BYTES) -> None:
        shape = (num_layers, *layer_shape)
        self.copier: Optional[Copier] = None
        if pool_device.type == "cuda":
            self.data = torch.empty(shape, dtype=dtype)
            self.path = None
            self.copier = copier or CudaCopier(pool_device)
            self.staging: Optional[torch.Tensor] = None  # pinned on the first copy
            self.loading: Any = None  # the event after the last load's copies out of the staging buffer
            self.block_numel = self.data[0][:, 0].numel()  # one slot of one layer
            self.staging_blocks = max(1, min(staging_bytes // (self.block_numel * self.data.element_size()),
                                             num_layers * layer_shape[1]))
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
        if self.copier is not None:
            for batch in self._batches(len(pairs)):
                self._save_batch(kv_caches, blocks, slots, batch)
            return
        for layer, cache in enumerate(kv_caches):
            self.data[layer][:, slots] = cache[:, blocks].to("cpu", non_blocking=True)

    def load(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy tier slots back into pool blocks: pairs of (slot, block)."""
        if not pairs:
            return
        slots = torch.tensor([s for s, _ in pairs])
        blocks = torch.tensor([b for _, b in pairs], device=kv_caches[0].device)
        if self.copier is not None:
            for batch in self._batches(len(pairs)):
                self._load_batch(kv_caches, slots, blocks, batch)
            return
        for layer, cache in enumerate(kv_caches):
            cache[:, blocks] = self.data[layer][:, slots].to(cache.device, non_blocking=True)

    def _save_batch(self, kv_caches: list[torch.Tensor], blocks: torch.Tensor, slots: torch.Tensor,
                    batch: Batch) -> None:
        """Gather the batch's blocks on the device, one copy into the staging buffer, wait for it, then
        scatter into the slots."""
        gathered = torch.cat([kv_caches[layer][:, blocks[first:end]].reshape(-1) for layer, first, end in batch])
        staging = self._claim_staging()[:gathered.numel()]
        self.copier.to_host(staging, gathered)
        self.copier.wait(self.copier.record())
        for (layer, first, end), part in zip(batch, self._parts(staging, batch)):
            self.data[layer].index_copy_(1, slots[first:end], part)

    def _load_batch(self, kv_caches: list[torch.Tensor], slots: torch.Tensor, blocks: torch.Tensor,
                    batch: Batch) -> None:
        """Gather the batch's slots into the staging buffer, one copy to the device, then scatter into
        the blocks there."""
        staging = self._claim_staging()[:sum(end - first for _, first, end in batch) * self.block_numel]
        for (layer, first, end), part in zip(batch, self._parts(staging, batch)):
            torch.index_select(self.data[layer], 1, slots[first:end], out=part)
        moved = self.copier.to_device(staging, kv_caches[0].device)
        for (layer, first, end), part in zip(batch, self._parts(moved, batch)):
            kv_caches[layer].index_copy_(1, blocks[first:end], part)
        self.loading = self.copier.record()

    def _claim_staging(self) -> torch.Tensor:
        """The staging buffer (pinned on first use), once no load's copy still reads it."""
        if self.loading is not None:
            self.copier.wait(self.loading)
            self.loading = None
        if self.staging is None:
            with torch.inference_mode(False):  # a plain tensor: written in and out of inference mode
                self.staging = self.copier.pinned(self.staging_blocks * self.block_numel, self.data.dtype)
        return self.staging

    def _parts(self, flat: torch.Tensor, batch: Batch) -> Iterator[torch.Tensor]:
        """The batch's pieces in `flat`, each shaped as a layer's [:, first:end] slice."""
        layer_shape = self.data.shape[1:]
        offset = 0
        for _, first, end in batch:
            shape = (layer_shape[0], end - first, *layer_shape[2:])
            numel = (end - first) * self.block_numel
            yield flat[offset:offset + numel].view(shape)
            offset += numel

    def _batches(self, count: int) -> Iterator[Batch]:
        """Every layer's pairs [0, count), cut into batches of at most `staging_blocks` blocks."""
        batch: Batch = []
        used = 0
        for layer in range(self.data.shape[0]):
            first = 0
            while first < count:
                end = min(count, first + self.staging_blocks - used)
                batch.append((layer, first, end))
                used += end - first
                first = end
                if used == self.staging_blocks:
                    yield batch
                    batch, used = [], 0
        if batch:
            yield batch
