"""Rotary position embeddings (RoPE), the "rotate half" layout Hugging Face checkpoints use."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    `kind` is "llama3" (Llama 3.1 smooth wavelength scaling, with the factors below), "linear"
    (positions divided by `factor`), "yarn" (YaRN: frequencies interpolated by `factor` below a ramp
    between `beta_fast` and `beta_slow` rotations over the original context, kept above it; cos and
    sin times `attention_factor`), "longrope" (Phi-3's LongRoPE: frequency i divided by `short_factor[i]`, or
    by `long_factor[i]` when the table reaches past `original_max_position_embeddings`; cos and sin times
    `attention_factor`) or "factors" (explicit per-frequency divisors, as GGUF stores them in
    `rope_freqs.weight`; the divisors are loaded as a tensor, not kept here).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[RopeScaling], max_positions: int = 0) -> torch.Tensor:
    """Inverse frequencies 1 / base^(2i/d), with linear, Llama-3, YaRN or LongRoPE scaling applied (float32);
    `max_positions`: the positions the table serves (LongRoPE picks its factors by it)."""
    if scaling is not None and scaling.kind == "longrope":
        return _longrope_inv_freq(head_dim, base, scaling, max_positions)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.kind == "factors":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, base, scaling)
    raise ValueError(f"unsupported RoPE scaling {scaling.kind!r} (supported: linear, llama3, yarn, longrope)")


def uses_long_factors(scaling: RopeScaling, max_positions: int) -> bool:
    """Whether a LongRoPE table of `max_positions` positions takes the long factors: when it reaches past the
    original context. One choice for the whole table (llama.cpp's, by its context size), so a position turns alike
    in every sequence and step and the cached keys stay valid; transformers chooses per forward pass by the
    sequence's length instead, which gives the same rotations to every sequence when max_positions is within the
    original context, and to every sequence longer than it otherwise."""
    return max_positions > scaling.original_max_position_embeddings


def _longrope_inv_freq(head_dim: int, base: float, s: RopeScaling, max_positions: int) -> torch.Tensor:
    """LongRoPE (transformers' _compute_longrope_parameters): 1 / (factor_i * base^(2i/d))."""
    factors = s.long_factor if uses_long_factors(s, max_positions) else s.short_factor
    if len(factors) != head_dim // 2:
        raise ValueError(f"LongRoPE lists {len(factors)} factors for {head_dim // 2} rotary frequencies")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): frequency i is interpolated (divided by the factor)
    where it turns fewer than `beta_slow` times over the original context, kept where it turns more than
    `beta_fast` times, and blended linearly by dimension in between."""
    def dimension_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        original = s.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inv_freq / s.factor * (1 - kept) + inv_freq * kept


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's absolute position, from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: Optional[RopeScaling] = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.inv_freq = rope_inv_freq(head_dim, base, scaling, max_positions)
        scaled = scaling is not None and scaling.kind in ("yarn", "longrope")
        self.magnitude = scaling.attention_factor if scaled else 1.0
        if scaling is not None and scaling.kind == "longrope":
            logger.info("LongRoPE: %s factors for positions up to %d (original context %d)",
                        "long" if uses_long_factors(scaling, max_positions) else "short", max_positions,
                        scaling.original_max_position_embeddings)
        self._build_table()

    def _build_table(self) -> None:
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), self.inv_freq)
        self.cos, self.sin = cos_sin_rows(angles, self.magnitude)

    def set_frequency_divisors(self, divisors: torch.Tensor) -> None:
        """Divide the inverse frequencies by per-frequency factors (GGUF's rope_freqs) and rebuild."""
        self.inv_freq = self.inv_freq / divisors.float().reshape(-1)
        self._build_table()

    def to_device(self, device: torch.device) -> None:
        """Move the tables to `device`."""
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The [T, 1, head_dim] cos and sin of each token's position, looked up once per step for all layers."""
        return rows_at(self.cos, self.sin, positions, dtype)


def cos_sin_rows(angles: torch.Tensor, magnitude: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, head_dim] cos and sin tables of per-row angles [rows, head_dim / 2], in the rotate-half layout;
    `magnitude` (YaRN's attention factor) scales q and k alike."""
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    return cos, sin


def rows_at(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' [T, 1, head_dim] rows at `positions`, in `dtype`."""
    return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the per-token angles of `RotaryEmbedding.cos_sin`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class StepRotaryEmbedding:
    """Multimodal RoPE (Qwen2-VL's M-RoPE) for one step: the cos/sin of each of the step's tokens, row t for
    token t, from its 3-D position [temporal, height, width]; frequency j turns by the component whose section
    holds j (`section`: how many frequencies, in order, each component turns). Looked up like a
    `RotaryEmbedding` with positions 0 .. T-1. A token whose three components are equal gets exactly the 1-D
    table's row of that position."""

    def __init__(self, table: RotaryEmbedding, positions: torch.Tensor, section: tuple[int, ...]) -> None:
        component = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section)).to(positions.device)
        angles = positions[component].float().T * table.inv_freq.to(positions.device)  # [T, head_dim / 2]
        self.cos, self.sin = cos_sin_rows(angles, table.magnitude)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """As `RotaryEmbedding.cos_sin`, over this step's rows."""
        return rows_at(self.cos, self.sin, positions, dtype)
