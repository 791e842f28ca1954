"""Qwen2-VL's and Qwen2.5-VL's image side: a ViT over 14-pixel patches of the image at its own resolution, with
2-D rotary embeddings, and a merger of 2x2 patches into one position of the decoder's width (HF's
Qwen2VisionTransformerPretrainedModel and Qwen2_5_VisionTransformerPretrainedModel), for one image at a time.

Qwen2.5-VL's blocks use RMSNorm and a SwiGLU MLP, and most attend within windows: the patches are reordered
window by window (each window a square of merge units), attention runs per window (windows of one length in
one batched call), and the merged outputs are put back in the image's order at the end."""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.models.vision.config import Qwen2VLVisionConfig
from tokenmill.models.named_weights import load_named_weights
from tokenmill.models.vision.vit import MLP, activation


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by per-token angles, in float32 as HF does for the vision tower."""
    half = x.shape[-1] // 2
    y = x.float()
    return (y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin).to(x.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            windows: Optional[list[int]]) -> torch.Tensor:
    """Attention of [tokens, heads, head_dim] q, k, v over all tokens, or within consecutive windows of
    these lengths (the windows of one length in one call), as [tokens, heads, head_dim]."""
    if windows is None:  # [1, heads, tokens, head_dim]: the 4-D shape PyTorch's fused CPU attention takes
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1)
    out = torch.empty_like(q)
    starts = [0]
    for length in windows[:-1]:
        starts.append(starts[-1] + length)
    for length in sorted(set(windows)):
        first = torch.tensor([s for s, n in zip(starts, windows) if n == length], device=q.device)
        rows = (first.unsqueeze(1) + torch.arange(length, device=q.device)).flatten()
        q_w, k_w, v_w = (t[rows].view(-1, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(q_w, k_w, v_w, scale=scale).transpose(1, 2).reshape(
            -1, *q.shape[1:])
    return out


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                windows: Optional[list[int]] = None) -> torch.Tensor:
        tokens, width = x.shape
        q, k, v = self.qkv(x).reshape(tokens, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = _attend(q, k, v, 1.0 / math.sqrt(width // self.heads), windows)
        return self.proj(out.reshape(tokens, width))


class _GatedMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.gate_proj, self.up_proj = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.down_proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))


class _RMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _norm(config: Qwen2VLVisionConfig, width: int) -> nn.Module:
    return _RMSNorm(width) if config.gated else nn.LayerNorm(width, eps=1e-6)


class _Block(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        width = config.embed_dim
        self.norm1, self.norm2 = _norm(config, width), _norm(config, width)
        self.attn = _Attention(width, config.num_heads)
        mlp = _GatedMLP if config.gated else MLP
        self.mlp = mlp(width, config.mlp_width, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                windows: Optional[list[int]] = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel, kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # the convolution's kernel is the whole patch: one product of each flattened patch with the flattened
        # kernels (oneDNN's bfloat16 Conv3d takes ~40x longer for the same sums)
        weight = self.proj.weight
        return F.linear(patches.view(-1, weight[0].numel()).to(weight.dtype), weight.view(weight.shape[0], -1))


class _Merger(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        merged = config.embed_dim * config.spatial_merge_size ** 2
        self.ln_q = _norm(config, config.embed_dim)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.text_hidden_size))

    def forward(self, x: torch.Tensor, merged_width: int) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, merged_width))


class Qwen2VLVision(nn.Module):
    """One image's patches (`pixel_values` [patches, C*T*P*P], `image_grid_thw` (t, h, w) in patches, in the
    processor's order: 2x2 merge groups row-major) -> its t*h*w/4 embeddings of the decoder's width."""

    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _Merger(config)
        rotary_dim = config.embed_dim // config.num_heads // 2
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float)
                                                             / rotary_dim)), persistent=False)

    def _angles(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t*h*w, head_dim] rotary angles: each patch's row then column frequencies, in the patches' order."""
        merge = self.config.spatial_merge_size

        def grid(values: torch.Tensor) -> torch.Tensor:
            return values.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()

        device = self.inv_freq.device
        rows = grid(torch.arange(h, device=device).unsqueeze(1).expand(-1, w))
        cols = grid(torch.arange(w, device=device).unsqueeze(0).expand(h, -1))
        table = torch.outer(torch.arange(max(h, w), device=device, dtype=torch.float), self.inv_freq)
        angles = torch.cat([table[rows], table[cols]], dim=-1).repeat(t, 1)
        return torch.cat([angles, angles], dim=-1)

    @torch.inference_mode()
    def encode(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The image's embeddings [t*h*w / merge^2, text hidden]."""
        t, h, w = (int(v) for v in inputs["image_grid_thw"].tolist())
        if t != 1:
            raise ValueError(f"an image is one frame; got a grid of {t} temporal patches (videos are not supported)")
        x = self.patch_embed(inputs["pixel_values"])
        angles = self._angles(t, h, w)
        order, windows = self._windows(h, w) if self.config.window_size else (None, None)
        if order is not None:  # window by window, in groups of one merge unit's patches
            unit = self.config.spatial_merge_size ** 2
            x = x.view(-1, unit, x.shape[-1])[order].view(x.shape)
            angles = angles.view(-1, unit, angles.shape[-1])[order].view(angles.shape)
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        for index, block in enumerate(self.blocks):
            whole = windows is None or index in self.config.fullatt_block_indexes
            x = block(x, cos, sin, None if whole else windows)
        merged = self.merger(x, self.config.embed_dim * self.config.spatial_merge_size ** 2)
        return merged if order is None else merged[torch.argsort(order)]

    def _windows(self, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows of one frame: the merge units' order, window by window (each window a square
        of units, row-major within it; windows row-major, those at the edges cut), and each window's length in
        patches."""
        merge = self.config.spatial_merge_size
        side = self.config.window_size // merge // self.config.patch_size  # merge units per window side
        rows, cols = h // merge, w // merge
        order, windows = [], []
        for top in range(0, rows, side):
            for left in range(0, cols, side):
                units = [r * cols + c for r in range(top, min(top + side, rows))
                         for c in range(left, min(left + side, cols))]
                order += units
                windows.append(len(units) * merge * merge)
        return torch.tensor(order, device=self.inv_freq.device), windows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint's `visual.…` tensors (named here without that prefix)."""
        load_named_weights(self, weights, self.config.architecture, "visual.")
