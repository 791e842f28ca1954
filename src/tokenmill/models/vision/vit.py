"""The vision transformers of LLaVA-style models, CLIP's and SigLIP's, with their checkpoint names.

Attention is bidirectional over one image's patches and holds no cache: each image is encoded alone, so its
embeddings never depend on what other images or requests share the step.
"""

from __future__ import annotations

import math
import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.models.vision.config import TowerConfig


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """HF's activation of that name (vision/config.py admits only these)."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh")  # gelu_pytorch_tanh, gelu_new


class _Attention(nn.Module):
    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        heads = self.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:  # [1, heads, tokens, head_dim]: the 4-D shape PyTorch's
            return t.view(tokens, heads, width // heads).transpose(0, 1).unsqueeze(0)  # fused CPU attention takes

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)),
                                             scale=1.0 / math.sqrt(width // heads))
        return self.out_proj(out[0].transpose(0, 1).reshape(tokens, width))


class MLP(nn.Module):
    """fc1, the activation, fc2: the MLP of CLIP's, SigLIP's and Qwen2-VL's blocks."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = _Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         config.patch_size, bias=not config.class_token)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size)) if config.class_token else None
        self.position_embedding = nn.Embedding(config.num_positions, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.unsqueeze(0))[0].flatten(1).transpose(0, 1)  # [patches, width]
        if self.class_embedding is not None:
            patches = torch.cat([self.class_embedding.unsqueeze(0), patches])
        return patches + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, config: TowerConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(num_layers))


class _VisionModel(nn.Module):
    def __init__(self, config: TowerConfig, num_layers: int) -> None:
        super().__init__()
        self.embeddings = _Embeddings(config)
        self.pre_layrnorm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                             if config.class_token else None)  # CLIP's spelling
        self.encoder = _Encoder(config, num_layers)


class VisionTower(nn.Module):
    """A CLIP or SigLIP vision transformer cut after the deepest layer a feature is read from (`num_layers`):
    its parameters are named as in the checkpoint, under `vision_model.`."""

    def __init__(self, config: TowerConfig, num_layers: int) -> None:
        super().__init__()
        self.config = config
        self.vision_model = _VisionModel(config, num_layers)

    def hidden_states(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """[channels, H, W] pixels of one image -> the hidden states [positions, width] after the embeddings
        and after each layer, as HF's `output_hidden_states` lists them."""
        model = self.vision_model
        x = model.embeddings(pixels.to(model.embeddings.patch_embedding.weight.dtype))
        if model.pre_layrnorm is not None:
            x = model.pre_layrnorm(x)
        states = [x]
        for layer in model.encoder.layers:
            x = layer(x)
            states.append(x)
        return states
