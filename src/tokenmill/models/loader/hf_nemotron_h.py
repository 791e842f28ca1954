"""NemotronHForCausalLM's config.json (transformers' NemotronHConfig) -> ArchConfig, refusing what is not run."""

from __future__ import annotations

import math
from typing import Any, Callable

from tokenmill.models.arch import ArchConfig, MambaConfig, MoEConfig
from tokenmill.models.loader.hf_mamba2 import check_mixer_settings, eos_token_ids
from tokenmill.models.nemotron_h import ATTENTION, EXPERTS, MAMBA, MLP, layer_blocks

ARCHITECTURE = "NemotronHForCausalLM"

# NemotronHConfig's defaults, for keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
    "sliding_window": None, "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mlp_bias": False,
    "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8,
    "conv_kernel": 4, "time_step_min": 0.001, "time_step_limit": (0.0, math.inf), "use_conv_bias": True,
    "chunk_size": 128, "use_bias": False, "layer_norm_epsilon": 1e-5, "num_nextn_predict_layers": 0,
    "n_routed_experts": 8, "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True,
}

# the legacy config.json names NemotronHConfig still reads, as its own
_LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
                 "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias",
                 "mamba_chunk_size": "chunk_size"}

# layers_block_type's names (and the legacy ones transformers maps to them) as hybrid_override_pattern's letters
_LETTERS = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
            "mlp": MLP, "moe": EXPERTS}


def _pattern(setting: dict[str, Any]) -> str:
    """The model's blocks as hybrid_override_pattern letters, from layers_block_type or the legacy pattern."""
    kinds = setting.get("layers_block_type") or setting.get("layer_types")
    if kinds is None:
        return str(setting.get("hybrid_override_pattern") or "ME*-")  # (NemotronHConfig's default blocks)
    unknown = sorted(set(kinds) - set(_LETTERS))
    if unknown:
        raise ValueError(f"{ARCHITECTURE} with layers_block_type {unknown} is not supported; supported: "
                         "linear_attention, full_attention, mlp, moe")
    return "".join(_LETTERS[kind] for kind in kinds)


def _experts(setting: dict[str, Any]) -> MoEConfig:
    """The experts blocks' MoEConfig; ValueError for moe_latent_size or a top-k the kept groups cannot fill."""
    name = ARCHITECTURE
    if setting["moe_latent_size"] is not None:
        raise ValueError(f"{name} with moe_latent_size={setting['moe_latent_size']} is not supported; supported: "
                         "None (experts on the hidden state)")
    experts, top_k = int(setting["n_routed_experts"]), int(setting["num_experts_per_tok"])
    groups, kept = int(setting["n_group"]), int(setting["topk_group"])
    if experts % groups or top_k > kept * (experts // groups):
        raise ValueError(f"{name}: n_routed_experts ({experts}) must split into n_group ({groups}) groups whose "
                         f"topk_group ({kept}) best hold num_experts_per_tok ({top_k}) experts")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=int(setting["moe_intermediate_size"]),
                     norm_topk_prob=bool(setting["norm_topk_prob"]),
                     routed_scaling_factor=float(setting["routed_scaling_factor"]),
                     shared_intermediate_size=int(setting["moe_shared_expert_intermediate_size"]),
                     scoring="sigmoid", num_groups=groups, topk_groups=kept, expert_activation="relu2")


def nemotron_h_arch_config(config: dict[str, Any], generation: dict[str, Any],
                           stored_dtype: Callable[[], str]) -> ArchConfig:
    """The ArchConfig of a NemotronHForCausalLM config.json: its blocks grouped into layers of one mixer and the
    MLP blocks after it (models/nemotron_h.py). As transformers runs it: attention without position embedding nor
    biases (attention_bias is not read), the Mamba2 mixers' width mamba_num_heads x mamba_head_dim (expand is not
    read), dt clamped from below at time_step_min (transformers clamps its prefill scan there; here every step is),
    the multi-token prediction layers not run. Experts blocks (E / moe): n_routed_experts relu² experts of
    moe_intermediate_size, num_experts_per_tok per token by DeepSeek-V3's sigmoid grouped routing with a correction
    bias (n_group, topk_group, norm_topk_prob, routed_scaling_factor), plus one shared relu² MLP of
    moe_shared_expert_intermediate_size. ValueError for a setting not implemented: a pattern starting with an MLP
    block, mlp_hidden_act other than relu2, mlp_bias, mamba_hidden_act other than silu, a time_step_limit other
    than (0, inf), a sliding_window, mamba_num_heads not a multiple of n_groups, moe_latent_size (experts in a
    latent space), num_experts_per_tok more than the topk_group groups' experts."""
    setting = {**_DEFAULTS, **{_LEGACY_NAMES.get(key, key): value for key, value in config.items()}}
    name = ARCHITECTURE
    blocks = layer_blocks(_pattern(setting))
    check_mixer_settings(name, {"hidden_act": setting["mamba_hidden_act"],
                                "time_step_limit": setting["time_step_limit"]})
    if setting["mlp_hidden_act"] != "relu2":
        raise ValueError(f"{name} with mlp_hidden_act={setting['mlp_hidden_act']!r} is not supported; "
                         "supported: 'relu2'")
    if setting["mlp_bias"]:
        raise ValueError(f"{name} with mlp_bias=True is not supported; supported: False")
    if setting["sliding_window"] is not None:
        raise ValueError(f"{name} with sliding_window={setting['sliding_window']!r} is not supported; "
                         "supported: None (full attention)")
    heads, groups = int(setting["mamba_num_heads"]), int(setting["n_groups"])
    if heads % groups:
        raise ValueError(f"{name}: mamba_num_heads ({heads}) must be a multiple of n_groups ({groups})")
    mamba = MambaConfig(num_heads=heads, head_dim=int(setting["mamba_head_dim"]),
                        state_size=int(setting["ssm_state_size"]), n_groups=groups,
                        conv_kernel=int(setting["conv_kernel"]), chunk_size=int(setting["chunk_size"]),
                        norm_eps=float(setting["layer_norm_epsilon"]), conv_bias=bool(setting["use_conv_bias"]),
                        bias=bool(setting["use_bias"]), dt_min=float(setting["time_step_min"]))
    layers = len(blocks)
    moe = _experts(setting) if any(EXPERTS in layer for layer in blocks) else None
    num_heads = int(setting["num_attention_heads"])
    return ArchConfig(
        architecture=name, vocab_size=int(setting["vocab_size"]), hidden_size=int(setting["hidden_size"]),
        intermediate_size=int(setting["intermediate_size"]), num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=int(setting["num_key_value_heads"] or num_heads),
        head_dim=int(setting["head_dim"]), rms_norm_eps=float(setting["layer_norm_epsilon"]), rope_theta=10000.0,
        max_position_embeddings=int(setting["max_position_embeddings"]),
        tie_word_embeddings=bool(setting["tie_word_embeddings"]), bos_token_id=setting["bos_token_id"],
        eos_token_ids=eos_token_ids(setting, generation),
        checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or stored_dtype()),
        no_rope_layers=frozenset(range(layers)), mamba=mamba, moe=moe,
        mamba_layers=frozenset(j for j, layer in enumerate(blocks) if layer[0] == MAMBA), layer_blocks=blocks)
