"""Granite 4.0-H's layers (GraniteMoeHybridForCausalLM) in the one decoder (models/decoder.py): each layer is a
pre-norm token mixer, a Mamba2 mixer (layers/mamba2_mixer.py, its state in the layer's KV group, see
core/kv_spec.py) or attention, then a pre-norm MLP (a mixture of experts plus an always-on shared expert, or the
shared MLP alone); both outputs join the residual stream times `residual_multiplier`."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenmill.layers.mamba2_mixer import Mamba2Mixer
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig
from tokenmill.models.attention_block import SelfAttention
from tokenmill.parallel.group import TPGroup


class GraniteHybridLayer(nn.Module):
    """stream += m * mixer(norm(stream)); stream += m * mlp(norm(stream)), carried as DecoderLayer carries it:
    (block output, residual stream), the next norm adding them. The mixer sits under the checkpoint's names
    (`mamba` or `self_attn`); the MLP (the decoder's `make_mlp`) under the decoder's names (`mlp`, see
    `granite_hybrid_checkpoint_names`)."""

    def __init__(self, arch: ArchConfig, index: int, backend: Any, tp: TPGroup,
                 make_mlp: Callable[[ArchConfig, Any, TPGroup], nn.Module]) -> None:
        super().__init__()
        spec = arch.layer_spec(index)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mamba: Optional[Mamba2Mixer] = None
        self.self_attn: Optional[SelfAttention] = None
        if spec.mixer == "mamba":
            if tp.size > 1:
                raise ValueError(f"{arch.architecture} runs at tensor_parallel_size 1 (asked for {tp.size}): "
                                 "Mamba2 mixers are not sharded")
            self.mamba = Mamba2Mixer(arch.hidden_size, arch.mamba)
        else:
            self.self_attn = SelfAttention(arch, spec, backend, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = make_mlp(arch, spec, tp)
        self.multiplier = arch.residual_multiplier

    def forward(self, rope: Any, hidden: torch.Tensor, residual: Optional[torch.Tensor], kv_cache: Any,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(m * MLP output, residual stream); `kv_cache` and `attn_metadata` are the layer's group's: K/V pages
        and the backend's metadata, or a Mamba2 layer's states and the step's StateChunks."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        if self.mamba is not None:
            mixed = self.mamba(normed, kv_cache, attn_metadata)
        else:
            mixed = self.self_attn(rope, normed, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm(self._scaled(mixed), residual)
        return self._scaled(self.mlp(normed)), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.multiplier == 1.0 else x * self.multiplier


_MOE_TENSOR = re.compile(r"\.block_sparse_moe\.(input_linear|output_linear|router\.layer)\.weight$")
_SHARED_TENSOR = re.compile(r"\.shared_mlp\.(input_linear|output_linear)\.weight$")


def granite_hybrid_checkpoint_names(weights: Iterable[tuple[str, Any]], arch: ArchConfig
                                    ) -> Iterator[tuple[str, Any]]:
    """Granite's MLP tensors under the decoder's names (each expert's and the shared MLP's fused `input_linear`
    is gate rows then up rows): block_sparse_moe.input_linear [E, 2I, H] -> mlp.experts.e.gate_proj / up_proj,
    output_linear [E, H, I] -> mlp.experts.e.down_proj, router.layer -> mlp.gate; shared_mlp.input_linear [2S, H]
    and output_linear -> mlp.shared_experts.* (with experts) or mlp.* (a dense model's one MLP). ValueError for an
    expert tensor whose expert count disagrees with the config."""
    shared_prefix = ".mlp.shared_experts." if arch.moe is not None else ".mlp."
    for name, tensor in weights:
        moe = _MOE_TENSOR.search(name)
        shared = _SHARED_TENSOR.search(name)
        if moe is not None:
            head, kind = name[:moe.start()], moe.group(1)
            if arch.moe is None:
                raise ValueError(f"checkpoint tensor {name!r} is an expert tensor, but the config has no experts "
                                 "(num_local_experts 0)")
            if kind == "router.layer":
                yield f"{head}.mlp.gate.weight", tensor
                continue
            if tensor.shape[0] != arch.moe.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} holds {tensor.shape[0]} experts, but the config has "
                                 f"num_local_experts={arch.moe.num_experts}")
            for expert in range(tensor.shape[0]):
                if kind == "output_linear":
                    yield f"{head}.mlp.experts.{expert}.down_proj.weight", tensor[expert]
                else:
                    gate, up = tensor[expert].chunk(2, dim=0)
                    yield f"{head}.mlp.experts.{expert}.gate_proj.weight", gate
                    yield f"{head}.mlp.experts.{expert}.up_proj.weight", up
        elif shared is not None:
            head = name[:shared.start()]
            if shared.group(1) == "output_linear":
                yield f"{head}{shared_prefix}down_proj.weight", tensor
            else:
                gate, up = tensor.chunk(2, dim=0)
                yield f"{head}{shared_prefix}gate_proj.weight", gate
                yield f"{head}{shared_prefix}up_proj.weight", up
        else:
            yield name, tensor
