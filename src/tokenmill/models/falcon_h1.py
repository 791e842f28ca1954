"""Falcon-H1's layers (FalconH1ForCausalLM) in the one decoder (models/decoder.py).

Each Falcon-H1 layer runs a Mamba2 mixer and attention in parallel on the same normed stream and adds both outputs
to it, then a pre-norm SwiGLU MLP:
    stream += mamba(norm(stream)) + attention(norm(stream));  stream += mlp(norm2(stream)).
A decoder layer keeps one cache, and this layer needs two (a Mamba2 state and K/V), so Falcon-H1's layer i runs as
decoder layers 2i (models/mamba2.py's `Mamba2Layer`: the mixer, its state in its own KV group) and 2i + 1
(`FalconH1AttentionHalf`: attention, the sum, the MLP), each holding a copy of the shared input norm's weight so a
pipeline stage may end between them (`falcon_h1_checkpoint_tensors` gives both halves their tensors). Layer
2i + 1 recomputes the norm from the stream that 2i passes on as its residual, so both read the same input.

Falcon-H1's muP multipliers are folded into the projections at load (`falcon_h1_checkpoint_tensors`): each is a
constant factor on a linear map's input or output, so a weight (and bias) scaled once gives the same products.
The embedding and LM head multipliers are ArchConfig's embedding_scale and logits_scaling.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig
from tokenmill.models.attention_block import SelfAttention
from tokenmill.models.mamba2 import Mamba2Layer
from tokenmill.parallel.group import TPGroup


class FalconH1AttentionHalf(nn.Module):
    """Decoder layer 2i + 1: attention on the norm of the stream, added with the mixer's output to the stream,
    then the MLP: (mlp(norm2(stream')), stream'). Invariant: its residual is never None (layer 2i, on this
    pipeline stage or the one before, always passes the stream on)."""

    def __init__(self, arch: ArchConfig, index: int, backend: Any, tp: TPGroup,
                 make_mlp: Callable[[ArchConfig, Any, TPGroup], nn.Module]) -> None:
        super().__init__()
        spec = arch.layer_spec(index)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = SelfAttention(arch, spec, backend, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = make_mlp(arch, spec, tp)

    def forward(self, rope: Any, hidden: torch.Tensor, residual: Optional[torch.Tensor], kv_cache: Any,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` is the mixer's output, `residual` the stream both halves read; K/V pages and the backend's
        metadata."""
        attended = self.self_attn(rope, self.input_layernorm(residual), kv_cache, attn_metadata)
        # transformers' order: (mamba + attention), then the stream added
        normed, residual = self.post_attention_layernorm(hidden + attended, residual)
        return self.mlp(normed), residual


def falcon_h1_layer(arch: ArchConfig, index: int, backend: Any, tp: TPGroup,
                    make_mlp: Callable[[ArchConfig, Any, TPGroup], nn.Module]) -> nn.Module:
    """Decoder layer `index`: the mixer half of Falcon-H1's layer index // 2 (even), or its attention half (odd)."""
    if index % 2 == 0:  # (mixer(norm(stream)), stream): Mamba2's own layer, the stream passed on as the residual
        return Mamba2Layer(arch, index, backend, tp)
    return FalconH1AttentionHalf(arch, index, backend, tp, make_mlp)


_LAYER_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.([a-z_]+)\.(.*)$")
# a Falcon-H1 layer's part -> (decoder layer offset 0 / 1, its name there)
_PARTS = {"mamba": (0, "mixer"), "self_attn": (1, "self_attn"), "feed_forward": (1, "mlp"),
          "pre_ff_layernorm": (1, "post_attention_layernorm")}


def falcon_h1_checkpoint_tensors(weights: Iterable[tuple[str, Any]], arch: ArchConfig
                                 ) -> Iterator[tuple[str, Any]]:
    """Falcon-H1's tensors under the decoder's names, its multipliers folded in: layer i's `mamba.*` -> layer 2i,
    `self_attn.*`, `feed_forward.*` (-> mlp) and `pre_ff_layernorm` (-> post_attention_layernorm) -> layer
    2i + 1, `input_layernorm` -> both; `final_layernorm` -> norm. ValueError for a quantised projection (the
    multipliers are folded into float weights)."""
    for name, tensor in weights:
        bare = name.removeprefix("model.")
        if bare == "final_layernorm.weight":
            yield "norm.weight", tensor
            continue
        match = _LAYER_TENSOR.match(name)
        if match is None:
            yield name, tensor
            continue
        layer, part, rest = int(match.group(1)), match.group(2), match.group(3)
        if part == "input_layernorm":
            yield f"layers.{2 * layer}.input_layernorm.{rest}", tensor
            yield f"layers.{2 * layer + 1}.input_layernorm.{rest}", tensor
            continue
        if part not in _PARTS:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {arch.architecture}")
        offset, target = _PARTS[part]
        scale = _multiplier(arch, part, rest)
        if scale is not None:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{arch.architecture}: checkpoint tensor {name!r} is quantised; Falcon-H1's "
                                 "multipliers are folded into float projections only")
            tensor = (tensor.float() * scale).to(tensor.dtype)
        yield f"layers.{2 * layer + offset}.{target}.{rest}", tensor


def _multiplier(arch: ArchConfig, part: str, rest: str) -> Any:
    """The factor (a float, or per output row a [rows, 1] / [rows] tensor) folded into tensor `part`.`rest`, or
    None. A multiplier on a projection's input scales its weight only; one on its output, weight and bias."""
    m = arch.falcon_h1
    projection, kind = rest.rsplit(".", 1)[0], rest.rsplit(".", 1)[-1]
    if part == "mamba" and projection == "in_proj":
        rows = _in_proj_row_multipliers(arch)  # the z, x, B, C, dt parts' multipliers, on the output
        return rows[:, None] * m.ssm_in if kind == "weight" else rows
    scales = {
        ("mamba", "out_proj"): (m.ssm_out, m.ssm_out),
        ("self_attn", "q_proj"): (m.attention_in, None),
        ("self_attn", "k_proj"): (m.attention_in * m.key, m.key),
        ("self_attn", "v_proj"): (m.attention_in, None),
        ("self_attn", "o_proj"): (m.attention_out, m.attention_out),
        ("feed_forward", "gate_proj"): (m.mlp_gate, m.mlp_gate),
        ("feed_forward", "down_proj"): (m.mlp_down, m.mlp_down),
    }.get((part, projection))
    if scales is None:
        return None
    return scales[0] if kind == "weight" else scales[1]


def _in_proj_row_multipliers(arch: ArchConfig) -> torch.Tensor:
    """in_proj's output rows' multipliers [rows] (transformers' mup_vector): z and x of the mixer's width, B and C
    of n_groups x state_size, dt of its heads."""
    c, m = arch.mamba, arch.falcon_h1
    sizes = (c.intermediate_size, c.intermediate_size, c.n_groups * c.state_size, c.n_groups * c.state_size,
             c.num_heads)
    return torch.cat([torch.full((size,), float(scale)) for size, scale in zip(sizes, m.ssm_projections)])
