"""Nemotron-H's layers (NemotronHForCausalLM) in the one decoder (models/decoder.py).

Nemotron-H is a stack of single-block layers, each stream += block(norm(stream)), the block a Mamba2 mixer (M),
attention without any position embedding (*), a relu² MLP (-) or a mixture of relu² experts plus a shared one (E),
as hybrid_override_pattern lists them. Only mixers keep a cache, so the decoder's layer j is one mixer block and
the MLP blocks that follow it (`ArchConfig.layer_blocks[j]`, e.g. "M-" or "*E"): a layer's cache is its mixer's (a
Mamba2 state or K/V, core/kv_spec.py) and no layer is left without one. The checkpoint's block k is renamed to its
place in that grouping (`nemotron_h_checkpoint_names`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.layers.mamba2_mixer import Mamba2Mixer
from tokenmill.layers.moe import MoEBlock
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig
from tokenmill.models.attention_block import SelfAttention
from tokenmill.parallel.group import TPGroup

MAMBA, ATTENTION, MLP, EXPERTS = "M", "*", "-", "E"


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))²): Nemotron-H's MLP and each of its experts, no gate (its projections under the names `up`
    and `down_proj`: the decoder's loader reads a `.up_proj.` as half of a fused gate/up projection)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(hidden_size, intermediate_size, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp)

    def intermediate(self, x: torch.Tensor) -> torch.Tensor:
        """relu(up(x))², what the down projection takes (MoEBlock runs an expert in these two steps)."""
        return torch.square(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.intermediate(x))


class NemotronHLayer(nn.Module):
    """A mixer block then its MLP blocks, each stream += block(norm(stream)), carried as DecoderLayer carries the
    stream: (block output, residual stream), the next norm adding them. `norm`/`mixer` are the mixer block's
    (a Mamba2 mixer or attention), `mlp_norms[i]`/`mlps[i]` the i-th MLP block's (a relu² MLP, or a MoEBlock of
    relu² experts)."""

    def __init__(self, arch: ArchConfig, index: int, backend: Any, tp: TPGroup) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{arch.architecture} runs at tensor_parallel_size 1 (asked for {tp.size}): "
                             "Mamba2 mixers are not sharded")
        spec, blocks = arch.layer_spec(index), arch.layer_blocks[index]
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mixer = (Mamba2Mixer(arch.hidden_size, arch.mamba) if spec.mixer == "mamba"
                      else SelfAttention(arch, spec, backend, tp))
        self.mlp_norms = nn.ModuleList(RMSNorm(arch.hidden_size, arch.rms_norm_eps) for _ in blocks[1:])
        expert = lambda width: ReluSquaredMLP(arch.hidden_size, width, tp)  # noqa: E731
        self.mlps = nn.ModuleList(MoEBlock(arch.moe, arch.hidden_size, expert, tp) if block == EXPERTS
                                  else expert(arch.intermediate_size) for block in blocks[1:])

    def forward(self, rope: Any, hidden: torch.Tensor, residual: Optional[torch.Tensor], kv_cache: Any,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(last block's output, residual stream); `kv_cache` and `attn_metadata` are the mixer's group's: a Mamba2
        mixer's states and the step's StateChunks, or K/V pages and the backend's metadata."""
        if residual is None:
            residual, normed = hidden, self.norm(hidden)
        else:
            normed, residual = self.norm(hidden, residual)
        if isinstance(self.mixer, Mamba2Mixer):
            hidden = self.mixer(normed, kv_cache, attn_metadata)
        else:
            hidden = self.mixer(rope, normed, kv_cache, attn_metadata)
        for norm, mlp in zip(self.mlp_norms, self.mlps):
            normed, residual = norm(hidden, residual)
            hidden = mlp(normed)
        return hidden, residual


def layer_blocks(pattern: str) -> tuple[str, ...]:
    """hybrid_override_pattern -> each layer's blocks: a mixer letter (M or *) and the MLP letters (- or E) after
    it, e.g. "M-ME*-" -> ("M-", "ME", "*-"). ValueError for a pattern that does not start with a mixer (an MLP
    block would have no layer to join) or has a letter other than M, *, - and E."""
    unknown = sorted(set(pattern) - {MAMBA, ATTENTION, MLP, EXPERTS})
    if unknown:
        raise ValueError(f"NemotronHForCausalLM with hybrid_override_pattern letters {unknown} is not supported; "
                         "supported: M (Mamba2), * (attention), - (MLP), E (experts)")
    if not pattern or pattern[0] in (MLP, EXPERTS):
        raise ValueError(f"NemotronHForCausalLM with hybrid_override_pattern {pattern!r} is not supported: it must "
                         "start with a mixer block (M or *), which the MLP blocks after it join")
    return tuple(re.findall(r"[M*][-E]*", pattern))


_BLOCK = re.compile(r"^(?:model\.|backbone\.)?layers\.(\d+)\.(norm|mixer)\.(.*)$")


def nemotron_h_checkpoint_names(weights: Iterable[tuple[str, Any]], arch: ArchConfig
                                ) -> Iterator[tuple[str, Any]]:
    """Nemotron-H's tensor names as the decoder's: block k's `norm` and `mixer.*` under its layer j's `norm` and
    `mixer.*` (a mixer block) or `mlp_norms.i` and `mlps.i.*` (the layer's i-th MLP or experts block, whose
    `gate`, `experts.e.*` and `shared_experts.*` keep their names; every up_proj as `up`);
    `embeddings` -> embed_tokens, `norm_f` -> norm (with or without the `backbone.`/`model.` prefix). The
    multi-token prediction layers (`mtp.*`) are not run here and are skipped, as transformers skips them."""
    place: list[tuple[int, int]] = []  # block k -> (layer, position in the layer)
    for layer, blocks in enumerate(arch.layer_blocks):
        place.extend((layer, position) for position in range(len(blocks)))
    for name, tensor in weights:
        if name.startswith("mtp."):
            continue
        bare = name.removeprefix("backbone.").removeprefix("model.")
        if bare == "embeddings.weight":
            yield "embed_tokens.weight", tensor
            continue
        if bare == "norm_f.weight":
            yield "norm.weight", tensor
            continue
        match = _BLOCK.match(name)
        if match is None:
            yield name, tensor
            continue
        block, part, rest = int(match.group(1)), match.group(2), match.group(3)
        if block >= len(place):
            raise ValueError(f"checkpoint tensor {name!r} belongs to block {block}, but hybrid_override_pattern "
                             f"lists {len(place)} blocks")
        layer, position = place[block]
        if position == 0:
            yield f"layers.{layer}.{part}.{rest}", tensor
        elif part == "norm":
            yield f"layers.{layer}.mlp_norms.{position - 1}.{rest}", tensor
        else:
            yield f"layers.{layer}.mlps.{position - 1}.{rest.replace('up_proj.', 'up.')}", tensor
