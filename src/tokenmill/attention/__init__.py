"""Paged attention backends behind one interface."""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import torch

from tokenmill import envs
from tokenmill.attention.base import AttentionBackend, AttentionLayer, SequenceChunk
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import ATTENTION_BACKENDS

__all__ = ["AttentionBackend", "AttentionLayer", "SequenceChunk", "TorchReferenceBackend", "get_attention_backend"]

logger = logging.getLogger(__name__)


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                          batch_invariant: bool = True) -> tuple[AttentionBackend, Optional[Any]]:
    """The backend for `name` (auto | torch_ref | cpu_paged | triton_paged) on `device` for a `dtype` KV
    cache, and the native CPU kernels when it uses them. auto picks cpu_paged on CPU for float32 and
    bfloat16 when the kernels build, triton_paged on CUDA when Triton imports, else torch_ref (float16
    on CPU included: the kernels do not read it). `batch_invariant`: every query attends alike (see
    CpuPagedBackend, TritonPagedBackend)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(ATTENTION_BACKENDS)})")
    if name == "triton_paged" or (name == "auto" and device.type == "cuda"):
        backend = _triton_backend(device, dtype, batch_invariant, required=name == "triton_paged")
        return backend or TorchReferenceBackend(), None
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


def _triton_backend(device: torch.device, dtype: torch.dtype, batch_invariant: bool,
                    required: bool) -> Optional[AttentionBackend]:
    """The Triton backend, or None (logged) where auto cannot have it; ValueError naming the reason where
    triton_paged was asked for by name. On CPU the kernels run in Triton's interpreter, which Triton
    fixes when it is first imported: TRITON_INTERPRET is set here unless Triton is already loaded."""
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend triton_paged takes float32, float16 or bfloat16, not {dtype_name}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention backend triton_paged runs on cuda (or cpu, interpreted), not {device.type}")
    interpret = device.type == "cpu"
    if interpret and "triton" not in sys.modules:
        envs.interpret_triton()
    try:
        from tokenmill.attention.triton_paged import TritonPagedBackend
        from tokenmill.attention.triton_kernels import INTERPRETED
    except ImportError as exc:
        if required:
            raise ValueError(f"attention backend triton_paged needs Triton ({exc}): pip install triton") from exc
        logger.warning("Triton is not installed (%s): CUDA attention falls back to torch_ref, which gathers "
                       "every context per layer; pip install triton", exc)
        return None
    if INTERPRETED and not interpret:
        raise ValueError("attention backend triton_paged on cuda: TRITON_INTERPRET=1 is set, so Triton interprets "
                         "its kernels on CPU tensors; unset it")
    if interpret and not INTERPRETED:
        raise ValueError("attention backend triton_paged on cpu: Triton was imported before TRITON_INTERPRET=1 "
                         "was set, so its kernels compile for a GPU; set TRITON_INTERPRET=1 before starting")
    if interpret:
        logger.warning("attention backend triton_paged on CPU: Triton's interpreter runs the kernels "
                       "(a test path, orders of magnitude slower than cpu_paged)")
    return TritonPagedBackend(batch_invariant, device)
