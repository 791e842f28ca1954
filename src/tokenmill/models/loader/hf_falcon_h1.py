"""FalconH1ForCausalLM's config.json (transformers' FalconH1Config) -> ArchConfig, refusing what is not run."""

from __future__ import annotations

import math
from typing import Any, Callable

from tokenmill.models.arch import ArchConfig, FalconH1Multipliers, MambaConfig
from tokenmill.models.loader.hf_mamba2 import check_mixer_settings, eos_token_ids

ARCHITECTURE = "FalconH1ForCausalLM"

# FalconH1Config's defaults, for keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128000, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 8192,
    "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "mamba_norm_before_gate": True, "mamba_rms_norm": False,
    "time_step_limit": (0.0, math.inf), "projectors_bias": False, "lm_head_multiplier": 1.0,
    "embedding_multiplier": 1.0, "mlp_multipliers": None, "key_multiplier": 1.0, "attention_out_multiplier": 1.0,
    "attention_in_multiplier": 1.0, "ssm_multipliers": None, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
    "attention_bias": False, "mlp_bias": False,
}


def _multipliers(setting: dict[str, Any]) -> FalconH1Multipliers:
    """The config's multipliers; ValueError where ssm_multipliers is not 5 numbers or mlp_multipliers not 2."""
    ssm = setting["ssm_multipliers"] or [1.0] * 5
    mlp = setting["mlp_multipliers"] or [1.0] * 2
    if len(ssm) != 5:
        raise ValueError(f"{ARCHITECTURE}: ssm_multipliers must be 5 numbers (z, x, B, C, dt), got {list(ssm)}")
    if len(mlp) != 2:
        raise ValueError(f"{ARCHITECTURE}: mlp_multipliers must be 2 numbers (gate, down), got {list(mlp)}")
    return FalconH1Multipliers(
        attention_in=float(setting["attention_in_multiplier"]), key=float(setting["key_multiplier"]),
        attention_out=float(setting["attention_out_multiplier"]), ssm_in=float(setting["ssm_in_multiplier"]),
        ssm_projections=tuple(float(x) for x in ssm), ssm_out=float(setting["ssm_out_multiplier"]),
        mlp_gate=float(mlp[0]), mlp_down=float(mlp[1]))


def falcon_h1_arch_config(config: dict[str, Any], generation: dict[str, Any],
                          stored_dtype: Callable[[], str]) -> ArchConfig:
    """The ArchConfig of a FalconH1ForCausalLM config.json: its layer i as decoder layers 2i (Mamba2 mixer) and
    2i + 1 (attention and MLP), models/falcon_h1.py. The Mamba2 mixer's width is mamba_d_ssm (or mamba_expand x
    hidden_size); its output gated by silu(z) alone, or with mamba_rms_norm through a grouped RMSNorm before
    (mamba_norm_before_gate) or after the gate. ValueError for a setting not implemented: hidden_act other than silu,
    a time_step_limit other than (0, inf), mamba_proj_bias differing from projectors_bias (one bias setting for
    in_proj and out_proj), mlp_bias, scaled RoPE, a width not mamba_n_heads x mamba_d_head, mamba_n_heads not a
    multiple of mamba_n_groups, multiplier lists of the wrong length."""
    setting = {**_DEFAULTS, **config}
    name = ARCHITECTURE
    check_mixer_settings(name, setting)
    if bool(setting["mamba_proj_bias"]) != bool(setting["projectors_bias"]):
        raise ValueError(f"{name} with mamba_proj_bias={setting['mamba_proj_bias']} and projectors_bias="
                         f"{setting['projectors_bias']} is not supported: the mixer's in_proj and out_proj are "
                         "biased alike here")
    if setting["mlp_bias"]:
        raise ValueError(f"{name} with mlp_bias=True is not supported; supported: False")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling != "default":
        raise ValueError(f"{name} with RoPE scaling {scaling!r} is not supported; supported: default")
    hidden = int(setting["hidden_size"])
    inner = int(setting["mamba_d_ssm"] or setting["mamba_expand"] * hidden)
    heads, groups = int(setting["mamba_n_heads"]), int(setting["mamba_n_groups"])
    head_dim = inner // heads if setting["mamba_d_head"] == "auto" else int(setting["mamba_d_head"])
    if heads * head_dim != inner:
        raise ValueError(f"{name}: mamba_n_heads x mamba_d_head ({heads} x {head_dim}) must equal the mixer's "
                         f"width mamba_d_ssm ({inner})")
    if heads % groups:
        raise ValueError(f"{name}: mamba_n_heads ({heads}) must be a multiple of mamba_n_groups ({groups})")
    gate_norm = "none"
    if setting["mamba_rms_norm"]:
        gate_norm = "before_gate" if setting["mamba_norm_before_gate"] else "after_gate"
    mamba = MambaConfig(num_heads=heads, head_dim=head_dim, state_size=int(setting["mamba_d_state"]),
                        n_groups=groups, conv_kernel=int(setting["mamba_d_conv"]),
                        chunk_size=int(setting["mamba_chunk_size"]), norm_eps=float(setting["rms_norm_eps"]),
                        conv_bias=bool(setting["mamba_conv_bias"]), bias=bool(setting["mamba_proj_bias"]),
                        gate_norm=gate_norm)
    num_heads = int(setting["num_attention_heads"])
    layers = 2 * int(setting["num_hidden_layers"])  # each Falcon-H1 layer as two decoder layers
    return ArchConfig(
        architecture=name, vocab_size=int(setting["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(setting["intermediate_size"]), num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=int(setting["num_key_value_heads"] or num_heads),
        head_dim=int(setting.get("head_dim") or hidden // num_heads), rms_norm_eps=float(setting["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta", setting.get("rope_theta", 10000.0))),
        max_position_embeddings=int(setting["max_position_embeddings"]),
        tie_word_embeddings=bool(setting["tie_word_embeddings"]),
        attention_bias=bool(setting["attention_bias"]), attention_out_bias=bool(setting["attention_bias"]),
        bos_token_id=setting["bos_token_id"], eos_token_ids=eos_token_ids(setting, generation),
        checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or stored_dtype()),
        embedding_scale=float(setting["embedding_multiplier"]),
        logits_scaling=1.0 / float(setting["lm_head_multiplier"]),
        mamba=mamba, mamba_layers=frozenset(range(0, layers, 2)), falcon_h1=_multipliers(setting))
