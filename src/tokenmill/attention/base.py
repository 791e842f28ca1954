"""The attention backend interface: write new K/V through a slot mapping, read context through block tables."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """What one layer's attention adds to the step's metadata: its softmax scale, its sliding window
    (a query at position p sees keys (p - sliding_window, p]; None: every earlier key), its score
    soft cap (scores -> cap * tanh(scores / cap) before the softmax, Gemma 2's; None: none) and its
    attention sinks (GPT-OSS: float32 [local query heads], contiguous, on the model's device; head h's softmax
    denominator gains exp(sinks[h]), a logit that takes no value, so a query may attend to "nothing"; None: none)
    and its attention chunk (Llama 4's chunked local attention: a query at position p sees keys
    [(p // chunk) * chunk, p], the start aligned to chunk boundaries; None: none).
    Compared by identity (eq=False): it holds a tensor."""

    scale: float
    sliding_window: Optional[int] = None
    logit_softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    attention_chunk: Optional[int] = None


@dataclass(frozen=True)
class SequenceChunk:
    """One request's queries in the flattened batch.

    Tokens [query_start, query_start + query_len) of the batch sit at absolute positions
    [context_len - query_len, context_len) of the sequence; after this step's K/V writes the
    cache holds positions [0, context_len) in `block_ids`.

    `query_by_query` asks for each query to be attended exactly as a one-token decode step at its
    position would be (speculative verification: the accepted tokens' outputs must not depend on
    whether they were verified or decoded one by one).

    `block_ids` is a list, or an int32 row of the step's tables (worker/input_batch.py).
    """

    query_start: int
    query_len: int
    context_len: int
    block_ids: Sequence[int]
    query_by_query: bool = False


def key_only(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `kv_cache` is key-only (one plane). ValueError if it is and v is not k: only a layer whose
    values are its keys (MLA's latent) can use such a cache."""
    if kv_cache.shape[0] != 1:
        return False
    if v is not k:
        raise ValueError("a key-only KV cache stores layers whose values are their keys: v must be k")
    return True


class AttentionBackend(ABC):
    """Computes causal attention over a paged KV cache for a flattened, unpadded token batch."""

    # the Triton backend: its steps may replay CUDA graphs, and the model's norms, activations and RoPE
    # may run on layers/triton_fused.py (set by attention/triton_paged.py, which alone imports Triton)
    on_triton: bool = False

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       planes: int = 2) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (the backend chooses the layout, but dimension 1 is
        always the block dimension: the second KV tier copies whole blocks along it). `planes` 1 is a
        key-only cache (an MLA latent): the keys are the values, and `forward` must get v = k."""

    @abstractmethod
    def build_metadata(self, chunks: list[SequenceChunk], slot_mapping: torch.Tensor,
                       block_size: int, device: torch.device, tables: Optional[np.ndarray] = None) -> Any:
        """Precompute, once per step, whatever every layer's forward needs. `slot_mapping`: [T] int64 slots
        of the new tokens, on the host or on `device` (the backend moves it where it reads it). `tables`,
        when the caller has them: [len(chunks), W] int32, row i chunk i's block table (0 past its blocks),
        which a backend may take instead of gathering the chunks' own."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, layer: AttentionLayer) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: one layer's tensor. Returns [T, H, D].

        Writes k and v into the cache at metadata's slot mapping first, then attends with `layer`'s
        scale and window.
        """
