"""The CPU paged-attention backend: native kernels for the KV writes, decode and bfloat16 prefill.

Decode reads each sequence's K/V straight out of its cache blocks (no gathered copies, no padding
mask) with one kernel call per layer for the whole batch, parallel over (sequence, kv head).
Bfloat16 prefill chunks, where the CPU has AMX, run as one call per layer for all chunks
(kernels/prefill_attention.c: flash attention on tiles over the cache blocks); other prefills go
through the reference backend's SDPA path. Same cache layout as the reference, which stays the
oracle the tests compare this backend with.

Batch-invariant (the default), every query must attend alike wherever it comes: with AMX, every chunk
of the step, decodes included, goes to the AMX tiles, whose arithmetic is lane-wise per query
(prefill_attention.c); elsewhere, and for the layers those tiles do not take (a sliding window or attention
chunk, float32, a quantised cache, other head sizes), every query attends as a one-token decode at its position
(kernels/decode_attention.c). Which of the two a layer takes depends on the layer alone, never on the
batch. A layer with a score soft cap (Gemma 2) or attention sinks (GPT-OSS) never takes the AMX tiles: the decode
kernels cap its scores and join its sinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenmill.attention.base import AttentionLayer, SequenceChunk, key_only
from tokenmill.attention.kv_quant import is_quantized
from tokenmill.attention.torch_ref import (TorchRefMetadata, TorchReferenceBackend, padded_block_tables, prefill_entries,
                                          split_decodes)
from tokenmill.kernels.cpu_kernels import CpuKernels, prefill_attention_fits


@dataclass
class CpuPagedMetadata(TorchRefMetadata):
    """The reference metadata plus what the kernels read: slots, int32 decode tables and lengths."""

    slots: Optional[torch.Tensor] = None  # [T] int64
    decode_lens: Optional[torch.Tensor] = None  # [B] int32
    decode_tables_i32: Optional[torch.Tensor] = None  # [B, max_blocks] int32
    prefill_chunks: Optional[torch.Tensor] = None  # [3, P] int64: query starts, query lengths, context lengths
    prefill_tables: Optional[torch.Tensor] = None  # [P, max_blocks] int32
    # batch-invariant with AMX: prefill_chunks holds every chunk, decodes included (`every_chunk`), and the
    # one-token decode rows of every query are built only for a layer the tiles do not take
    every_chunk: Optional[list[SequenceChunk]] = None
    block_size: int = 0


class CpuPagedBackend(TorchReferenceBackend):
    """Reference layout; native cache writes, decode and (bfloat16, AMX) prefill attention."""

    def __init__(self, kernels: CpuKernels, batch_invariant: bool = True) -> None:
        self.kernels = kernels
        # one arithmetic per query, whether it arrives in a prefill, a chunk, after a prefix-cache hit or
        # alone: on AMX tiles lane by lane, else as a one-token decode at its position (module docstring)
        self.batch_invariant = batch_invariant

    def build_metadata(self, chunks: list[SequenceChunk], slot_mapping: torch.Tensor,
                       block_size: int, device: torch.device, tables: Optional[np.ndarray] = None) -> CpuPagedMetadata:
        """The reference metadata (decode rows built here, not padded tables) plus the kernels' inputs."""
        tiles = self.kernels.amx and prefill_attention_fits(block_size=block_size)
        if self.batch_invariant and tiles:
            meta = CpuPagedMetadata(None, None, [], slots=slot_mapping, every_chunk=chunks, block_size=block_size)
            self._add_prefill_chunks(meta, chunks, block_size)
            return meta
        decodes, prefills = split_decodes(chunks, every_query=self.batch_invariant)
        # the cache writes take the slots themselves: no block ids and offsets
        meta = CpuPagedMetadata(None, None, prefill_entries(prefills, block_size, device), slots=slot_mapping)
        if prefills and tiles:
            self._add_prefill_chunks(meta, prefills, block_size)
        if decodes:
            self._add_decodes(meta, decodes, block_size)
        return meta

    @staticmethod
    def _add_prefill_chunks(meta: CpuPagedMetadata, chunks: list[SequenceChunk], block_size: int) -> None:
        meta.prefill_chunks = torch.tensor([[c.query_start for c in chunks], [c.query_len for c in chunks],
                                            [c.context_len for c in chunks]], dtype=torch.int64)
        meta.prefill_tables = padded_block_tables(chunks, block_size, torch.int32)

    @staticmethod
    def _add_decodes(meta: CpuPagedMetadata, decodes: list[SequenceChunk], block_size: int) -> None:
        meta.decode_tables_i32 = padded_block_tables(decodes, block_size, torch.int32)
        meta.decode_token_index = torch.tensor([c.query_start for c in decodes], dtype=torch.int64)
        meta.decode_lens = torch.tensor([c.context_len for c in decodes], dtype=torch.int32)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchRefMetadata, layer: AttentionLayer) -> torch.Tensor:
        """Write K/V, then attend (see AttentionBackend.forward)."""
        m = metadata
        if not isinstance(m, CpuPagedMetadata) or m.every_chunk is None:
            return super().forward(q, k, v, kv_cache, m, layer)
        self._write(k, v, kv_cache, m)
        out = q.new_empty(q.shape)
        if self.tiles_take(q, kv_cache, layer) and \
                self.kernels.prefill_attention(out, q, kv_cache, m.prefill_chunks, m.prefill_tables, layer.scale):
            return out
        self.add_query_decodes(m)
        self._decode_into(out, q, kv_cache, m, layer)
        return out

    @classmethod
    def add_query_decodes(cls, meta: CpuPagedMetadata) -> None:
        """Batch-invariant with AMX: the one-token decode rows of every query of `meta.every_chunk`, for
        what the tiles do not take (built on first need, once per step)."""
        if meta.decode_token_index is None:
            cls._add_decodes(meta, split_decodes(meta.every_chunk, every_query=True)[0], meta.block_size)

    @staticmethod
    def tiles_take(q: torch.Tensor, kv_cache: torch.Tensor, layer: AttentionLayer) -> bool:
        """Whether the AMX tiles attend every query of this layer (batch-invariant, with AMX): bfloat16,
        no sliding window, attention chunk, soft cap or sinks, a bfloat16 cache, a head size they take. A property of
        the layer."""
        return (q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16 and layer.sliding_window is None
                and layer.attention_chunk is None and layer.logit_softcap is None and layer.sinks is None
                and prefill_attention_fits(head_dim=q.shape[-1]))

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, m: TorchRefMetadata) -> None:
        self.kernels.cache_write(kv_cache, k, None if key_only(kv_cache, k, v) else v, m.slots)

    def _decode_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, m: TorchRefMetadata,
                     layer: AttentionLayer) -> None:
        self.kernels.decode_attention(out, q, kv_cache, m.decode_token_index, m.decode_tables_i32,
                                      m.decode_lens, layer.scale, window=layer.sliding_window or 0,
                                      softcap=layer.logit_softcap or 0.0, sinks=layer.sinks,
                                      chunk=layer.attention_chunk or 0)

    def _prefill_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, m: TorchRefMetadata, layer: AttentionLayer) -> None:
        """All prefill chunks in one kernel call where it applies, else the reference's SDPA per chunk.
        The AMX kernel attends causally without a window: a windowed (or chunked) layer takes it only where no
        chunk's context is longer than the window (or the attention chunk: all within the first, where the two are
        the same attention). It has no score
        soft cap: a capped layer's chunks take the reference's."""
        assert isinstance(m, CpuPagedMetadata)
        windowless = all((layer.sliding_window is None or p.context_len <= layer.sliding_window)
                         and (layer.attention_chunk is None or p.context_len <= layer.attention_chunk)
                         for p in m.prefills)
        uncapped = layer.logit_softcap is None and layer.sinks is None  # (nor sinks: GPT-OSS's)
        if m.prefill_chunks is not None and q.dtype == torch.bfloat16 and windowless and uncapped and \
                not is_quantized(kv_cache) and \
                self.kernels.prefill_attention(out, q, kv_cache, m.prefill_chunks, m.prefill_tables, layer.scale):
            return
        super()._prefill_into(out, q, k, v, kv_cache, m, layer)
