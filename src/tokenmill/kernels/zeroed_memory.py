"""Zero-filled tensors for the KV pool that cost nothing until written."""

from __future__ import annotations

import math
import mmap
import weakref

import torch

# the mapping behind each zeroed() tensor, by its address (while the mapping lives)
_MAPPINGS: dict[int, "weakref.ref[mmap.mmap]"] = {}


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On CPU its bytes are an anonymous mapping, which the OS hands out zeroed page by page as
    they are first written: a pool sized for its whole budget costs no start-up time and no memory for the blocks
    a run never fills (torch.zeros writes every byte first: 0.85 s for the default 1 GiB on CPU). The tensor keeps
    the mapping alive; the mapping is unmapped with its last tensor. Other devices: torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, count * dtype.itemsize)  # anonymous (shared memory): zero-filled by the OS
    tensor = torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)
    for address in [address for address, ref in _MAPPINGS.items() if ref() is None]:  # (unmapped since)
        del _MAPPINGS[address]
    _MAPPINGS[tensor.data_ptr()] = weakref.ref(mapping)
    return tensor


def release(tensor: torch.Tensor) -> bool:
    """Give the pages of a zeroed() CPU tensor back to the OS (madvise REMOVE: the mapping's shared-memory pages
    are freed, not only unmapped): it reads as zeros again and costs memory only as it is written anew, the tensor
    and its address unchanged. False (nothing done) for a tensor of another kind (another device, or memory
    zeroed() did not map)."""
    ref = _MAPPINGS.get(tensor.data_ptr()) if tensor.device.type == "cpu" else None
    mapping = ref() if ref is not None else None
    if mapping is None or len(mapping) != tensor.untyped_storage().nbytes():
        return False
    mapping.madvise(mmap.MADV_REMOVE)
    return True
