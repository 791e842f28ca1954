"""Paged attention backends behind one interface."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tokenmill.attention.base import AttentionBackend, AttentionLayer, SequenceChunk
from tokenmill.attention.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "AttentionLayer", "SequenceChunk", "TorchReferenceBackend", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                          batch_invariant: bool = True) -> tuple[AttentionBackend, Optional[Any]]:
    """The backend for `name` (auto | torch_ref | cpu_paged) on `device` for a `dtype` KV cache, and the
    native CPU kernels when it uses them. auto picks cpu_paged on CPU for float32 and bfloat16 when the
    kernels build, else torch_ref (float16 included: the kernels do not read it). `batch_invariant`:
    cpu_paged attends every query alike (see CpuPagedBackend)."""
    if name not in ("auto", "torch_ref", "cpu_paged"):
        raise ValueError(f"unknown attention backend {name!r} (available: auto, torch_ref, cpu_paged)")
    native_dtype = dtype in (torch.float32, torch.bfloat16)
    if name == "torch_ref" or (name == "auto" and (device.type != "cpu" or not native_dtype)):
        return TorchReferenceBackend(), None
    if device.type != "cpu":
        raise ValueError("attention backend cpu_paged runs on the CPU only")
    if not native_dtype:
        dtype_name = str(dtype).removeprefix("torch.")
        raise ValueError(f"attention backend cpu_paged takes float32 or bfloat16, not {dtype_name}; "
                         "use torch_ref (or auto)")
    from tokenmill.attention.cpu_paged import CpuPagedBackend
    from tokenmill.kernels.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        if name == "cpu_paged":
            raise ValueError("attention backend cpu_paged needs the native kernels, which could not be built "
                             "(see the warning above); use torch_ref")
        return TorchReferenceBackend(), None
    return CpuPagedBackend(kernels, batch_invariant), kernels
