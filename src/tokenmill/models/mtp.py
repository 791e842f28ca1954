"""A model's own multi-token prediction layer as a draft (num_nextn_predict_layers: DeepSeek-V3's and GLM-4.5's,
vLLM's DeepSeekMTP and Glm4MoeMTP, stored beside the decoder's layers as model.layers.N.*, N = num_hidden_layers;
Qwen3-Next's, vLLM's Qwen3NextMTP, stored as mtp.*).

At position i it reads the embedding of token i+1 and a hidden state h_i: the target's final (normed) hidden state
at a position the target computed, the layer's own output at a chained one. eh_proj(concat(enorm(embedding),
hnorm(h))) goes through one decoder layer of the target's kind (DeepSeek-V3: MLA attention and the routed
experts; GLM-4.5: its GQA attention with partial RoPE, q/k norm and biases, and its routed experts; Qwen3-Next: its
gated full attention, whatever the kind of the target's last layer, and the MLP kind of its layer 0, as vLLM builds
it). DeepSeek-V3 and GLM-4.5: the output (residual stream) chains, shared_head's norm and head give the logits, and
as in vLLM the embedding at position 0 is zeroed (nothing precedes it). Qwen3-Next: its names are
pre_fc_norm_embedding, pre_fc_norm_hidden, fc and norm (1 + w norms, as all of the model's); the normed output chains
and the model's head gives the logits; nothing is zeroed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.layers.linear import ColumnParallelLinear, default_weight_loader
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import FULL_ATTENTION, ArchConfig
from tokenmill.models.attention_block import RopeInputs
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.kernel_choice import KernelChoice
from tokenmill.models.support import mtp_architectures
from tokenmill.parallel.group import PipelineStage

MTP_ARCHITECTURES = mtp_architectures()  # models/support.py: the records say which checkpoints carry one
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")  # the layer's tensors outside its decoder block


def check_mtp_architecture(architecture: str) -> None:
    """ValueError unless `architecture`'s multi-token prediction layer can draft (MTP_ARCHITECTURES)."""
    if architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"speculative_method 'mtp' runs the multi-token prediction layers of "
                         f"{', '.join(MTP_ARCHITECTURES)}; {architecture} is not supported")


def mtp_layer_index(folder: str | Path, arch: ArchConfig) -> int:
    """N, the index of the checkpoint's first multi-token prediction layer; ValueError for a model without one."""
    check_mtp_architecture(arch.architecture)
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if not config.get("num_nextn_predict_layers"):
        raise ValueError("speculative_method 'mtp': the model's config has no num_nextn_predict_layers (it has no "
                         "multi-token prediction layer)")
    return arch.num_hidden_layers


class MultiTokenPredictor(nn.Module):
    """Layer N as the draft's ModelRunner runs it: `forward(ids, positions, kv_caches, metadata)` -> the states
    that chain [T, hidden], `compute_logits` -> float32 logits [N, vocab].

    `block` is a DecoderForCausalLM holding layer N alone (a pipeline stage of one layer), whose embedding, final
    norm and head are the MTP layer's embed_tokens and shared_head (norm, head): its loader places every tensor
    of the decoder block (attention, experts) as the target's does.

    Invariant: `step_hidden` holds the input hidden state of each of the step's rows, in the batch's order, when
    `forward` runs (spec_decode/draft.py sets it before every pass)."""

    def __init__(self, arch: ArchConfig, index: int, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.block = DecoderForCausalLM(_block_arch(arch, index), backend, max_positions,
                                        stage=PipelineStage(first_layer=index, end_layer=index + 1))
        self.index = index
        self.arch, self.stage, self.lora, self.vision = arch, PipelineStage(), None, None
        # Qwen3-Next's layer (mtp.*): its output normed and chained, nothing zeroed (the module docstring)
        self.normed_output = arch.gated_deltanet is not None
        self.layers = self.block.layers
        self.kernel_choice: Optional[KernelChoice] = None
        hidden = arch.hidden_size
        self.enorm = RMSNorm(hidden, arch.rms_norm_eps, arch.norm_weight_offset)
        self.hnorm = RMSNorm(hidden, arch.rms_norm_eps, arch.norm_weight_offset)
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden)
        self.step_hidden: Optional[torch.Tensor] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        """The states that chain [T, hidden]: the layer's output (residual stream, before shared_head's norm), or
        Qwen3-Next's normed output."""
        embeds = self.block.embed(input_ids)
        if not self.normed_output:
            embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(self.step_hidden.to(embeds.dtype))], dim=-1))
        rope = RopeInputs(self.block.rotary, positions, x.dtype, self.block.kernels)
        hidden, residual = self.layers[0](rope, x, None, kv_caches[0], attn_metadata[0])
        if self.normed_output:
            return self.block.norm(hidden, residual)[0]
        return hidden + residual

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        """shared_head: norm (Qwen3-Next's states come normed), then the head -> float32 logits [N, vocab]."""
        return self.block.compute_logits(states if self.normed_output else self.block.norm(states))

    def load_weights(self, weights: Iterable[tuple[str, Any]], quantize_to: Optional[str] = None) -> None:
        """Load layer N's tensors out of the whole checkpoint's (`weights`); its embed_tokens and shared_head.head
        default to the model's own embedding and head where the checkpoint stores no copy."""
        prefix = f"model.layers.{self.index}."
        own, block, shared = {}, [], {}
        if self.normed_output:
            weights = _qwen3_next_mtp_names(weights, prefix)
        for name, tensor in weights:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                shared[name] = tensor
            elif name.startswith(prefix):
                rest = name[len(prefix):]
                if rest in _OWN:
                    own[rest] = tensor
                elif rest == "embed_tokens.weight":
                    shared["mtp.embed_tokens.weight"] = tensor
                elif rest.startswith("shared_head."):
                    shared["mtp." + rest] = tensor
                else:
                    block.append((name, tensor))
        if not block or set(own) != set(_OWN):
            raise ValueError(f"the checkpoint has no complete multi-token prediction layer {prefix}* (missing "
                             f"{sorted(set(_OWN) - set(own)) or 'its decoder block'})")
        self.block.load_weights(self._block_tensors(block, shared), quantize_to)
        for name, tensor in own.items():
            param, module = self.get_parameter(name), self.get_submodule(name.split(".")[0])
            if isinstance(module, RMSNorm):  # (its weight offset: Qwen3-Next's 1 + w)
                module.weight_loader(param, tensor)
            else:
                default_weight_loader(param, tensor.to(param.dtype) if isinstance(tensor, torch.Tensor) else tensor)

    @staticmethod
    def _block_tensors(block: list, shared: dict) -> Iterator[tuple[str, Any]]:
        yield from block
        yield "model.embed_tokens.weight", shared.get("mtp.embed_tokens.weight", shared.get("model.embed_tokens.weight"))
        if "mtp.shared_head.norm.weight" not in shared:
            raise ValueError("the checkpoint's multi-token prediction layer has no shared_head.norm.weight")
        yield "model.norm.weight", shared["mtp.shared_head.norm.weight"]
        head = shared.get("mtp.shared_head.head.weight", shared.get("lm_head.weight"))
        if head is not None:
            yield "lm_head.weight", head

    def apply_kernels(self, choice: KernelChoice) -> None:
        """After loading: the target's kernels, without its one-call step (it runs the decoder's layers)."""
        choice = dataclasses.replace(choice, fused_decode=False)
        self.block.apply_kernels(choice)
        self.eh_proj.use_kernel(choice.packed, choice.native, choice.batch_invariant)
        if choice.elementwise is not None:
            self.enorm.kernels = self.hnorm.kernels = choice.elementwise
        self.kernel_choice = choice


def _block_arch(arch: ArchConfig, index: int) -> ArchConfig:
    """The ArchConfig of a decoder of index + 1 layers whose layer `index` is the MTP layer's decoder block: past the
    target's last, so of its kind (DeepSeek-V3's and GLM-4.5's later layers are MoE, N >= first_k_dense_replace:
    vLLM builds it MoE too); Qwen3-Next's is full attention, MoE or dense as its layer 0 (vLLM's
    Qwen3NextDecoderLayer reads the layer index 0 from its mtp.layers.0 prefix)."""
    extra = index + 1 - len(arch.layer_types)
    if arch.gated_deltanet is None:
        types = tuple(arch.layer_types) + (arch.layer_types[-1],) * extra if arch.layer_types else arch.layer_types
        return dataclasses.replace(arch, num_hidden_layers=index + 1, layer_types=types)
    moe = arch.moe
    if moe is not None:
        dense = moe.dense_layers | {index} if 0 in moe.dense_layers else moe.dense_layers - {index}
        moe = dataclasses.replace(moe, dense_layers=frozenset(dense))
    return dataclasses.replace(arch, num_hidden_layers=index + 1, moe=moe,
                               layer_types=tuple(arch.layer_types) + (FULL_ATTENTION,) * extra)


# Qwen3-Next's mtp.* names -> the DeepSeek-V3 layout's, under the layer's prefix
_QWEN3_NEXT_MTP_NAMES = {"pre_fc_norm_embedding.weight": "enorm.weight", "pre_fc_norm_hidden.weight": "hnorm.weight",
                         "fc.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}


def _qwen3_next_mtp_names(weights: Iterable[tuple[str, Any]], prefix: str) -> Iterator[tuple[str, Any]]:
    """A Qwen3-Next checkpoint's tensors with its MTP layer's (mtp.*) renamed into DeepSeek-V3's layout under
    `prefix` (model.layers.N.): mtp.layers.0.* as the decoder block's, its norms and fc as enorm, hnorm, eh_proj and
    shared_head.norm (the head stays the model's lm_head); a later MTP layer's tensors are left out (the first
    drafts, as DeepSeek-V3's); ValueError for another mtp.* name."""
    for name, tensor in weights:
        if not name.startswith("mtp."):
            yield name, tensor
            continue
        rest = name[len("mtp."):]
        if rest.startswith("layers.0."):
            yield prefix + rest[len("layers.0."):], tensor
        elif rest in _QWEN3_NEXT_MTP_NAMES:
            yield prefix + _QWEN3_NEXT_MTP_NAMES[rest], tensor
        elif not rest.startswith("layers."):
            raise ValueError(f"checkpoint tensor {name!r}: not a tensor of Qwen3-Next's multi-token prediction layer")
