"""Qwen2-VL's image side: a ViT over 14-pixel patches of the image at its own resolution, with 2-D rotary
embeddings, and a merger of 2x2 patches into one position of the decoder's width (HF's
Qwen2VisionTransformerPretrainedModel), for one image at a time."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.models.vision.config import Qwen2VLVisionConfig
from tokenmill.models.vision.vit import activation, load_named_weights


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by per-token angles, in float32 as HF does for the vision tower."""
    half = x.shape[-1] // 2
    y = x.float()
    return (y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        q, k, v = self.qkv(x).reshape(tokens, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, heads, tokens, head_dim]: the 4-D shape PyTorch's fused CPU attention takes (3-D runs the math path)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(width // self.heads))
        return self.proj(out[0].transpose(0, 1).reshape(tokens, width))


class _MLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        width = config.embed_dim
        self.norm1, self.norm2 = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
        self.attn = _Attention(width, config.num_heads)
        self.mlp = _MLP(width, int(width * config.mlp_ratio), config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
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
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
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
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x, self.config.embed_dim * self.config.spatial_merge_size ** 2)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint's `visual.…` tensors (named here without that prefix)."""
        load_named_weights(self, weights, self.config.architecture, "visual.")
