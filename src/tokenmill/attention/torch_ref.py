"""The reference paged-attention backend: gather through block tables + scaled_dot_product_attention.

Runs anywhere PyTorch does and is the oracle faster backends are tested against.

Cache layout per layer: [2 (k, v), num_blocks, kv_heads, block_size, head_dim] (int8 / fp8 caches: rows of
head_dim + 4 bytes, keys transposed within a block, attention/kv_quant.py; dequantised as they are
gathered). One (block, kv head)
pair is a contiguous [block_size, head_dim] tile, so a sequence's context for one head is gathered
tile by tile — whole-tile copies — straight into [kv_heads, blocks * block_size, head_dim], the layout
attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, AttentionLayer, SequenceChunk, key_only
from tokenmill.attention.kv_quant import (dequantize_key_tiles, dequantize_rows, is_quantized, quantize_rows, row_format,
                                         write_tokens)


@dataclass
class _Prefill:
    query_start: int
    query_len: int
    context_len: int
    block_table: Optional[torch.Tensor]  # [blocks]; None when the chunk starts at position 0
    device: torch.device
    _masks: dict[tuple[Optional[int], Optional[int]], Optional[torch.Tensor]] = field(default_factory=dict)

    def mask(self, window: Optional[int], chunk: Optional[int] = None) -> Optional[torch.Tensor]:
        """[query_len, context_len], True = may attend: causal, within `window` keys of the query when given,
        and within the query's own `chunk` of positions when given (keys from (p // chunk) * chunk); None where
        plain causal attention is exact (a chunk from position 0 that no window or attention chunk cuts). Built
        on first use per (window, chunk) and kept for the step's other layers: a backend whose kernel takes the
        chunk never builds it."""
        start = self.context_len - self.query_len
        if start == 0 and (window is None or window >= self.context_len) and \
                (chunk is None or chunk >= self.context_len):
            return None
        if (window, chunk) not in self._masks:
            queries = torch.arange(start, self.context_len, device=self.device)[:, None]
            keys = torch.arange(self.context_len, device=self.device)[None, :]
            allowed = keys <= queries
            if window is not None:
                allowed &= keys > queries - window
            if chunk is not None:
                allowed &= keys >= queries // chunk * chunk
            self._masks[(window, chunk)] = allowed
        return self._masks[(window, chunk)]


@dataclass
class TorchRefMetadata:
    """Per-step indices: decode tokens are batched into one padded SDPA call, prefill chunks each get one."""

    block_ids: Optional[torch.Tensor]  # [T] block of each new token (None where the writes use slots)
    offsets: Optional[torch.Tensor]  # [T] position of each new token inside its block
    prefills: list[_Prefill]
    decode_token_index: Optional[torch.Tensor] = None  # [B]
    decode_tables: Optional[torch.Tensor] = None  # [B, max_blocks], padded with block 0
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, max_blocks * block_size]
    decode_lens: Optional[torch.Tensor] = None  # [B] context lengths (int64), for windowed masks
    _windowed_decode_masks: dict[tuple[Optional[int], Optional[int]], torch.Tensor] = field(default_factory=dict)

    def decode_mask_for(self, window: Optional[int], chunk: Optional[int] = None) -> torch.Tensor:
        """The decode mask of a layer with `window` and attention `chunk` (keys within the window, and from the
        start of the query's chunk, of each query only)."""
        if window is None and chunk is None:
            return self.decode_mask
        if (window, chunk) not in self._windowed_decode_masks:
            keys = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            first = torch.zeros_like(self.decode_lens)
            if window is not None:
                first = torch.maximum(first, self.decode_lens - window)
            if chunk is not None:  # the query sits at position decode_lens - 1
                first = torch.maximum(first, (self.decode_lens - 1) // chunk * chunk)
            recent = keys[None, :] >= first[:, None]
            self._windowed_decode_masks[(window, chunk)] = self.decode_mask & recent[:, None, None, :]
        return self._windowed_decode_masks[(window, chunk)]


def is_decode(chunk: SequenceChunk) -> bool:
    """One new token with earlier context: attends through the cache alone (no causal block of its own)."""
    return chunk.query_len == 1 and chunk.context_len > 1


def split_decodes(chunks: list[SequenceChunk], every_query: bool = False) -> tuple[list[SequenceChunk], list[SequenceChunk]]:
    """(decode queries, prefill chunks): decode chunks, and every query of a `query_by_query` chunk as a
    one-query chunk of its own (its context ends at its position), in batch order; the rest are prefills.
    `every_query`: every query of every chunk becomes such a one-query chunk, and there are no prefills."""
    decodes, prefills = [], []
    for c in chunks:
        if is_decode(c):
            decodes.append(c)
        elif (c.query_by_query and c.context_len > c.query_len) or every_query:
            first_context = c.context_len - c.query_len + 1
            decodes.extend(SequenceChunk(c.query_start + i, 1, first_context + i, c.block_ids)
                           for i in range(c.query_len))
        else:
            prefills.append(c)
    return decodes, prefills


def padded_block_tables(chunks: list[SequenceChunk], block_size: int, dtype: torch.dtype,
                        width: Optional[int] = None) -> torch.Tensor:
    """[B, width] block tables of the chunks' sequences, each row padded with block 0 past its context;
    `width` (at least the widest table) defaults to the widest. Each distinct block list is converted
    once, however many rows share it (a batch-invariant prefill makes a row of every query of a chunk,
    `split_decodes`); the rows are then gathered from it in one go."""
    used = [-(-c.context_len // block_size) for c in chunks]
    width = max(used) if width is None else width
    parts: list[np.ndarray] = []
    starts: list[int] = []
    last, start, offset = None, 0, 0
    for c in chunks:
        if c.block_ids is not last:
            last = c.block_ids
            start = offset
            parts.append(np.asarray(c.block_ids[:width], dtype=np.int64))
            offset += len(parts[-1])
        starts.append(start)
    # a row reads `width` entries from its start: past its own list's end they are masked (and the next
    # list's, or the zero tail's, so always in bounds)
    values = np.concatenate(parts + [np.zeros(width, dtype=np.int64)])
    columns = np.arange(width)
    rows = values[np.asarray(starts, dtype=np.int64)[:, None] + columns]
    return torch.from_numpy(np.where(columns < np.asarray(used, dtype=np.int64)[:, None], rows, 0)).to(dtype)


def _tiles(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Gather [..., blocks] block tables into [..., kv_heads, blocks * block_size, head_dim]."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    heads = torch.arange(num_kv_heads, device=tables.device)
    rows = tables.unsqueeze(-2) * num_kv_heads + heads.unsqueeze(-1)  # [..., KVH, blocks]
    tiles = cache.view(num_blocks * num_kv_heads, block_size * head_dim).index_select(0, rows.reshape(-1))
    return tiles.view(*rows.shape[:-1], rows.shape[-1] * block_size, head_dim)


def _keys(kv_cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keys of [..., blocks] block tables as attention reads them: [..., kv_heads, blocks * block_size,
    head_dim], dequantised from a one-byte cache's transposed key tiles (attention/kv_quant.py)."""
    if not is_quantized(kv_cache):
        return _tiles(kv_cache[0], tables)
    num_blocks, num_kv_heads, block_size, width = kv_cache[0].shape
    heads = torch.arange(num_kv_heads, device=tables.device)
    rows = tables.unsqueeze(-2) * num_kv_heads + heads.unsqueeze(-1)  # [..., KVH, blocks]
    tiles = kv_cache[0].view(num_blocks * num_kv_heads, block_size * width).index_select(0, rows.reshape(-1))
    keys = dequantize_key_tiles(tiles.view(*rows.shape, block_size * width), block_size, dtype)
    return keys.flatten(-3, -2)


def _values(kv_cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of [..., blocks] block tables, [..., kv_heads, blocks * block_size, head_dim]."""
    tiles = _tiles(kv_cache[-1], tables)
    return dequantize_rows(tiles, dtype) if is_quantized(kv_cache) else tiles


def _as_cached(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """New K or V rows as the cache holds them (quantised and back for a one-byte cache), so a chunk attends
    to its own tokens exactly as later queries will."""
    return dequantize_rows(quantize_rows(x, row_format(kv_cache)), x.dtype) if is_quantized(kv_cache) else x


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              layer: AttentionLayer, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v: q [..., H, Q, D], k and v [..., KVH, L, D] (H a multiple of KVH), `mask`
    [..., Q, L] True where a query may attend, None for causal attention with Q == L. A layer with a score soft
    cap (Gemma 2) caps the scores, cap * tanh(scores / cap), before the mask and softmax, as transformers'
    eager attention does (float32 softmax). `sinks` (GPT-OSS's attention sinks, float32, shaped to broadcast
    against the scores' [..., H, Q, 1]): one more logit per row that joins the softmax and is then dropped, as
    transformers' eager GPT-OSS attention does. SDPA, which has neither, attends the others."""
    if layer.logit_softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                              enable_gqa=True)
    if mask is None:  # causal with Q == L
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scale
    cap = layer.logit_softcap
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


def prefill_entries(prefills: list[SequenceChunk], block_size: int, device: torch.device) -> list[_Prefill]:
    """What SDPA needs per prefill chunk: nothing more for a chunk starting at position 0 (its own K/V,
    causal), else its block table (and a mask, built when first used)."""
    entries = []
    for c in prefills:
        fresh = c.context_len == c.query_len
        table = None if fresh else torch.tensor(np.asarray(c.block_ids[:-(-c.context_len // block_size)],
                                                           dtype=np.int64), device=device)
        entries.append(_Prefill(c.query_start, c.query_len, c.context_len, table, device))
    return entries


class TorchReferenceBackend(AttentionBackend):
    """Exact, simple, and the test oracle."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       planes: int = 2) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: [planes, blocks, kv heads, block_size, head_dim], keys in
        plane 0 and values in the last plane (the same plane when the cache is key-only)."""
        if planes not in (1, 2):
            raise ValueError(f"a KV cache has 1 (key-only) or 2 planes, not {planes}")
        return (planes, num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(self, chunks: list[SequenceChunk], slot_mapping: torch.Tensor,
                       block_size: int, device: torch.device, tables: Optional[np.ndarray] = None) -> TorchRefMetadata:
        """Split chunks into decode (one query) and prefill groups and precompute their gather indices."""
        slot_mapping = slot_mapping.to(device)
        decodes, prefill_chunks = split_decodes(chunks)
        prefills = prefill_entries(prefill_chunks, block_size, device)
        meta = TorchRefMetadata(slot_mapping // block_size, slot_mapping % block_size, prefills)
        if decodes:
            tables = padded_block_tables(decodes, block_size, torch.long)
            lengths = torch.tensor([c.context_len for c in decodes])
            mask = torch.arange(tables.shape[1] * block_size)[None, :] < lengths[:, None]
            meta.decode_token_index = torch.tensor([c.query_start for c in decodes], device=device)
            meta.decode_tables = tables.to(device)
            meta.decode_mask = mask[:, None, None, :].to(device)
            meta.decode_lens = lengths.to(device)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchRefMetadata, layer: AttentionLayer) -> torch.Tensor:
        """Write K/V, then attend (see AttentionBackend.forward)."""
        m = metadata
        self._write(k, v, kv_cache, m)
        out = q.new_empty(q.shape)
        if m.decode_token_index is not None:
            self._decode_into(out, q, kv_cache, m, layer)
        if m.prefills:
            self._prefill_into(out, q, k, v, kv_cache, m, layer)
        return out

    @staticmethod
    def _prefill_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, m: TorchRefMetadata, layer: AttentionLayer) -> None:
        """Each prefill chunk's causal (windowed, chunked) attention, one SDPA call per chunk, into its rows of out."""
        for p in m.prefills:
            rows = slice(p.query_start, p.query_start + p.query_len)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            if p.block_table is None:
                kp = _as_cached(k[rows], kv_cache).transpose(0, 1).unsqueeze(0)  # [1, KVH, Q, D]
                vp = _as_cached(v[rows], kv_cache).transpose(0, 1).unsqueeze(0)
            else:
                kp = _keys(kv_cache, p.block_table, q.dtype)[:, :p.context_len].unsqueeze(0)
                vp = _values(kv_cache, p.block_table, q.dtype)[:, :p.context_len].unsqueeze(0)
            sinks = None if layer.sinks is None else layer.sinks.view(-1, 1, 1)  # per query head
            op = attention(qp, kp, vp, p.mask(layer.sliding_window, layer.attention_chunk), layer, sinks)
            out[rows] = op.squeeze(0).transpose(0, 1)

    @staticmethod
    def _write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, m: TorchRefMetadata) -> None:
        if is_quantized(kv_cache):
            write_tokens(kv_cache, m.block_ids, m.offsets, k, v)
            return
        kv_cache[0][m.block_ids, :, m.offsets] = k
        if not key_only(kv_cache, k, v):
            kv_cache[1][m.block_ids, :, m.offsets] = v

    def _decode_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, m: TorchRefMetadata,
                     layer: AttentionLayer) -> None:
        out[m.decode_token_index] = self._decode(q[m.decode_token_index], kv_cache, m, layer)

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, m: TorchRefMetadata, layer: AttentionLayer) -> torch.Tensor:
        """One query per sequence. The G query heads sharing a kv head become G query rows of one
        attention call, so K/V are gathered once and never repeated per query head."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[2]
        k = _keys(kv_cache, m.decode_tables, q.dtype)  # [B, KVH, L, D]
        v = k if kv_cache.shape[0] == 1 else _values(kv_cache, m.decode_tables, q.dtype)
        grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        sinks = None if layer.sinks is None else layer.sinks.view(num_kv_heads, -1, 1)  # [KVH, G, 1], as grouped
        out = attention(grouped, k, v, m.decode_mask_for(layer.sliding_window, layer.attention_chunk), layer, sinks)
        return out.reshape(batch, num_heads, head_dim)
