"""Qwen3NextForCausalLM's config.json (transformers' Qwen3NextConfig) -> ArchConfig, refusing what is not run."""

from __future__ import annotations

from typing import Any, Callable

from tokenmill.models.arch import ArchConfig, GatedDeltaNetConfig, MoEConfig

ARCHITECTURE = "Qwen3NextForCausalLM"

# Qwen3NextConfig's defaults, for keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True,
    "mlp_only_layers": None, "layer_types": None, "full_attention_interval": 4, "bos_token_id": None,
    "eos_token_id": None, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
}
_LINEAR, _FULL = "linear_attention", "full_attention"


def qwen3_next_arch_config(config: dict[str, Any], generation: dict[str, Any],
                           stored_dtype: Callable[[], str]) -> ArchConfig:
    """The ArchConfig of a Qwen3NextForCausalLM config.json: layer_types (default: every full_attention_interval-th
    layer full attention, the others linear attention) choose each layer's mixer; a layer's MLP is sparse when
    num_experts > 0, (layer + 1) is a multiple of decoder_sparse_step and it is not in mlp_only_layers, else dense
    of intermediate_size. ValueError naming the setting for what is not implemented: hidden_act other than silu,
    a layer type other than those two, scaled RoPE, a partial_rotary_factor that turns an odd number of dims or none,
    linear_num_value_heads not a multiple of linear_num_key_heads, decoder_sparse_step below 1,
    num_experts_per_tok outside 1..num_experts, shared_expert_intermediate_size 0."""
    setting = {**_DEFAULTS, **config}
    name = ARCHITECTURE
    if setting["hidden_act"] != "silu":
        raise ValueError(f"{name} with hidden_act={setting['hidden_act']!r} is not supported; supported: 'silu'")
    layers = int(setting["num_hidden_layers"])
    interval = int(setting["full_attention_interval"])
    kinds = setting["layer_types"] or [_LINEAR if (i + 1) % interval else _FULL for i in range(layers)]
    unknown = sorted(set(kinds) - {_LINEAR, _FULL})
    if unknown:
        raise ValueError(f"{name} with layer types {unknown} is not supported; supported: {_LINEAR}, {_FULL}")
    if len(kinds) != layers:
        raise ValueError(f"{name}: layer_types lists {len(kinds)} layers but num_hidden_layers is {layers}")
    rope = setting.get("rope_parameters") or setting.get("rope_scaling") or {}
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling != "default":  # (Qwen3-Next's checkpoints: unscaled RoPE)
        raise ValueError(f"{name} with RoPE scaling {scaling!r} is not supported; supported: default")
    num_heads, head_dim = int(setting["num_attention_heads"]), int(setting["head_dim"])
    factor = float(rope.get("partial_rotary_factor", setting["partial_rotary_factor"]))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"{name} with partial_rotary_factor={factor} is not supported: it turns {rotary_dim} of "
                         f"the head's {head_dim} dims (an even number above 0 is needed)")
    deltanet = GatedDeltaNetConfig(
        num_key_heads=int(setting["linear_num_key_heads"]), num_value_heads=int(setting["linear_num_value_heads"]),
        key_head_dim=int(setting["linear_key_head_dim"]), value_head_dim=int(setting["linear_value_head_dim"]),
        conv_kernel=int(setting["linear_conv_kernel_dim"]), norm_eps=float(setting["rms_norm_eps"]))
    if deltanet.num_value_heads % deltanet.num_key_heads:
        raise ValueError(f"{name}: linear_num_value_heads ({deltanet.num_value_heads}) must be a multiple of "
                         f"linear_num_key_heads ({deltanet.num_key_heads})")
    eos_ids: list[int] = []
    for value in (setting["eos_token_id"], generation.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in eos_ids:
                eos_ids.append(int(token))
    bias = bool(setting["attention_bias"])
    return ArchConfig(
        architecture=name, vocab_size=int(setting["vocab_size"]), hidden_size=int(setting["hidden_size"]),
        intermediate_size=int(setting["intermediate_size"]), num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=int(setting["num_key_value_heads"] or num_heads),
        head_dim=head_dim, rms_norm_eps=float(setting["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta", setting["rope_theta"])),
        max_position_embeddings=int(setting["max_position_embeddings"]),
        tie_word_embeddings=bool(setting["tie_word_embeddings"]), attention_bias=bias, attention_out_bias=bias,
        qk_norm=True, norm_weight_offset=1.0,  # every Qwen3NextRMSNorm scales by 1 + weight
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        bos_token_id=setting["bos_token_id"] if setting["bos_token_id"] is not None else generation.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or stored_dtype()),
        moe=_moe(setting, layers), gated_deltanet=deltanet,
        gated_deltanet_layers=frozenset(i for i, kind in enumerate(kinds) if kind == _LINEAR),
        attention_output_gate=True)


def _moe(setting: dict[str, Any], layers: int) -> "MoEConfig | None":
    """The sparse MLP (transformers' Qwen3NextSparseMoeBlock: softmax router, top k renormalised when
    norm_topk_prob, plus a shared expert scaled by sigmoid(shared_expert_gate(x))); None without experts."""
    name, experts = ARCHITECTURE, int(setting["num_experts"] or 0)
    if experts == 0:
        return None
    step, top_k = int(setting["decoder_sparse_step"]), int(setting["num_experts_per_tok"])
    if step < 1:
        raise ValueError(f"{name} with decoder_sparse_step={step} is not supported")
    if not 0 < top_k <= experts:
        raise ValueError(f"{name} with num_experts_per_tok={top_k} of {experts} experts is not supported")
    shared = int(setting["shared_expert_intermediate_size"] or 0)
    if shared <= 0:
        raise ValueError(f"{name} with shared_expert_intermediate_size={shared} is not supported")
    only_dense = set(setting["mlp_only_layers"] or ())
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=int(setting["moe_intermediate_size"]),
                     norm_topk_prob=bool(setting["norm_topk_prob"]), shared_intermediate_size=shared,
                     shared_expert_gate=True,
                     dense_layers=frozenset(i for i in range(layers) if i in only_dense or (i + 1) % step))
