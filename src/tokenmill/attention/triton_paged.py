"""The Triton paged-attention backend (CUDA; Triton's interpreter on CPU tensors in the tests).

Same cache layout as the reference backend, so the prefix cache, the second tier, swap and KV transfer
work unchanged; one-byte (int8 / fp8) caches too, in kv_quant.py's row layout (attention/triton_kv_rows.py
quantises rows as they are written and widens them in registers as they are read). Per layer: one kernel
writes the step's K/V by slot, one unified kernel attends every
query of a mixed batch (fresh prefills, prefix hits, decode, speculative rows, windows, attention chunks, GQA) over
the block tables (attention/triton_kernels.py). Decode-only steps with few sequences and long contexts split
each sequence's keys over several programs when batch invariance is off.

Per step the host packs the metadata (query starts, context lengths, block tables, slots) into one
reused pinned buffer and copies it to the device once, non-blocking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from triton import next_power_of_2

from tokenmill.attention.base import AttentionBackend, AttentionLayer, SequenceChunk, key_only
from tokenmill.attention.host_copies import PinnedCopies
from tokenmill.attention.kv_quant import SCALE_BYTES
from tokenmill.attention.torch_ref import padded_block_tables
from tokenmill.attention.triton_kernels import (INTERPRETED, kv_write_kernel, merge_splits_kernel,
                                                split_decode_kernel, unified_attention_kernel)
from tokenmill.attention.triton_kv_rows import (FLOAT_ROWS, check_cache_rows, check_row_layout, kv_rows_code,
                                                write_kv_rows)

logger = logging.getLogger(__name__)

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs K >= 16; 256 keeps a tile within shared memory
TILE = 32  # keys per inner tile: fixed, so every query reduces over the same tiles (batch invariance)
SPLIT_MIN_TILES = 8  # a decode step splits a sequence's keys only past this many tiles
# without batch invariance, a step with a chunk of at least WIDE_FROM queries runs programs of WIDE_ROWS
# rows over tiles of WIDE_TILE keys: K/V tiles are read by 4x the queries (prefill-bound steps); head_dim
# up to 128, so that the q, k and v tiles stay well within shared memory
WIDE_FROM, WIDE_ROWS, WIDE_TILE = 32, 64, 64


def check_head_dim(head_dim: int) -> None:
    """ValueError unless the Triton kernels take `head_dim`."""
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"attention backend triton_paged takes head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, "
                         f"not {head_dim}; use torch_ref")


def check_cache(head_dim: int, quantized: Optional[str], planes: int) -> None:
    """ValueError unless the Triton kernels read a cache of `head_dim` with `planes` planes holding the
    compute dtype (`quantized` None) or one-byte rows ("int8", "fp8"), naming what they do not take: the
    exact check at start, where kv_cache_shape sees only a row's width."""
    check_head_dim(head_dim)
    if quantized:
        check_row_layout(head_dim, planes)


def query_tiling(queries_per_kv: int, rows: int = 16) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): a program's rows (at least `rows`; 16 is tl.dot's minimum) and the queries of
    one sequence they hold (BLOCK_M // queries_per_kv, each with its group of query heads)."""
    block_m = rows if queries_per_kv <= rows else next_power_of_2(queries_per_kv)
    return block_m, block_m // queries_per_kv


@dataclass
class TritonMetadata:
    """One step's device-side metadata (int32): [B + 1] query starts, [B] context lengths,
    [B, W] block tables, [T] slots (-1: a padding row that writes nothing); plus host-side counts."""

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    graph_splits: Optional[int] = None  # a captured graph's split count, fixed for its bucket (see _splits)


def host_metadata(chunks: list[SequenceChunk], block_size: int, width: Optional[int] = None,
                  tables: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query starts [B + 1], context lengths [B], block tables [B, width]) as int32 arrays, built per
    sequence (no per-token work); `width` defaults to the widest table the step reads. The tables are
    `tables` (the step's rows of the input batch, [B, any width]) when given, else gathered from the chunks'
    own; either way each row holds block 0 past its context."""
    lens = np.fromiter((c.context_len for c in chunks), dtype=np.int32, count=len(chunks))
    starts = np.empty(len(chunks) + 1, dtype=np.int32)
    starts[:-1] = [c.query_start for c in chunks]
    starts[-1] = chunks[-1].query_start + chunks[-1].query_len if chunks else 0
    used = -(-lens // block_size)
    if width is None:
        width = max(int(used.max(initial=1)), 1)
    if tables is None:
        return starts, lens, padded_block_tables(chunks, block_size, torch.int32, width).numpy()
    fitted = tables[:, :width]
    if fitted.shape[1] < width:
        fitted = np.pad(fitted, ((0, 0), (0, width - fitted.shape[1])))
    return starts, lens, np.where(np.arange(width) < used[:, None], fitted, 0).astype(np.int32, copy=False)


def upload_parts(copies: PinnedCopies, parts: list[np.ndarray]) -> list[torch.Tensor]:
    """The int32 arrays `parts` on the device in one copy (`PinnedCopies`), as views of one buffer."""
    flat = np.concatenate([np.ascontiguousarray(p, dtype=np.int32).reshape(-1) for p in parts])
    buffer = copies.upload(flat)
    views, offset = [], 0
    for p in parts:
        views.append(buffer[offset:offset + p.size].view(p.shape))
        offset += p.size
    return views


class TritonPagedBackend(AttentionBackend):
    """Paged attention in Triton kernels; `batch_invariant` keeps every query on the unified kernel (the
    split-KV decode reduces in another order)."""

    on_triton = True

    def __init__(self, batch_invariant: bool = True, device: torch.device = torch.device("cuda")) -> None:
        self.batch_invariant = batch_invariant
        self.staging = PinnedCopies(device)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       planes: int = 2) -> tuple[int, ...]:
        """[planes, blocks, kv heads, block_size, head_dim], the reference backend's layout (`head_dim` is a
        one-byte cache's row width, head_dim + 4: either is taken here; `check_cache` is exact)."""
        if not MIN_HEAD_DIM <= head_dim - SCALE_BYTES <= MAX_HEAD_DIM:
            check_head_dim(head_dim)
        if planes not in (1, 2):
            raise ValueError(f"a KV cache has 1 (key-only) or 2 planes, not {planes}")
        return (planes, num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(self, chunks: list[SequenceChunk], slot_mapping: torch.Tensor,
                       block_size: int, device: torch.device, tables: Optional[np.ndarray] = None) -> TritonMetadata:
        """The step's metadata on the device in one copy (query_by_query needs nothing: every query
        already attends as a decode at its position would)."""
        starts, lens, tables = host_metadata(chunks, block_size, tables=tables)
        slots = slot_mapping.cpu().numpy()
        query_start, seq_lens, block_tables, slot_dev = upload_parts(self.staging, [starts, lens, tables, slots])
        return TritonMetadata(query_start, seq_lens, block_tables, slot_dev, len(chunks), int(starts[-1]),
                              max((c.query_len for c in chunks), default=0), int(lens.max(initial=0)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonMetadata, layer: AttentionLayer) -> torch.Tensor:
        """Write K/V by slot, then attend (see AttentionBackend.forward)."""
        rows = kv_rows_code(kv_cache)
        if q.dtype not in TRITON_DTYPES or (rows == FLOAT_ROWS.value and kv_cache.dtype != q.dtype):
            raise ValueError(f"attention backend triton_paged takes float32, float16 or bfloat16 queries and a "
                             f"cache of their dtype or one-byte (int8, fp8) rows, not {q.dtype} and {kv_cache.dtype}")
        if rows == FLOAT_ROWS.value:
            write_kv(k, v if not key_only(kv_cache, k, v) else None, kv_cache, metadata.slot_mapping)
        else:
            check_cache_rows(kv_cache, q.shape[2])
            write_kv_rows(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        splits = self._splits(metadata, kv_cache.shape[2])
        if splits > 1:
            split_decode(out, q, kv_cache, metadata, layer, splits, rows)
        else:
            wide = not self.batch_invariant and metadata.max_query_len >= WIDE_FROM and q.shape[2] <= 128
            unified_attention(out, q, kv_cache, metadata, layer, wide, rows)
        return out

    def _splits(self, m: TritonMetadata, num_kv_heads: int) -> int:
        """How many programs share each sequence's keys: 1 (the unified kernel) for batch-invariant
        steps and steps with prefill; for decode-only steps, enough to give ~SPLIT_PROGRAMS (a captured
        graph's own count, which cannot follow each replay's lengths; short contexts leave splits empty)."""
        if self.batch_invariant or m.max_query_len != 1 or m.num_tokens != m.num_seqs:
            return 1
        if m.graph_splits is not None:
            return m.graph_splits
        tiles = -(-m.max_seq_len // TILE)
        if tiles < SPLIT_MIN_TILES:
            return 1
        return min(decode_splits(m.num_seqs, num_kv_heads), next_power_of_2(tiles) // 2 or 1)


SPLIT_PROGRAMS = 1024  # a decode step's programs wanted: a program walks its tiles one after another, so
# 512 programs of 19 tiles each (batch 64, 8 kv heads, 600 keys) ran at under half an H200's bandwidth


def decode_splits(num_seqs: int, num_kv_heads: int) -> int:
    """Splits of each sequence's keys that give a decode-only step ~SPLIT_PROGRAMS programs (at most 16)."""
    wanted = max(1, SPLIT_PROGRAMS // max(num_seqs * num_kv_heads, 1))
    return min(next_power_of_2(wanted), 16)


def _precision(dtype: torch.dtype) -> tuple[bool, bool]:
    """(UPCAST, IEEE): the interpreter computes 16-bit floats wrongly, so they are upcast after loading
    there; float32 products are exact (no TF32), as the HF float32 comparisons need."""
    upcast = INTERPRETED and dtype != torch.float32
    return upcast, dtype == torch.float32 or upcast


def write_kv(k: torch.Tensor, v: Optional[torch.Tensor], kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k [T, KVH, D] (and v) at `slots` of `kv_cache` (v None: a key-only cache)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or (v is not None and v.stride(2) != 1):
        raise ValueError("write_kv needs contiguous head dimensions")
    vv = k if v is None else v
    kv_write_kernel[(num_tokens, num_kv_heads)](
        k, vv, kv_cache, slots, k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[3], HEAD_DIM=head_dim, HEAD_DIM_P=next_power_of_2(head_dim), WRITE_V=v is not None)


def _sinks(layer: AttentionLayer, q: torch.Tensor) -> torch.Tensor:
    """The layer's attention sinks (float32 [heads]) for the kernels, or q as a pointer never read (USE_SINKS
    off)."""
    return q if layer.sinks is None else layer.sinks


def _layer_args(layer: AttentionLayer) -> tuple[float, int, bool, bool]:
    softcap = layer.logit_softcap or 0.0
    window = layer.sliding_window or 0
    return softcap, window, layer.sliding_window is not None, layer.logit_softcap is not None


def unified_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, m: TritonMetadata,
                      layer: AttentionLayer, wide: bool = False, rows: int = 0) -> None:
    """Every query of the step, causally over its sequence's blocks, into `out` [T, H, D]; `wide`: the
    prefill tiling (WIDE_ROWS, WIDE_TILE), whose sums over keys are grouped differently; `rows`: the
    cache's rows (`kv_rows_code`)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    block_m, block_q = query_tiling(queries_per_kv, WIDE_ROWS if wide else 16)
    softcap, window, use_window, use_softcap = _layer_args(layer)
    upcast, ieee = _precision(q.dtype)
    grid = (m.num_tokens // block_q + m.num_seqs, num_kv_heads)
    unified_attention_kernel[grid](
        out, q, kv_cache, m.block_tables, m.seq_lens, m.query_start, _sinks(layer, q), m.num_seqs, layer.scale,
        softcap, window, layer.attention_chunk or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), m.block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        V_PLANE=kv_cache.shape[0] - 1, QUERIES_PER_KV=queries_per_kv, BLOCK_Q=block_q, BLOCK_M=block_m,
        TILE=WIDE_TILE if wide else TILE, BLOCK_SIZE=kv_cache.shape[3], HEAD_DIM=head_dim,
        HEAD_DIM_P=next_power_of_2(head_dim), USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, UPCAST=upcast,
        IEEE=ieee, KV_ROWS=rows, USE_SINKS=layer.sinks is not None, USE_CHUNK=layer.attention_chunk is not None)


def split_decode(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, m: TritonMetadata,
                 layer: AttentionLayer, splits: int, rows: int = 0) -> None:
    """A decode-only step (token i is sequence i's query) with each sequence's key tiles shared by
    `splits` programs (each sequence's tiles divided evenly, in the kernel), then merged; `rows`: the
    cache's rows (`kv_rows_code`)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    head_dim_p = next_power_of_2(head_dim)
    softcap, window, use_window, use_softcap = _layer_args(layer)
    upcast, ieee = _precision(q.dtype)
    partial = torch.empty(num_seqs, num_heads, splits, head_dim_p, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    split_decode_kernel[(num_seqs, num_kv_heads, splits)](
        partial, lse, q, kv_cache, m.block_tables, m.seq_lens, layer.scale, softcap, window,
        layer.attention_chunk or 0,
        q.stride(0), q.stride(1), m.block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, NUM_SPLITS=splits, V_PLANE=kv_cache.shape[0] - 1, QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=max(16, next_power_of_2(queries_per_kv)), TILE=TILE, BLOCK_SIZE=kv_cache.shape[3], HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, UPCAST=upcast, IEEE=ieee,
        KV_ROWS=rows, USE_CHUNK=layer.attention_chunk is not None)
    merge_splits_kernel[(num_seqs, num_heads)](
        out, partial, lse, _sinks(layer, q), out.stride(0), out.stride(1), NUM_HEADS=num_heads, NUM_SPLITS=splits,
        SPLITS_P=max(2, next_power_of_2(splits)), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        USE_SINKS=layer.sinks is not None)
