"""The int8 KV cache (--kv-cache-dtype int8): per token and head, head_dim int8 values and one float32 scale
(symmetric: scale = max |x| / 127, value = round(x / scale)), so a row is quantised alone and what the
cache holds for a token does not depend on the batch it was computed in.

A layer's cache tensor is int8 [planes, blocks, kv_heads, block_size, head_dim + 4]: each (plane, block,
kv head) tile is block_size x (head_dim + 4) bytes, and a block is still one slice along dimension 1 (the
second tier, swapping and transfers copy it whole, scales included). Inside a tile:
- values (the last plane): block_size rows, each head_dim int8 values then the row's float32 scale;
- keys (plane 0): transposed, the head_dim x block_size int8 values first (dimension-major: the block's
  keys for one dimension are adjacent, so a query's scores run over the keys in vector lanes,
  kernels/decode_attention_q8.c), then the block_size float32 scales.
"""

from __future__ import annotations

import torch

from tokenmill.core.kv_spec import QUANTIZED_SCALE_BYTES

SCALE_BYTES = QUANTIZED_SCALE_BYTES  # a float32 scale per token and head


def row_width(head_dim: int) -> int:
    """The last dimension of the int8 cache tensor: head_dim values and a scale's bytes."""
    return head_dim + SCALE_BYTES


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether a layer's cache holds int8 tiles."""
    return kv_cache.dtype == torch.int8


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float -> (int8 values [..., head_dim], float32 scales [...])."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    values = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
    return values.round().clamp_(-127, 127).to(torch.int8), scale.squeeze(-1)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> value rows [..., head_dim + 4] int8 (values, then the scale's bytes)."""
    values, scale = quantize(x)
    return torch.cat([values, scale.unsqueeze(-1).contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Value rows [..., head_dim + 4] int8 -> [..., head_dim] of `dtype` (value x scale, in float32 first)."""
    values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (values.float() * scale).to(dtype)


def write_tokens(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """Quantise k, v [T, kv_heads, head_dim] and store token i at (blocks[i], offsets[i]) of both planes."""
    planes, num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    assert planes == 2, "an int8 cache has a key plane and a value plane (key-only MLA caches are refused)"
    head_dim = width - SCALE_BYTES
    kv_cache[-1][blocks, :, offsets] = quantize_rows(v)
    values, scales = quantize(k)  # [T, H, D], [T, H]
    tiles = kv_cache[0].view(num_blocks, num_kv_heads, block_size * width)
    heads = torch.arange(num_kv_heads, device=k.device)[None, :, None]
    at_block = blocks[:, None, None]
    value_index = (torch.arange(head_dim, device=k.device) * block_size)[None, :] + offsets[:, None]  # [T, D]
    tiles[at_block, heads, value_index[:, None, :]] = values
    scale_index = (head_dim * block_size + SCALE_BYTES * offsets)[:, None] + torch.arange(SCALE_BYTES, device=k.device)
    tiles[at_block, heads, scale_index[:, None, :]] = scales.contiguous().view(torch.int8).view(*scales.shape, 4)


def dequantize_key_tiles(tiles: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Key tiles [..., block_size * (head_dim + 4)] int8 -> keys [..., block_size, head_dim] of `dtype`."""
    head_dim = tiles.shape[-1] // block_size - SCALE_BYTES
    values = tiles[..., :head_dim * block_size].unflatten(-1, (head_dim, block_size)).transpose(-1, -2)
    scales = tiles[..., head_dim * block_size:].contiguous().view(torch.float32)  # [..., block_size]
    return (values.float() * scales.unsqueeze(-1)).to(dtype)
