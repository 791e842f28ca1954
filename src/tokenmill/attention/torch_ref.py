"""The reference paged-attention backend: gather through block tables + scaled_dot_product_attention.

Runs anywhere PyTorch does and is the oracle faster backends are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, SequenceChunk


@dataclass
class _Prefill:
    query_start: int
    query_len: int
    context_slots: Optional[torch.Tensor]  # None when the chunk starts at position 0
    mask: Optional[torch.Tensor]  # [query_len, context_len], True = may attend


@dataclass
class TorchRefMetadata:
    """Per-step indices: decode tokens are batched into one padded SDPA call, prefill chunks each get one."""

    slot_mapping: torch.Tensor  # [T]
    decode_token_index: Optional[torch.Tensor]  # [B]
    decode_slots: Optional[torch.Tensor]  # [B, Lmax], padded with slot 0
    decode_mask: Optional[torch.Tensor]  # [B, 1, 1, Lmax]
    prefills: list[_Prefill]


def context_slots(block_ids: list[int], context_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots of positions [0, context_len) of a sequence with block table `block_ids`."""
    positions = torch.arange(context_len, device=device)
    table = torch.tensor(block_ids, dtype=torch.long, device=device)
    return table[positions // block_size] * block_size + positions % block_size


class TorchReferenceBackend(AttentionBackend):
    """Exact, simple, and the test oracle."""

    def build_metadata(self, chunks: list[SequenceChunk], slot_mapping: torch.Tensor,
                       block_size: int, device: torch.device) -> TorchRefMetadata:
        """Split chunks into decode (one query) and prefill groups and precompute their gather indices."""
        decodes = [c for c in chunks if c.query_len == 1]
        prefills = []
        for c in chunks:
            if c.query_len == 1:
                continue
            start = c.context_len - c.query_len
            if start == 0:
                prefills.append(_Prefill(c.query_start, c.query_len, None, None))
                continue
            mask = torch.ones(c.query_len, c.context_len, dtype=torch.bool, device=device).tril(start)
            prefills.append(_Prefill(c.query_start, c.query_len,
                                     context_slots(c.block_ids, c.context_len, block_size, device), mask))
        if not decodes:
            return TorchRefMetadata(slot_mapping, None, None, None, prefills)
        max_len = max(c.context_len for c in decodes)
        slots = torch.zeros(len(decodes), max_len, dtype=torch.long, device=device)
        for row, c in enumerate(decodes):
            slots[row, :c.context_len] = context_slots(c.block_ids, c.context_len, block_size, device)
        lengths = torch.tensor([c.context_len for c in decodes], device=device)
        mask = (torch.arange(max_len, device=device)[None, :] < lengths[:, None])[:, None, None, :]
        index = torch.tensor([c.query_start for c in decodes], dtype=torch.long, device=device)
        return TorchRefMetadata(slot_mapping, index, slots, mask, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchRefMetadata) -> torch.Tensor:
        """Write K/V, then attend (see AttentionBackend.forward)."""
        m = metadata
        kv_cache[0].index_copy_(0, m.slot_mapping, k)
        kv_cache[1].index_copy_(0, m.slot_mapping, v)
        out = torch.empty_like(q)
        if m.decode_token_index is not None:
            qd = q[m.decode_token_index].unsqueeze(2)  # [B, H, 1, D]
            kd = kv_cache[0][m.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
            vd = kv_cache[1][m.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m.decode_mask, enable_gqa=True)
            out[m.decode_token_index] = od.squeeze(2)
        for p in m.prefills:
            rows = slice(p.query_start, p.query_start + p.query_len)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            if p.context_slots is None:
                kp, vp = k[rows], v[rows]
            else:
                kp, vp = kv_cache[0][p.context_slots], kv_cache[1][p.context_slots]
            kp = kp.transpose(0, 1).unsqueeze(0)
            vp = vp.transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask,
                                                is_causal=p.mask is None, enable_gqa=True)
            out[rows] = op.squeeze(0).transpose(0, 1)
        return out
