"""Qwen3-Next's layers (Qwen3NextForCausalLM) in the one decoder (models/decoder.py): a hybrid whose layers are
either a Gated DeltaNet (linear attention, layers/gated_deltanet.py, its recurrent state in the layer's KV group
as a Mamba2 hybrid's, core/kv_spec.py) or gated full attention (DecoderLayer's SelfAttention with an output gate,
q/k norm and partial RoPE), each followed by the MLP (a mixture of experts with a sigmoid-gated shared expert).
Every RMSNorm but the DeltaNet's gated one scales by 1 + weight (ArchConfig.norm_weight_offset 1)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenmill.layers.gated_deltanet import GatedDeltaNet, deltanet_projection_rows
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig
from tokenmill.parallel.group import TPGroup

logger = logging.getLogger(__name__)


class GatedDeltaNetLayer(nn.Module):
    """stream += linear_attn(norm(stream)); stream += mlp(norm(stream)), carried as DecoderLayer carries it:
    (block output, residual stream), the next norm adding them. Names as the checkpoint's (linear_attn, mlp)."""

    def __init__(self, arch: ArchConfig, index: int, tp: TPGroup,
                 make_mlp: Callable[[ArchConfig, Any, TPGroup], nn.Module]) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{arch.architecture} runs at tensor_parallel_size 1 (asked for {tp.size}): "
                             "Gated DeltaNet mixers are not sharded")
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset)
        self.linear_attn = GatedDeltaNet(arch.hidden_size, arch.gated_deltanet)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset)
        self.mlp = make_mlp(arch, arch.layer_spec(index), tp)

    def forward(self, rope: Any, hidden: torch.Tensor, residual: Optional[torch.Tensor], kv_cache: Any,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream); `kv_cache` is the layer's states, `attn_metadata` the step's
        StateChunks."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        mixed = self.linear_attn(normed, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(normed), residual


def qwen3_next_checkpoint_tensors(weights: Iterable[tuple[str, Any]], arch: ArchConfig
                                  ) -> Iterator[tuple[str, Any]]:
    """Qwen3-Next's tensors as the decoder's layers hold them: a Gated DeltaNet's in_proj_qkvz / in_proj_ba rows
    in blocks (`deltanet_projection_rows`); an attention q_proj (and bias), whose rows alternate per head between
    the head's query and its output gate, split into q_proj and self_attn.output_gate; the multi-token prediction
    layer (`mtp.*`) left out, with a log line (speculative_method mtp loads it as a draft: models/mtp.py)."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith("mtp."):
            skipped += 1
            continue
        if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
            yield name, deltanet_projection_rows(name, tensor, arch.gated_deltanet)
        elif ".self_attn.q_proj." in name:
            yield from _query_and_gate(name, tensor, arch)
        else:
            yield name, tensor
    if skipped:
        logger.info("%s: its multi-token prediction layer (%d mtp.* tensors) is not part of the target; "
                    "speculative_method mtp drafts with it", arch.architecture, skipped)


def _query_and_gate(name: str, tensor: Any, arch: ArchConfig) -> Iterator[tuple[str, Any]]:
    """q_proj's [heads x (query, gate) x head_dim] rows as q_proj's query rows and output_gate's gate rows."""
    heads, width = arch.num_attention_heads, arch.head_dim
    if not isinstance(tensor, torch.Tensor) or tensor.shape[0] != heads * 2 * width:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, but the config's gated attention needs "
                         f"a float tensor of {heads * 2 * width} rows (a query and a gate per head)")
    query, gate = tensor.reshape(heads, 2, width, *tensor.shape[1:]).unbind(1)
    yield name, query.reshape(heads * width, *tensor.shape[1:])
    yield name.replace(".q_proj.", ".output_gate."), gate.reshape(heads * width, *tensor.shape[1:])
