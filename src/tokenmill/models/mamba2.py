"""Mamba2ForCausalLM's layers in the one decoder (models/decoder.py): each layer is a pre-norm Mamba2 mixer
(layers/mamba2_mixer.py) with a residual connection and no MLP; its cache is the request's recurrent state
(core/kv_spec.py's StateCacheSpec), not K/V."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenmill.layers.mamba2_mixer import Mamba2Mixer, RecurrentState, StateChunk
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig
from tokenmill.parallel.group import TPGroup


class Mamba2Layer(nn.Module):
    """hidden -> mixer(norm(hidden)), the residual stream carried as DecoderLayer carries it (the next norm adds)."""

    def __init__(self, arch: ArchConfig, index: int, backend: Any, tp: TPGroup) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{arch.architecture} runs at tensor_parallel_size 1 (asked for {tp.size}): "
                             "Mamba2 mixers are not sharded")
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mixer = Mamba2Mixer(arch.hidden_size, arch.mamba)

    def forward(self, rope: Any, hidden: torch.Tensor, residual: Optional[torch.Tensor], kv_cache: RecurrentState,
                attn_metadata: list[StateChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixer output, residual stream); `kv_cache` is this layer's states, `attn_metadata` the step's chunks."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        return self.mixer(normed, kv_cache, attn_metadata), residual


def mamba2_checkpoint_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """transformers' Mamba2 tensor names as the decoder's: backbone.embeddings -> embed_tokens, a layer's norm ->
    input_layernorm, backbone.norm_f -> norm (the mixer's own names stay)."""
    for name, tensor in weights:
        name = name.removeprefix("backbone.")
        if name == "embeddings.weight":
            name = "embed_tokens.weight"
        elif name == "norm_f.weight":
            name = "norm.weight"
        elif name.startswith("layers.") and name.endswith(".norm.weight") and ".mixer." not in name:
            name = name[:-len("norm.weight")] + "input_layernorm.weight"
        yield name, tensor
