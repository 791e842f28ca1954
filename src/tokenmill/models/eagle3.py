"""An EAGLE-3 draft head (vLLM's Eagle3LlamaForCausalLM; checkpoints such as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B,
config architecture LlamaForCausalLMEagle3): one Llama decoder layer fed the token's embedding beside a hidden
state, over its own paged KV cache.

At a position whose hidden state comes from the target, that state is `fc` of the target's residual stream
entering three of its layers (low, middle, high), concatenated; at a chained position it is the head's own
output at the position before. The layer's attention reads concat(input_layernorm(embedding),
hidden_norm(hidden)) (2 x hidden wide); the hidden state (or its norm, with norm_before_residual) is the
residual. The head's logits cover its own vocabulary of draft_vocab_size tokens, target id = draft id + d2t[id].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.layers.activation import GeluTanhAndMul, SiluAndMul
from tokenmill.layers.linear import ColumnParallelLinear, QKVParallelLinear, default_weight_loader
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig
from tokenmill.models.attention_block import RopeInputs, RotaryTables
from tokenmill.models.decoder import DecoderLayer, stacked_target
from tokenmill.models.kernel_choice import KernelChoice
from tokenmill.models.loader.hf_config import arch_config_from_hf_dict
from tokenmill.parallel.group import PipelineStage, TPGroup

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def read_eagle3_config(folder: str | Path) -> tuple[dict[str, Any], ArchConfig]:
    """The head's config.json and the ArchConfig of its (Llama) decoder layer; ValueError for a folder that holds
    no EAGLE-3 head or a head of a shape this module does not run."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"the EAGLE-3 head {str(folder)!r} has no config.json")
    config = json.loads(path.read_text())
    architectures = config.get("architectures") or []
    if not set(architectures) & set(EAGLE3_ARCHITECTURES):
        raise ValueError(f"the EAGLE-3 head {str(folder)!r} has architectures {architectures}; expected one of "
                         f"{', '.join(EAGLE3_ARCHITECTURES)}")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError("EAGLE-3 heads without auxiliary hidden states (eagle_config.use_aux_hidden_state false: "
                         "EAGLE-1/2 style) are not supported")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE-3 heads of one decoder layer are supported, this one has "
                         f"num_hidden_layers {config['num_hidden_layers']}")
    llama = {**config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    return config, arch_config_from_hf_dict(llama, Path(folder))


def aux_layer_ids(config: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose entering residual stream the head reads: the config's
    eagle_aux_hidden_state_layer_ids, else vLLM's default (2, L // 2, L - 3)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(set(ids)) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 reads three distinct layers of the target's {num_target_layers}; the layer ids "
                         f"{list(ids)} do not fit (a target of at least 7 layers, or eagle_aux_hidden_state_layer_ids)")
    return tuple(sorted(ids))  # the taps are concatenated in layer order, as vLLM's target keeps them


class Eagle3Head(nn.Module):
    """The head as the draft's ModelRunner runs it: `forward(ids, positions, kv_caches, metadata)` -> the states
    that chain [T, hidden] (before the final norm), `compute_logits` -> float32 logits over the target's whole
    vocabulary (-inf outside the draft vocabulary).

    Invariant: `step_hidden` holds the input hidden state of each of the step's rows, in the batch's order, when
    `forward` runs (spec_decode/draft.py sets it before every pass)."""

    def __init__(self, arch: ArchConfig, config: dict[str, Any], backend: AttentionBackend, max_positions: int,
                 target_embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.arch, self.stage, self.lora, self.vision = arch, PipelineStage(), None, None
        self.kernel_choice: Optional[KernelChoice] = None
        self.kernels: Any = None
        self.draft_vocab_size = int(config.get("draft_vocab_size") or arch.vocab_size)
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.rotary = RotaryTables(arch, arch.head_dim, max_positions)
        layer = DecoderLayer(arch, 0, backend, TPGroup.single())
        # the first (only) layer's attention reads the embedding and the hidden state side by side
        layer.self_attn.qkv_proj = QKVParallelLinear(2 * hidden, arch.head_dim, arch.num_attention_heads,
                                                     arch.num_key_value_heads, bias=arch.attention_bias)
        self.layers = nn.ModuleList([layer])
        self.hidden_norm = RMSNorm(hidden, arch.rms_norm_eps)
        target_hidden = int(config.get("target_hidden_size") or hidden)
        self.fc = ColumnParallelLinear(3 * target_hidden, hidden)
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(hidden, self.draft_vocab_size)
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size), persistent=False)
        # its inverse, when the draft vocabulary is the whole vocabulary reordered (target id -> draft id)
        self.register_buffer("target_to_draft", torch.arange(self.draft_vocab_size), persistent=False)
        self.embed_tokens: Optional[nn.Embedding] = None  # its own table when the checkpoint has one
        self.target_embed = target_embed
        self.step_hidden: Optional[torch.Tensor] = None

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three taps [T, 3 x target hidden] -> the head's hidden states [T, hidden]."""
        return self.fc(aux_hidden.to(self.norm.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        """The states after the layer (residual stream, unnormed) [T, hidden]."""
        embeds = self.embed_tokens(input_ids) if self.embed_tokens is not None else self.target_embed(input_ids)
        layer, hidden = self.layers[0], self.step_hidden
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed_hidden], dim=-1)
        rope = RopeInputs(self.rotary, positions, x.dtype, self.kernels)
        attended = layer.self_attn(rope, x, kv_caches[0], attn_metadata[0])
        normed, residual = layer.post_attention_layernorm(attended, residual)
        return layer.mlp(normed) + residual

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, target vocab], -inf for the tokens outside the draft vocabulary."""
        logits = self.lm_head(self.norm(states)).float()
        if self.draft_vocab_size == self.arch.vocab_size:
            return logits.index_select(1, self.target_to_draft)
        full = logits.new_full((logits.shape[0], self.arch.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load an EAGLE-3 checkpoint's tensors (midlayer.* or layers.0.*, fc, norm, lm_head, d2t, optionally
        embed_tokens; t2d is not needed); ValueError for an unknown or missing one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "t2d":
                continue
            if name == "d2t":
                self._set_token_map(tensor)
                continue
            if name == "layers.0.hidden_norm.weight":
                name = "hidden_norm.weight"
            if name == "embed_tokens.weight":
                self.embed_tokens = nn.Embedding(*tensor.shape, _weight=tensor.to(self.norm.weight), _freeze=True)
                continue
            target, shard = stacked_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"EAGLE-3 checkpoint tensor {name!r} has no place in the head")
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            getattr(owner, "weight_loader", default_weight_loader)(param, tensor.to(param.dtype), shard)
            loaded.add(target if shard is None else f"{target}:{shard}")
        expected = {f"{n}:{s}" for n in params if ".qkv_proj." in n for s in "qkv"}
        expected |= {f"{n}:{s}" for n in params if ".gate_up_proj." in n for s in (0, 1)}
        expected |= {n for n in params if ".qkv_proj." not in n and ".gate_up_proj." not in n}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the EAGLE-3 checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _set_token_map(self, d2t: torch.Tensor) -> None:
        """d2t [draft vocab]: target id - draft id of each draft token."""
        if tuple(d2t.shape) != (self.draft_vocab_size,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({self.draft_vocab_size},)")
        targets = torch.arange(self.draft_vocab_size) + d2t.long().cpu()
        if targets.min() < 0 or targets.max() >= self.arch.vocab_size or targets.unique().numel() != len(targets):
            raise ValueError("d2t maps draft tokens outside the target's vocabulary, or two onto one token")
        self.draft_to_target = targets.to(self.draft_to_target.device)
        self.target_to_draft = torch.argsort(targets).to(self.draft_to_target.device)

    def apply_kernels(self, choice: KernelChoice) -> None:
        """After loading: multiply and norm through the target's kernels (no one-call step: one layer)."""
        for module in self.modules():
            if hasattr(module, "use_kernel"):
                module.use_kernel(choice.packed, choice.native, choice.batch_invariant)
            if choice.elementwise is not None and isinstance(module, (RMSNorm, SiluAndMul, GeluTanhAndMul)):
                module.kernels = choice.elementwise
        self.kernels = choice.elementwise
        self.kernel_choice = choice
