"""GraniteMoeHybridForCausalLM's config.json (transformers' GraniteMoeHybridConfig, Granite 4.0-H) -> ArchConfig,
refusing what is not run."""

from __future__ import annotations

import math
from typing import Any, Callable

from tokenmill.models.arch import ArchConfig, MambaConfig, MoEConfig
from tokenmill.models.loader.hf_mamba2 import check_mixer_settings, eos_token_ids

ARCHITECTURE = "GraniteMoeHybridForCausalLM"

# GraniteMoeHybridConfig's defaults, for keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "attention_bias": False, "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
    "attention_multiplier": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
    "position_embedding_type": None, "layer_types": None, "mamba_n_heads": 128, "mamba_n_groups": 1,
    "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "time_step_limit": (0.0, math.inf),
}

# layer kinds as config.json names them (transformers maps the legacy "mamba"/"attention" to the new names)
_MAMBA_KINDS = ("mamba", "linear_attention")
_ATTENTION_KINDS = ("attention", "full_attention")


def granite_hybrid_arch_config(config: dict[str, Any], generation: dict[str, Any],
                               stored_dtype: Callable[[], str]) -> ArchConfig:
    """The ArchConfig of a GraniteMoeHybridForCausalLM config.json. Its multipliers: the embeddings times
    embedding_multiplier, each block's output times residual_multiplier, attention_multiplier the softmax scale,
    the logits divided by logits_scaling. position_embedding_type "rope" rotates q and k; None (or "nope"): no
    layer does. num_local_experts 0: each layer's MLP is the shared MLP alone. ValueError for a setting not
    implemented: hidden_act other than silu, a time_step_limit other than (0, inf), a position_embedding_type
    or layer type not listed above, scaled RoPE, mamba_n_heads x mamba_d_head != mamba_expand x hidden_size, mamba_n_heads
    not a multiple of mamba_n_groups."""
    setting = {**_DEFAULTS, **config}
    name = ARCHITECTURE
    check_mixer_settings(name, setting)
    position = setting["position_embedding_type"]
    if position not in (None, "nope", "rope"):
        raise ValueError(f"{name} with position_embedding_type={position!r} is not supported; supported: "
                         "'rope', None (no position embedding)")
    layers = int(setting["num_hidden_layers"])
    kinds = setting["layer_types"] or setting.get("layers_block_type") or ["mamba"] * layers
    unknown = sorted(set(kinds) - set(_MAMBA_KINDS + _ATTENTION_KINDS))
    if unknown:
        raise ValueError(f"{name} with layer types {unknown} is not supported; supported: "
                         f"{', '.join(_MAMBA_KINDS + _ATTENTION_KINDS)}")
    if len(kinds) != layers:
        raise ValueError(f"{name}: layer_types lists {len(kinds)} layers but num_hidden_layers is {layers}")
    hidden = int(setting["hidden_size"])
    inner = int(setting["mamba_expand"] * hidden)
    heads = int(setting["mamba_n_heads"])
    head_dim = inner // heads if setting["mamba_d_head"] == "auto" else int(setting["mamba_d_head"])
    if heads * head_dim != inner:
        raise ValueError(f"{name}: mamba_n_heads x mamba_d_head ({heads} x {head_dim}) must equal mamba_expand x "
                         f"hidden_size ({inner})")
    if heads % int(setting["mamba_n_groups"]):
        raise ValueError(f"{name}: mamba_n_heads ({heads}) must be a multiple of mamba_n_groups "
                         f"({setting['mamba_n_groups']})")
    mamba = MambaConfig(num_heads=heads, head_dim=head_dim, state_size=int(setting["mamba_d_state"]),
                        n_groups=int(setting["mamba_n_groups"]), conv_kernel=int(setting["mamba_d_conv"]),
                        chunk_size=int(setting["mamba_chunk_size"]), norm_eps=float(setting["rms_norm_eps"]),
                        conv_bias=bool(setting["mamba_conv_bias"]), bias=bool(setting["mamba_proj_bias"]))
    experts, shared = int(setting["num_local_experts"] or 0), int(setting["shared_intermediate_size"])
    # the router: softmax of the top-k logits alone, which is the softmax over all experts renormalised over the k
    moe = MoEConfig(num_experts=experts, top_k=int(setting["num_experts_per_tok"]),
                    intermediate_size=int(setting["intermediate_size"]), norm_topk_prob=True,
                    shared_intermediate_size=shared) if experts > 0 else None
    num_heads = int(setting["num_attention_heads"])
    rope = setting.get("rope_parameters") or setting.get("rope_scaling") or {}
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if position == "rope" and scaling != "default":  # (Granite 4.0's checkpoints: unscaled RoPE, or none)
        raise ValueError(f"{name} with RoPE scaling {scaling!r} is not supported; supported: default")
    max_positions = int(setting["max_position_embeddings"])
    return ArchConfig(
        architecture=name, vocab_size=int(setting["vocab_size"]), hidden_size=hidden,
        # a dense model's one MLP is the shared MLP
        intermediate_size=int(setting["intermediate_size"]) if moe is not None else shared,
        num_hidden_layers=layers, num_attention_heads=num_heads,
        num_key_value_heads=int(setting["num_key_value_heads"] or num_heads), head_dim=hidden // num_heads,
        rms_norm_eps=float(setting["rms_norm_eps"]), rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(setting["tie_word_embeddings"]),
        attention_bias=bool(setting["attention_bias"]), attention_out_bias=bool(setting["attention_bias"]),
        bos_token_id=setting["bos_token_id"], eos_token_ids=eos_token_ids(setting, generation),
        checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or stored_dtype()),
        embedding_scale=float(setting["embedding_multiplier"]), attention_scale=float(setting["attention_multiplier"]),
        residual_multiplier=float(setting["residual_multiplier"]), logits_scaling=float(setting["logits_scaling"]),
        no_rope_layers=frozenset(range(layers)) if position != "rope" else frozenset(),
        moe=moe, mamba=mamba, mamba_layers=frozenset(i for i, kind in enumerate(kinds) if kind in _MAMBA_KINDS))
