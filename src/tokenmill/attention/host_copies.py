"""Host-to-device copies that never wait for the device: through a ring of pinned buffers.

A copy from pageable host memory may wait for the stream's earlier work, which under async scheduling is
the step still running: every per-step input (ids, positions, index tensors, graph buffers) goes through
here instead. Each call takes the next pinned buffer of the ring and first waits for that buffer's own
previous copies (an event), issued RING calls ago: steps make a handful of calls, so that is a step that
has finished, and a copy in flight never reads a buffer being rewritten.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

RING = 16  # pinned buffers in turn; a step's calls (a few per KV group) stay well below half of it


class PinnedCopies:
    """Uploads host arrays to one device; plain copies off CUDA, where work is done when issued."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[Optional[torch.Tensor]] = [None] * RING  # bytes
        self._done: list[Optional[Any]] = [None] * RING
        self._turn = 0

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """A fresh device tensor holding `array` (its dtype and shape)."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return host
        dest = torch.empty_like(host, device=self.device)
        self.copy([(dest, array)])
        return dest

    def indices(self, values: Sequence[int]) -> torch.Tensor:
        """int64 `values` on the device (token ids, positions, row indices)."""
        return self.upload(np.asarray(values, dtype=np.int64))

    def copy(self, pairs: Sequence[tuple[torch.Tensor, np.ndarray]]) -> None:
        """dest.copy_(array) for each (contiguous device tensor, host array of its dtype and size)."""
        if self.device.type != "cuda":
            for dest, array in pairs:
                dest.copy_(torch.from_numpy(np.ascontiguousarray(array)).view(dest.shape))
            return
        turn, self._turn = self._turn, (self._turn + 1) % RING
        if self._done[turn] is not None:
            self._done[turn].synchronize()
        sizes = [array.nbytes for _, array in pairs]
        offsets = np.cumsum([0] + [-(-size // 8) * 8 for size in sizes])  # 8-byte aligned
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < offsets[-1]:
            buffer = self._buffers[turn] = torch.empty(max(int(offsets[-1]) * 2, 4096), dtype=torch.uint8,
                                                       pin_memory=True)
        host = buffer.numpy()
        for (dest, array), offset, size in zip(pairs, offsets, sizes):
            host[offset:offset + size] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            dest.copy_(buffer[offset:offset + size].view(dest.dtype).view(dest.shape), non_blocking=True)
        self._done[turn] = torch.cuda.Event()
        self._done[turn].record()
