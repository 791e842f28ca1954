"""The one-byte KV caches (--kv-cache-dtype int8 / fp8): per token and head, head_dim one-byte values and one
float32 scale, so a row is quantised alone and what the cache holds for a token does not depend on the
batch it was computed in.

- int8 (an int8 cache tensor): symmetric, scale = max |x| / 127, value = round(x / scale);
- fp8 (a uint8 cache tensor holding float8 e4m3 bits): scale = max |x| / 448 (e4m3's largest finite
  value), value = x / scale rounded to the nearest e4m3 (ties to even), so every row uses e4m3's whole
  range: the scales vLLM's --calculate-kv-scales computes per tensor, here per token and head.

A layer's cache tensor is [planes, blocks, kv_heads, block_size, head_dim + 4] bytes: each (plane, block,
kv head) tile is block_size x (head_dim + 4) bytes, and a block is still one slice along dimension 1 (the
second tier, swapping and transfers copy it whole, scales included). Inside a tile:
- values (the last plane): block_size rows, each head_dim values then the row's float32 scale;
- keys (plane 0): transposed, the head_dim x block_size values first (dimension-major: the block's
  keys for one dimension are adjacent, so a query's scores run over the keys in vector lanes,
  kernels/decode_attention_q8.c), then the block_size float32 scales.
"""

from __future__ import annotations

import torch

from tokenmill.core.kv_spec import QUANTIZED_SCALE_BYTES

SCALE_BYTES = QUANTIZED_SCALE_BYTES  # a float32 scale per token and head
STORAGE = {"int8": torch.int8, "fp8": torch.uint8}  # the cache tensor's dtype of each row format
_LARGEST = {"int8": 127.0, "fp8": 448.0}


def row_width(head_dim: int) -> int:
    """The last dimension of a one-byte cache tensor: head_dim values and a scale's bytes."""
    return head_dim + SCALE_BYTES


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether a layer's cache holds one-byte (int8 or fp8) tiles."""
    return kv_cache.dtype in (torch.int8, torch.uint8)


def row_format(kv_cache: torch.Tensor) -> str:
    """"int8" or "fp8": the row format of a one-byte cache (or of its rows), by its dtype."""
    return "int8" if kv_cache.dtype == torch.int8 else "fp8"


def quantize(x: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float -> (values [..., head_dim] as `fmt` stores them: int8, or e4m3 bits as uint8;
    float32 scales [...])."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / _LARGEST[fmt]
    values = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
    if fmt == "fp8":  # |values| <= 448 up to a rounding of the division: clamped, never NaN
        return values.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8), scale.squeeze(-1)
    return values.round().clamp_(-127, 127).to(torch.int8), scale.squeeze(-1)


def widen(values: torch.Tensor) -> torch.Tensor:
    """One-byte values (int8, or e4m3 bits as uint8) as float32."""
    return values.float() if values.dtype == torch.int8 else values.view(torch.float8_e4m3fn).float()


def quantize_rows(x: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """[..., head_dim] float -> value rows [..., head_dim + 4] of `fmt`'s storage dtype (values, then the
    scale's bytes)."""
    values, scale = quantize(x, fmt)
    return torch.cat([values, scale.unsqueeze(-1).contiguous().view(values.dtype)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Value rows [..., head_dim + 4] (int8 or fp8) -> [..., head_dim] of `dtype` (value x scale, in float32
    first)."""
    values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (widen(values) * scale).to(dtype)


def write_tokens(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """Quantise k, v [T, kv_heads, head_dim] and store token i at (blocks[i], offsets[i]) of both planes."""
    planes, num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    assert planes == 2, "a one-byte cache has a key plane and a value plane (key-only MLA caches are refused)"
    head_dim, fmt = width - SCALE_BYTES, row_format(kv_cache)
    kv_cache[-1][blocks, :, offsets] = quantize_rows(v, fmt)
    values, scales = quantize(k, fmt)  # [T, H, D], [T, H]
    tiles = kv_cache[0].view(num_blocks, num_kv_heads, block_size * width)
    heads = torch.arange(num_kv_heads, device=k.device)[None, :, None]
    at_block = blocks[:, None, None]
    value_index = (torch.arange(head_dim, device=k.device) * block_size)[None, :] + offsets[:, None]  # [T, D]
    tiles[at_block, heads, value_index[:, None, :]] = values
    scale_index = (head_dim * block_size + SCALE_BYTES * offsets)[:, None] + torch.arange(SCALE_BYTES, device=k.device)
    tiles[at_block, heads, scale_index[:, None, :]] = scales.contiguous().view(kv_cache.dtype).view(*scales.shape, 4)


def dequantize_key_tiles(tiles: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Key tiles [..., block_size * (head_dim + 4)] (int8 or fp8) -> keys [..., block_size, head_dim] of `dtype`."""
    head_dim = tiles.shape[-1] // block_size - SCALE_BYTES
    values = tiles[..., :head_dim * block_size].unflatten(-1, (head_dim, block_size)).transpose(-1, -2)
    scales = tiles[..., head_dim * block_size:].contiguous().view(torch.float32)  # [..., block_size]
    return (widen(values) * scales.unsqueeze(-1)).to(dtype)
