"""Paged attention backends behind one interface."""

from tokenmill.attention.base import AttentionBackend, SequenceChunk
from tokenmill.attention.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "SequenceChunk", "TorchReferenceBackend", "get_attention_backend"]


def get_attention_backend(name: str = "torch_ref") -> AttentionBackend:
    """The backend called `name` (only the torch reference backend exists today)."""
    if name != "torch_ref":
        raise ValueError(f"unknown attention backend {name!r} (available: torch_ref)")
    return TorchReferenceBackend()
