"""Mamba2ForCausalLM's config.json (transformers' Mamba2Config) -> ArchConfig, refusing what is not run."""

from __future__ import annotations

import math
from typing import Any, Callable

from tokenmill.models.arch import ArchConfig, MambaConfig

ARCHITECTURE = "Mamba2ForCausalLM"

# Mamba2Config's defaults, for keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
    "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 8,
    "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "residual_in_fp32": True,
    "time_step_limit": (0.0, math.inf), "chunk_size": 256, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 2,
}

# A recurrent model has no position limit; this bounds max_model_len (the runner's per-request token rows are
# sized by it), as vLLM bounds a config without max_position_embeddings.
MAX_CONTEXT = 65536


def _number(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else float(value)


def check_mixer_settings(name: str, setting: dict[str, Any]) -> None:
    """ValueError where a Mamba2 mixer's config asks what the mixer does not run: hidden_act other than silu, a
    time_step_limit other than (0, inf) (HF clamps dt with it in the prefill scan only, not in its decode step)."""
    if setting["hidden_act"] != "silu":
        raise ValueError(f"{name} with hidden_act={setting['hidden_act']!r} is not supported; supported: 'silu'")
    low, high = (_number(v) for v in setting["time_step_limit"])
    if low != 0.0 or high != math.inf:
        raise ValueError(f"{name} with time_step_limit={list(setting['time_step_limit'])!r} is not supported; "
                         "supported: (0.0, inf)")


def eos_token_ids(setting: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """The EOS ids of config.json's `eos_token_id` then generation_config.json's (an id or a list each), in order,
    once each."""
    ids: list[int] = []
    for value in (setting.get("eos_token_id"), generation.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def mamba2_arch_config(config: dict[str, Any], generation: dict[str, Any],
                       stored_dtype: Callable[[], str]) -> ArchConfig:
    """The ArchConfig of a Mamba2ForCausalLM config.json. ValueError for a setting not implemented: hidden_act
    other than silu, a time_step_limit other than (0, inf) (HF clamps dt with it in the prefill scan only, not in
    its decode step), num_heads x head_dim != expand x hidden_size, num_heads not a multiple of n_groups.
    residual_in_fp32: the residual stream stays in the compute dtype (exact in float32); rescale_prenorm_residual
    and the time_step_min/max/floor/rank settings only shape initialisation, so they do not matter here."""
    setting = {**_DEFAULTS, **config}
    name = ARCHITECTURE
    check_mixer_settings(name, setting)
    heads, head_dim, hidden = int(setting["num_heads"]), int(setting["head_dim"]), int(setting["hidden_size"])
    if heads * head_dim != int(setting["expand"] * hidden):
        raise ValueError(f"{name}: num_heads x head_dim ({heads} x {head_dim}) must equal expand x hidden_size "
                         f"({setting['expand']} x {hidden})")
    if heads % int(setting["n_groups"]):
        raise ValueError(f"{name}: num_heads ({heads}) must be a multiple of n_groups ({setting['n_groups']})")
    mamba = MambaConfig(num_heads=heads, head_dim=head_dim, state_size=int(setting["state_size"]),
                        n_groups=int(setting["n_groups"]), conv_kernel=int(setting["conv_kernel"]),
                        chunk_size=int(setting["chunk_size"]), norm_eps=float(setting["layer_norm_epsilon"]),
                        conv_bias=bool(setting["use_conv_bias"]), bias=bool(setting["use_bias"]))
    # the attention fields say "no attention": one head of the hidden width, never built
    return ArchConfig(architecture=name, vocab_size=int(setting["vocab_size"]), hidden_size=hidden,
                      intermediate_size=mamba.intermediate_size, num_hidden_layers=int(setting["num_hidden_layers"]),
                      num_attention_heads=1, num_key_value_heads=1, head_dim=hidden,
                      rms_norm_eps=float(setting["layer_norm_epsilon"]), rope_theta=10000.0,
                      max_position_embeddings=int(setting.get("max_position_embeddings") or MAX_CONTEXT), tie_word_embeddings=bool(setting["tie_word_embeddings"]),
                      bos_token_id=setting["bos_token_id"], eos_token_ids=eos_token_ids(setting, generation),
                      checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or stored_dtype()),
                      mamba=mamba)
