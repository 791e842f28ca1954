"""Read a Hugging Face `config.json` (+ `generation_config.json`) into an `ArchConfig`.

Keys missing from `config.json` take the defaults of the matching transformers config class.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Optional

from tokenmill.models.arch import ArchConfig, MLAConfig, MoEConfig, RopeScaling
from tokenmill.models.vision.config import VISION_ARCHITECTURES, vision_config_from_hf
from tokenmill.models.loader.hf_granite_hybrid import granite_hybrid_arch_config
from tokenmill.models.loader.hf_nemotron_h import nemotron_h_arch_config
from tokenmill.models.loader.hf_falcon_h1 import falcon_h1_arch_config
from tokenmill.models.loader.hf_mamba2 import mamba2_arch_config
from tokenmill.models.loader.hf_qwen3_next import qwen3_next_arch_config

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma2ForCausalLM",
    "DeepseekV2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "SmolLM3ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "GptOssForCausalLM",
    "Mamba2ForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "Llama4ForCausalLM",
    "Qwen3NextForCausalLM",
    "NemotronHForCausalLM",
    "FalconH1ForCausalLM",
)

# multimodal checkpoints whose text model alone is served: architecture -> what of theirs is not loaded
TEXT_PART_ARCHITECTURES = {
    "Llama4ForConditionalGeneration": "its vision tower (vision_model, multi_modal_projector)",
}

_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl_text": "Qwen2ForCausalLM",  # Qwen2-VL's decoder: Qwen2 with multimodal RoPE (mrope_section)
    "qwen2_5_vl_text": "Qwen2ForCausalLM",  # and Qwen2.5-VL's
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
}

# Defaults of transformers' LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config (v5).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "MistralForCausalLM": {
        "max_position_embeddings": 4096 * 32,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096, "head_dim": 128},
    "Gemma3ForCausalLM": {
        "vocab_size": 262_208, "max_position_embeddings": 131_072, "head_dim": 256, "bos_token_id": 2,
        "eos_token_id": 1, "tie_word_embeddings": True, "sliding_window": 4096, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    },
    "Gemma2ForCausalLM": {  # transformers' Gemma2Config
        "vocab_size": 256_000, "max_position_embeddings": 8192, "head_dim": 256, "bos_token_id": 2,
        "eos_token_id": 1, "tie_word_embeddings": True, "sliding_window": 4096, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    },
    "DeepseekV2ForCausalLM": {
        "vocab_size": 102_400, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "mlp_bias": False, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 0, "n_routed_experts": 64,
        "n_shared_experts": 2, "moe_intermediate_size": 1407, "num_experts_per_tok": None,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False,
    },
    "MixtralForCausalLM": {
        "vocab_size": 32000, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
        "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None, "num_experts_per_tok": 2,
    },
    "Qwen3MoeForCausalLM": {
        "vocab_size": 151_936, "max_position_embeddings": 32768, "sliding_window": 4096, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "SmolLM3ForCausalLM": {  # transformers' SmolLM3Config
        "vocab_size": 128_256, "max_position_embeddings": 32768, "bos_token_id": 128_000, "eos_token_id": 128_001,
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
        "no_rope_layer_interval": 4, "hidden_act": "silu", "mlp_bias": False,
    },
    "Phi3ForCausalLM": {  # transformers' Phi3Config
        "vocab_size": 32064, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 32000, "sliding_window": None, "hidden_act": "silu",
        "partial_rotary_factor": 1.0,
    },
    "Olmo2ForCausalLM": {  # transformers' Olmo2Config
        "vocab_size": 50304, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "eos_token_id": 50279,
        "hidden_act": "silu",
    },
    "Olmo3ForCausalLM": {  # transformers' Olmo3Config
        "vocab_size": 50304, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "eos_token_id": 50279,
        "hidden_act": "silu", "sliding_window": 4096,
    },
    "GptOssForCausalLM": {  # transformers' GptOssConfig (its rope_parameters default: _GPT_OSS_ROPE)
        "vocab_size": 201_088, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "head_dim": 64,
        "num_key_value_heads": 8, "sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "hidden_act": "silu",
        "rope_theta": 150_000.0,
    },
    "Llama4ForCausalLM": {  # transformers' Llama4TextConfig
        "vocab_size": 202_048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2, "num_experts_per_tok": 1, "num_local_experts": 16, "moe_layers": None,
        "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layers": None, "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
        "rope_theta": 500_000.0,
    },
    "OlmoeForCausalLM": {
        "vocab_size": 50304, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "eos_token_id": 50279,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None,
    },
    "Qwen2MoeForCausalLM": {
        "vocab_size": 151_936, "max_position_embeddings": 32768, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "qkv_bias": True, "use_sliding_window": False,
    },
    "DeepseekV3ForCausalLM": {
        "vocab_size": 129_280, "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1,
        "hidden_act": "silu", "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 3, "n_routed_experts": 256,
        "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "routed_scaling_factor": 2.5,
        "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "rope_interleave": True,
    },
    "Glm4MoeForCausalLM": {
        "vocab_size": 151_552, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
        "hidden_act": "silu", "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    },
}
_OLMO2_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")  # see _olmo2_fields
_HIDDEN_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# see _moe_fields: each one's expert count, its config key first (transformers maps num_experts and
# num_local_experts onto each other, and saves whichever the class stores)
_MOE_ARCHITECTURES = {"MixtralForCausalLM": ("num_local_experts", "num_experts", 8),
                      "Qwen3MoeForCausalLM": ("num_experts", "num_local_experts", 128),
                      "OlmoeForCausalLM": ("num_experts", "num_local_experts", 64),
                      "Qwen2MoeForCausalLM": ("num_experts", "num_local_experts", 60)}
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": None,
}


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _architecture(config: dict[str, Any]) -> str:
    declared = config.get("architectures") or []
    # a base model's own class (Qwen3Model: an embedding model's network) runs as its causal LM's decoder
    candidates = [*declared, _ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type"), "")]
    for name in candidates:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = declared or config.get("model_type")
    raise ValueError(
        f"unsupported model architecture {found!r}; supported: "
        f"{', '.join((*SUPPORTED_ARCHITECTURES, *VISION_ARCHITECTURES))}"
    )


def rope_scaling_from_hf(params: Optional[dict[str, Any]], max_position_embeddings: int = 0
                         ) -> Optional[RopeScaling]:
    """Translate HF `rope_scaling` / `rope_parameters` into a `RopeScaling` (None when unscaled)."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", "mrope"):  # mrope: Qwen2-VL's multimodal sections of unscaled frequencies
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        return _yarn_scaling(params, max_position_embeddings)
    if kind == "longrope":
        return _longrope_scaling(params, max_position_embeddings)
    raise ValueError(f"unsupported RoPE scaling type {kind!r}; supported: default, linear, llama3, yarn, longrope")


def _longrope_scaling(params: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """LongRoPE as transformers reads it: short and long per-frequency factors; a missing factor is
    max_position_embeddings over the original context, a missing attention_factor sqrt(1 + ln(factor) /
    ln(original)) (1 when the factor does not stretch)."""
    original = int(params.get("original_max_position_embeddings") or 0)
    if original <= 0:
        raise ValueError("longrope RoPE scaling needs original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        if not isinstance(params.get(key), list):
            raise ValueError(f"longrope RoPE scaling needs {key}, a list of numbers")
    factor = float(params.get("factor") or max_position_embeddings / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(kind="longrope", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention_factor),
                       short_factor=tuple(float(f) for f in params["short_factor"]),
                       long_factor=tuple(float(f) for f in params["long_factor"]))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaling(params: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """YaRN as transformers reads it: a missing factor is max_position_embeddings over the original
    context; a missing attention_factor is mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are given, else mscale(factor)."""
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    if original <= 0:
        raise ValueError("yarn RoPE scaling needs original_max_position_embeddings")
    factor = float(params.get("factor") or max_position_embeddings / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       attention_factor=float(attention_factor), truncate=bool(params.get("truncate", True)))


def _token_ids(*values: Any) -> tuple[int, ...]:
    """Merge int / list / None token-id settings into one ordered tuple without duplicates."""
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _sliding_window(architecture: str, setting: dict[str, Any]) -> Optional[int]:
    if architecture in ("MistralForCausalLM", "Gemma3ForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM",
                        "Olmo3ForCausalLM", "Phi3ForCausalLM", "GptOssForCausalLM"):
        return setting["sliding_window"]
    qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if (qwen or architecture == "SmolLM3ForCausalLM") and setting.get("use_sliding_window"):
        return setting["sliding_window"]
    return None


def _hidden_act(setting: dict[str, Any], key: str) -> str:
    """The gate activation named by config key `key`, as ArchConfig spells it (ValueError if unsupported)."""
    act = setting[key]
    if act not in _HIDDEN_ACTIVATIONS:
        raise ValueError(f"unsupported {key} {act!r}; supported: {', '.join(_HIDDEN_ACTIVATIONS)}")
    return _HIDDEN_ACTIVATIONS[act]


def _global_rope(params: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of full-attention layers (Gemma 3 keeps one dict per layer type)."""
    return params.get("full_attention", params)


def _gemma3_fields(setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's ArchConfig fields beyond the Llama ones (transformers' Gemma3TextConfig)."""
    for unsupported in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if setting.get(unsupported):
            raise ValueError(f"Gemma3ForCausalLM with {unsupported}={setting[unsupported]!r} is not supported")
    layers = setting["num_hidden_layers"]
    pattern = setting.get("sliding_window_pattern", 6)
    layer_types = setting.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    local = rope_params.get("sliding_attention", {}).get("rope_theta", setting["rope_local_base_freq"])
    return dict(
        layer_types=tuple(layer_types), rope_local_theta=float(local),
        hidden_act=_hidden_act(setting, "hidden_activation"),
        norm_weight_offset=1.0, sandwich_norms=True, embedding_scale=float(setting["hidden_size"]) ** 0.5,
        attention_scale=float(setting["query_pre_attn_scalar"]) ** -0.5,
        final_logit_softcap=setting.get("final_logit_softcapping"),
    )


def _gemma2_fields(setting: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's ArchConfig fields beyond the Llama ones (transformers' Gemma2Config): Gemma 3's norms, GeGLU,
    scaled embeddings and final soft cap, one RoPE base for every layer, sliding layers alternating with full
    ones (the first sliding), and the attention scores soft-capped (attn_logit_softcapping) on every layer."""
    if setting.get("use_bidirectional_attention"):
        raise ValueError("Gemma2ForCausalLM with use_bidirectional_attention=True is not supported")
    layers = setting["num_hidden_layers"]
    layer_types = setting.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    attn_cap, final_cap = setting.get("attn_logit_softcapping"), setting.get("final_logit_softcapping")
    return dict(
        layer_types=tuple(layer_types), hidden_act=_hidden_act(setting, "hidden_activation"),
        norm_weight_offset=1.0, sandwich_norms=True, embedding_scale=float(setting["hidden_size"]) ** 0.5,
        attention_scale=float(setting["query_pre_attn_scalar"]) ** -0.5,
        final_logit_softcap=float(final_cap) if final_cap else None,
        attn_logit_softcap=float(attn_cap) if attn_cap else None,
    )


def _smollm3_fields(setting: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's ArchConfig fields beyond the Llama ones (transformers' SmolLM3Config): its NoPE layers, those
    where `no_rope_layers` holds 0 (a 1 is a layer WITH RoPE; default: every no_rope_layer_interval-th layer
    has none), and the sliding windows of layer_types when use_sliding_window."""
    name, layers = "SmolLM3ForCausalLM", setting["num_hidden_layers"]
    if setting.get("mlp_bias"):
        raise ValueError(f"{name} with mlp_bias=True is not supported")
    if _hidden_act(setting, "hidden_act") != "silu":
        raise ValueError(f"{name} with hidden_act={setting['hidden_act']!r} is not supported; supported: 'silu'")
    interval = setting["no_rope_layer_interval"]
    uses_rope = setting.get("no_rope_layers")
    if uses_rope is None:
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{name} with no_rope_layer_interval={interval!r} is not supported")
        uses_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(uses_rope) != layers:
        raise ValueError(f"{name}: no_rope_layers lists {len(uses_rope)} layers but num_hidden_layers is {layers}")
    fields: dict[str, Any] = {"no_rope_layers": frozenset(i for i, rope in enumerate(uses_rope) if not rope)}
    if setting.get("use_sliding_window") and setting.get("sliding_window"):
        fields["layer_types"] = tuple(setting.get("layer_types") or (
            "full_attention" if uses_rope[i] else "sliding_attention" for i in range(layers)))
    return fields


def _olmo2_fields(architecture: str, setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """OLMo 2's and OLMo 3's ArchConfig fields beyond the Llama ones (transformers' Olmo2Config / Olmo3Config):
    norms after attention and MLP only (post_norms), the q/k norm over the whole projections; OLMo 3's sliding
    layers (layer_types; default three sliding to one full), whose RoPE is sliding_attention's unscaled one
    while the full layers take full_attention's (and its scaling)."""
    if setting.get("clip_qkv") is not None:
        raise ValueError(f"{architecture} with clip_qkv={setting['clip_qkv']!r} is not supported")
    if _hidden_act(setting, "hidden_act") != "silu":
        raise ValueError(f"{architecture} with hidden_act={setting['hidden_act']!r} is not supported; supported: 'silu'")
    fields: dict[str, Any] = dict(post_norms=True, qk_norm_per_head=False)  # (qk_norm: arch_config_from_hf_dict)
    if architecture == "Olmo3ForCausalLM":
        layers = setting["num_hidden_layers"]
        fields["layer_types"] = tuple(setting.get("layer_types") or (
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)))
        local = rope_params.get("sliding_attention", {})
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{architecture} with a {kind!r} RoPE on its sliding layers is not supported; "
                             "supported: 'default'")
        fields["rope_local_theta"] = float(local.get("rope_theta", _global_rope(rope_params).get(
            "rope_theta", setting["rope_theta"])))
    return fields


def _phi3_rope(setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's RoPE parameters as transformers' Phi3Config normalises them: types "su" and "yarn" are its
    LongRoPE, and original_max_position_embeddings and partial_rotary_factor may sit at the config's top level."""
    params = dict(rope_params)
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"
    params.setdefault("original_max_position_embeddings", setting["original_max_position_embeddings"])
    params.setdefault("partial_rotary_factor", setting["partial_rotary_factor"])
    return params


def _phi3_fields(setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's ArchConfig fields beyond the Llama ones (transformers' Phi3Config): RoPE on the first
    partial_rotary_factor of each head (Phi-4-mini); the fused qkv_proj and gate_up_proj tensors are split as
    they load (models/loader/fused_tensors.py), LongRoPE is rope_scaling_from_hf's."""
    if _hidden_act(setting, "hidden_act") != "silu":
        raise ValueError(f"Phi3ForCausalLM with hidden_act={setting['hidden_act']!r} is not supported; supported: 'silu'")
    return dict(rotary_dim=_rotary_dim("Phi3ForCausalLM", setting, float(rope_params["partial_rotary_factor"])))


def _yarn_mscale_squared(params: dict[str, Any]) -> float:
    """What transformers' DeepSeek-V2 multiplies its softmax scale by (yarn_apply_mscale): mscale(factor,
    mscale_all_dim) squared for a scaled RoPE with `mscale_all_dim`, else 1."""
    kind = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if kind == "default" or not mscale_all_dim:
        return 1.0
    return yarn_mscale(float(params.get("factor", 1.0)), mscale_all_dim) ** 2


def _deepseek_v2_moe(setting: dict[str, Any]) -> Optional[MoEConfig]:
    """DeepSeek-V2's sparse layers (those from first_k_dense_replace on), None when every layer is dense.
    Routing as transformers' DeepseekV2TopkRouter: softmax, greedy top k, times routed_scaling_factor."""
    layers, name = setting["num_hidden_layers"], "DeepseekV2ForCausalLM"
    dense = min(int(setting["first_k_dense_replace"]), layers)
    if setting["n_routed_experts"] is None or dense == layers:
        return None
    # norm_topk_prob: transformers ignores it, DeepSeek's own code renormalises (and then does not scale)
    for key, supported in (("topk_method", "greedy"), ("scoring_func", "softmax"), ("moe_layer_freq", 1),
                           ("norm_topk_prob", False)):
        value = setting.get(key)
        if value is not None and value != supported:
            raise ValueError(f"{name} with {key}={value!r} is not supported; supported: {supported!r}")
    if not setting["num_experts_per_tok"]:
        raise ValueError(f"{name} with sparse layers needs num_experts_per_tok")
    size = int(setting["moe_intermediate_size"])
    return MoEConfig(num_experts=int(setting["n_routed_experts"]), top_k=int(setting["num_experts_per_tok"]),
                     intermediate_size=size, norm_topk_prob=False,
                     routed_scaling_factor=float(setting["routed_scaling_factor"]),
                     shared_intermediate_size=int(setting["n_shared_experts"] or 0) * size,
                     dense_layers=frozenset(range(dense)))


def _deepseek_v2_fields(setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's ArchConfig fields beyond the Llama ones (transformers' DeepseekV2Config): multi-head
    latent attention, its softmax scale (qk_nope + qk_rope) ** -0.5 (times yarn's mscale squared), the MoE."""
    return {**_mla_fields("DeepseekV2ForCausalLM", setting, rope_params), "moe": _deepseek_v2_moe(setting)}


def _mla_fields(name: str, setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's ArchConfig fields (DeepSeek-V2 and V3): the MLAConfig, the activation, the
    softmax scale (qk_nope + qk_rope) ** -0.5 times yarn's mscale squared."""
    if setting.get("mlp_bias"):
        raise ValueError(f"{name} with mlp_bias=True is not supported")
    q_lora_rank = setting["q_lora_rank"]
    mla = MLAConfig(kv_lora_rank=int(setting["kv_lora_rank"]), qk_nope_head_dim=int(setting["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(setting["qk_rope_head_dim"]), v_head_dim=int(setting["v_head_dim"]),
                    q_lora_rank=None if q_lora_rank is None else int(q_lora_rank))
    qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return dict(mla=mla, hidden_act=_hidden_act(setting, "hidden_act"),
                attention_scale=qk_head_dim ** -0.5 * _yarn_mscale_squared(_global_rope(rope_params)))


def _deepseek_v3_fields(setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's ArchConfig fields (transformers' DeepseekV3Config): DeepSeek-V2's multi-head latent
    attention (its RoPE pairs interleaved, which MLAAttention de-interleaves as it loads) and the sigmoid
    noaux_tc MoE."""
    name = "DeepseekV3ForCausalLM"
    if setting["rope_interleave"] is not True:
        raise ValueError(f"{name} with rope_interleave={setting['rope_interleave']!r} is not supported; supported: True")
    for key, supported in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        value = setting.get(key)  # (transformers reads neither: its router is always noaux_tc)
        if value is not None and value != supported:
            raise ValueError(f"{name} with {key}={value!r} is not supported; supported: {supported!r}")
    _log_dropped_mtp_layers(name, setting)
    return {**_mla_fields(name, setting, rope_params), "moe": _noaux_tc_moe(name, setting)}


def _glm4_moe_fields(setting: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's ArchConfig fields beyond the Llama ones (transformers' Glm4MoeConfig): the noaux_tc MoE of
    DeepSeek-V3, partial RoPE (int(head_dim * partial_rotary_factor) dims of each head, the factor read from
    rope_parameters or the top level, 0.5 by default), the per-head q/k norm when use_qk_norm, the SwiGLU
    activation (silu only)."""
    name = "Glm4MoeForCausalLM"
    factor = float(rope_params.get("partial_rotary_factor", setting["partial_rotary_factor"]))
    _log_dropped_mtp_layers(name, setting)
    return dict(moe=_noaux_tc_moe(name, setting), hidden_act=_hidden_act(setting, "hidden_act"),
                rotary_dim=_rotary_dim(name, setting, factor))


_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss_fields(setting: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's ArchConfig fields beyond the Llama ones (transformers' GptOssConfig): attention sinks on every
    layer, sliding layers alternating with full ones (the first sliding) unless layer_types says otherwise,
    biased q/k/v/o projections (attention_bias), and every layer a MoE of num_local_experts biased experts with
    the clamped SwiGLU, routed by the top k of biased router logits then a softmax over those k."""
    name = "GptOssForCausalLM"
    act = setting["hidden_act"]
    if act != "silu":
        raise ValueError(f"{name} with hidden_act={act!r} is not supported; supported: 'silu' (its clamped SwiGLU)")
    layers = setting["num_hidden_layers"]
    layer_types = setting.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    experts, top_k = int(setting["num_local_experts"]), int(setting["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ValueError(f"{name} with num_experts_per_tok={top_k} of {experts} experts is not supported")
    limit = setting["swiglu_limit"]
    if limit is None or float(limit) <= 0:
        raise ValueError(f"{name} with swiglu_limit={limit!r} is not supported: a positive limit is needed")
    moe = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=int(setting["intermediate_size"]),
                    norm_topk_prob=True, scoring="topk_softmax", router_bias=True, swiglu_limit=float(limit),
                    swiglu_alpha=float(setting["swiglu_alpha"]))
    return dict(layer_types=tuple(layer_types), attention_sinks=True, moe=moe)


def _llama4_fields(setting: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's ArchConfig fields beyond the Llama ones (transformers' Llama4TextConfig / Llama4TextModel):
    - NoPE layers where `no_rope_layers` holds 0 (a 1 is a layer WITH RoPE; empty or absent: every
      no_rope_layer_interval-th layer has none), the others chunked local attention of attention_chunk_size
      positions (layer_types, as transformers derives it);
    - use_qk_norm: q and k L2-normed after RoPE on the RoPE layers; attn_temperature_tuning: the NoPE layers' q
      scaled by position (floor_scale, attn_scale);
    - experts on `moe_layers` (default every interleave_moe_layer_step-th layer): top num_experts_per_tok by
      logit, sigmoid weights scaling the experts' input, plus one shared expert, all of width intermediate_size;
      the other layers a dense MLP of intermediate_size_mlp (the model's intermediate_size here)."""
    name, layers = "Llama4ForCausalLM", setting["num_hidden_layers"]
    if _hidden_act(setting, "hidden_act") != "silu":
        raise ValueError(f"{name} with hidden_act={setting['hidden_act']!r} is not supported; supported: 'silu'")
    uses_rope = setting.get("no_rope_layers") or None
    if uses_rope is None:
        interval = setting["no_rope_layer_interval"]
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{name} with no_rope_layer_interval={interval!r} is not supported")
        uses_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(uses_rope) < layers or any(flag not in (0, 1) for flag in uses_rope):
        raise ValueError(f"{name} with no_rope_layers={uses_rope!r} is not supported: one 0 (NoPE) or 1 (RoPE) per "
                         f"layer of the {layers} is needed")
    chunk = setting["attention_chunk_size"]
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{name} with attention_chunk_size={chunk!r} is not supported: a positive int or null")
    layer_types = setting.get("layer_types") or [
        "chunked_attention" if uses_rope[i] and chunk is not None else "full_attention" for i in range(layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "chunked_attention"})
    if unknown:
        raise ValueError(f"{name} with layer_types {unknown} is not supported; supported: full_attention, "
                         "chunked_attention")
    floor_scale = setting["floor_scale"]
    tuning = bool(setting["attn_temperature_tuning"])
    if tuning and not (isinstance(floor_scale, (int, float)) and floor_scale > 0):
        raise ValueError(f"{name} with floor_scale={floor_scale!r} is not supported: a positive number is needed")
    return dict(layer_types=tuple(layer_types),
                attention_chunk_size=chunk if "chunked_attention" in layer_types else None,
                no_rope_layers=frozenset(i for i in range(layers) if not uses_rope[i]),
                qk_l2_norm=bool(setting["use_qk_norm"]),
                nope_query_temperature=(float(floor_scale), float(setting["attn_scale"])) if tuning else None,
                moe=_llama4_moe(name, setting))


def _llama4_moe(name: str, setting: dict[str, Any]) -> Optional[MoEConfig]:
    """Llama 4's experts (`_llama4_fields`), None when no layer has them."""
    layers = setting["num_hidden_layers"]
    moe_layers = setting.get("moe_layers")
    if moe_layers is None:
        step = setting["interleave_moe_layer_step"]
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"{name} with interleave_moe_layer_step={step!r} is not supported")
        moe_layers = range(step - 1, layers, step)
    sparse = {int(i) for i in moe_layers if 0 <= int(i) < layers}
    if not sparse:
        return None
    experts, top_k = int(setting["num_local_experts"]), int(setting["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ValueError(f"{name} with num_experts_per_tok={top_k} of {experts} experts is not supported")
    width = int(setting["expert_intermediate_size"])
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=width, norm_topk_prob=False,
                     shared_intermediate_size=width, dense_layers=frozenset(set(range(layers)) - sparse),
                     scoring="sigmoid_input")


def _rotary_dim(name: str, setting: dict[str, Any], factor: float) -> Optional[int]:
    """ArchConfig.rotary_dim for a partial_rotary_factor: int(head_dim * factor) dims of each head, as
    transformers turns them (None: the whole head); ValueError naming a factor that turns an odd number or none."""
    head_dim = setting.get("head_dim") or setting["hidden_size"] // setting["num_attention_heads"]
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"{name} with partial_rotary_factor={factor} is not supported: it turns {rotary_dim} of "
                         f"the head's {head_dim} dims (an even number above 0 is needed)")
    return None if rotary_dim == head_dim else rotary_dim


def _qk_norm(architecture: str, setting: dict[str, Any]) -> bool:
    """Whether q and k are RMS-normed before RoPE: always for Qwen3, Gemma 3, Qwen3-MoE, OLMoE and OLMo 2/3; for
    GLM-4.5 where use_qk_norm."""
    if architecture == "Glm4MoeForCausalLM":
        return bool(setting["use_qk_norm"])
    return architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                            *_OLMO2_ARCHITECTURES)


def _noaux_tc_moe(name: str, setting: dict[str, Any]) -> Optional[MoEConfig]:
    """The sparse layers (from first_k_dense_replace on) of DeepSeek-V3 and GLM-4.5, None when every layer is
    dense: sigmoid scores, top k within the topk_group best of n_group groups by score + correction bias
    (transformers' DeepseekV3TopkRouter), renormalised when norm_topk_prob, times routed_scaling_factor, plus
    n_shared_experts fused into one shared expert."""
    layers = setting["num_hidden_layers"]
    dense = min(int(setting["first_k_dense_replace"] or 0), layers)
    experts = setting["n_routed_experts"]
    if not experts or dense == layers:
        return None
    freq = setting.get("moe_layer_freq")
    if freq is not None and freq != 1:
        raise ValueError(f"{name} with moe_layer_freq={freq!r} is not supported; supported: 1")
    top_k, groups, kept = setting["num_experts_per_tok"], int(setting["n_group"] or 1), int(setting["topk_group"] or 1)
    if groups < 1 or experts % groups or experts // groups < 2:  # transformers sums each group's best two
        raise ValueError(f"{name} with n_group={groups} is not supported: {experts} experts must split into "
                         "equal groups of at least 2")
    if not 0 < kept <= groups:
        raise ValueError(f"{name} with topk_group={kept} of n_group={groups} is not supported")
    if not top_k or not 0 < top_k <= kept * (experts // groups):
        raise ValueError(f"{name} with num_experts_per_tok={top_k!r} is not supported: it must be between 1 and "
                         f"the {kept * (experts // groups)} experts of the topk_group={kept} groups kept")
    size = int(setting["moe_intermediate_size"])
    return MoEConfig(num_experts=int(experts), top_k=int(top_k), intermediate_size=size,
                     norm_topk_prob=bool(setting["norm_topk_prob"]),
                     routed_scaling_factor=float(setting["routed_scaling_factor"]),
                     shared_intermediate_size=int(setting["n_shared_experts"] or 0) * size,
                     dense_layers=frozenset(range(dense)), scoring="sigmoid", num_groups=groups, topk_groups=kept)


def _log_dropped_mtp_layers(name: str, setting: dict[str, Any]) -> None:
    """Say that the checkpoint's multi-token prediction layers (num_nextn_predict_layers, stored as layers
    num_hidden_layers and on) are not loaded: the decoder skips tensors of layers it does not have."""
    count = setting.get("num_nextn_predict_layers", setting.get("num_mtp_layers")) or 0
    if count:
        logger.info("%s: its %d multi-token prediction layer(s) (num_nextn_predict_layers) are not loaded as "
                    "decoder layers (speculative_method 'mtp' drafts with the first)", name, count)


def _moe_fields(architecture: str, setting: dict[str, Any]) -> dict[str, Any]:
    """The mixture of experts of Mixtral / Qwen3-MoE / OLMoE / Qwen2-MoE (transformers' MixtralSparseMoeBlock,
    Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock, Qwen2MoeSparseMoeBlock), and OLMoE's q/k norm over the whole
    projections."""
    act = setting.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{architecture} with hidden_act={act!r} is not supported; supported: 'silu' (SwiGLU experts)")
    fields: dict[str, Any] = {}
    key, alias, default = _MOE_ARCHITECTURES[architecture]
    num_experts = next((setting[k] for k in (key, alias) if setting.get(k) is not None), default)
    if architecture == "MixtralForCausalLM":  # every layer sparse; the top k always renormalised
        width, normalize, dense = setting["intermediate_size"], True, ()
    elif architecture in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        # sparse every decoder_sparse_step-th layer, except mlp_only_layers
        if architecture == "Qwen2MoeForCausalLM" and setting["use_sliding_window"]:
            # (its window layers follow a pattern of their own: every other layer below max_window_layers)
            raise ValueError(f"{architecture} with use_sliding_window=True is not supported")
        width = setting["moe_intermediate_size"]
        normalize, step = bool(setting["norm_topk_prob"]), setting["decoder_sparse_step"]
        if step < 1:
            raise ValueError(f"{architecture} with decoder_sparse_step={step!r} is not supported")
        only_dense = set(setting.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(setting["num_hidden_layers"]) if i in only_dense or (i + 1) % step)
    else:  # OLMoE: every layer sparse
        if setting.get("clip_qkv") is not None:
            raise ValueError(f"{architecture} with clip_qkv={setting['clip_qkv']!r} is not supported")
        width, normalize, dense = setting["intermediate_size"], bool(setting["norm_topk_prob"]), ()
        fields["qk_norm_per_head"] = False
    top_k = setting["num_experts_per_tok"]
    if num_experts and not 0 < top_k <= num_experts:
        raise ValueError(f"{architecture} with num_experts_per_tok={top_k} of {num_experts} experts is not supported")
    if num_experts:  # (a Qwen3-MoE without experts is a dense model)
        fields["moe"] = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=width,
                                  norm_topk_prob=normalize, dense_layers=frozenset(dense),
                                  **(_qwen2_moe_shared_expert(setting) if architecture == "Qwen2MoeForCausalLM" else {}))
    return fields


def _qwen2_moe_shared_expert(setting: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE's MoEConfig fields beyond Qwen3-MoE's: its one shared expert, scaled by a sigmoid gate
    (transformers' Qwen2MoeSparseMoeBlock always has both)."""
    width = setting["shared_expert_intermediate_size"]
    if not width or width < 0:
        raise ValueError(f"Qwen2MoeForCausalLM with shared_expert_intermediate_size={width!r} is not supported")
    return dict(shared_intermediate_size=int(width), shared_expert_gate=True)


def _qkv_bias(architecture: str, setting: dict[str, Any]) -> bool:
    """Whether the q, k and v projections have a bias: always for Qwen2; `qkv_bias` for Qwen2-MoE; else
    `attention_bias`."""
    if architecture == "Qwen2MoeForCausalLM":
        return bool(setting["qkv_bias"])
    return architecture == "Qwen2ForCausalLM" or bool(setting["attention_bias"])


def _output_bias(architecture: str, setting: dict[str, Any]) -> bool:
    """Whether the attention's output projection has a bias: `attention_bias` except for the families whose
    o_proj never has one (Qwen2, Qwen2-MoE, GLM-4.5)."""
    return (architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM")
            and bool(setting["attention_bias"]))


def arch_config_from_hf(
    folder: str | Path, stored_dtype: Callable[[], str] = lambda: "float32"
) -> ArchConfig:
    """Build the `ArchConfig` of the HF checkpoint folder `folder`.

    `checkpoint_dtype` is taken from `dtype` / `torch_dtype`; when neither is set, `stored_dtype()`
    is asked for the dtype the weights actually have.
    """
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    text_part = served_text_part(config)
    if text_part is not None:
        logger.info("%s: serving its text model only (%s); %s is not loaded, and requests with images are refused",
                    folder, text_part, TEXT_PART_ARCHITECTURES[text_part])
        return arch_config_from_hf_dict(text_settings(config), folder, stored_dtype)
    if is_vision_language(config):
        config = normalized_vision_language_config(folder, config)
        text = text_settings(config)
        arch = arch_config_from_hf_dict(text, folder, stored_dtype)
        section = (text.get("rope_parameters") or text.get("rope_scaling") or {}).get("mrope_section")
        return dataclasses.replace(arch, vision=vision_config_from_hf(config, arch.hidden_size),
                                   mrope_section=tuple(section) if section else None)
    return arch_config_from_hf_dict(config, folder, stored_dtype)


def normalized_vision_language_config(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config` with complete `text_config` and `vision_config` dicts, as transformers' own config class reads
    the folder: it fills what the file leaves to defaults (llava-hf's text_config names only a few fields) and
    moves the decoder's settings of older, flat files (Qwen2-VL saved by transformers 4) into text_config."""
    from transformers import AutoConfig

    try:
        loaded = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{folder}: transformers cannot read this vision-language config.json: {exc}") from exc
    return {**config, "text_config": loaded.get_text_config().to_dict(), "vision_config": loaded.vision_config.to_dict()}


def served_text_part(config: dict[str, Any]) -> Optional[str]:
    """The architecture of a multimodal `config` (a config.json) whose text model alone tokenmill serves
    (TEXT_PART_ARCHITECTURES), or None. ValueError when it has no text_config."""
    found = next((name for name in config.get("architectures") or () if name in TEXT_PART_ARCHITECTURES), None)
    if found is not None and not isinstance(config.get("text_config"), dict):
        raise ValueError(f"{found} config.json has no text_config")
    return found


def is_vision_language(config: dict[str, Any]) -> bool:
    """Whether `config` (a config.json) is of a vision-language model tokenmill runs."""
    return any(name in VISION_ARCHITECTURES for name in config.get("architectures") or ())


def text_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A (normalised) vision-language config's decoder settings: its text_config, with what the model keeps at
    the top level (dtype, tied embeddings, the EOS id) where text_config lacks it."""
    text = dict(config["text_config"])
    text.pop("architectures", None)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if text.get(key) is None and config.get(key) is not None:
            text[key] = config[key]
    return text


def arch_config_from_hf_dict(config: dict[str, Any], folder: Path,
                             stored_dtype: Callable[[], str] = lambda: "float32") -> ArchConfig:
    """The `ArchConfig` of decoder settings `config` (a config.json's, or a vision-language model's
    text_config) in checkpoint folder `folder`."""
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else {}

    architecture = _architecture(config)
    if architecture == "Mamba2ForCausalLM":  # no attention: its own settings (loader/hf_mamba2.py)
        return mamba2_arch_config(config, generation, stored_dtype)
    if architecture == "GraniteMoeHybridForCausalLM":  # Mamba2 and attention layers (loader/hf_granite_hybrid.py)
        return granite_hybrid_arch_config(config, generation, stored_dtype)
    if architecture == "Qwen3NextForCausalLM":  # Gated DeltaNet and gated attention layers (loader/hf_qwen3_next.py)
        return qwen3_next_arch_config(config, generation, stored_dtype)
    if architecture == "NemotronHForCausalLM":  # Mamba2, attention and MLP blocks (loader/hf_nemotron_h.py)
        return nemotron_h_arch_config(config, generation, stored_dtype)
    if architecture == "FalconH1ForCausalLM":  # Mamba2 beside attention in every layer (loader/hf_falcon_h1.py)
        return falcon_h1_arch_config(config, generation, stored_dtype)
    setting = {**_COMMON_DEFAULTS, **_DEFAULTS[architecture], **config}
    # MLA: HF's head_dim is the RoPE part; ours, the q/k head width
    if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        setting["head_dim"] = setting["qk_nope_head_dim"] + setting["qk_rope_head_dim"]
    rope_params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if architecture == "Phi3ForCausalLM":
        rope_params = _phi3_rope(setting, rope_params)
    if architecture == "GptOssForCausalLM" and not rope_params:
        rope_params = _GPT_OSS_ROPE  # what transformers' GptOssConfig fills in
    if architecture == "Llama4ForCausalLM":  # dense layers are intermediate_size_mlp wide, the experts intermediate_size
        setting["expert_intermediate_size"] = setting["intermediate_size"]
        setting["intermediate_size"] = setting["intermediate_size_mlp"]
    num_heads = setting["num_attention_heads"]
    bos_token_id = setting["bos_token_id"]
    if bos_token_id is None:
        bos_token_id = generation.get("bos_token_id")

    return ArchConfig(
        **(_gemma3_fields(setting, rope_params) if architecture == "Gemma3ForCausalLM" else {}),
        **(_gemma2_fields(setting) if architecture == "Gemma2ForCausalLM" else {}),
        **(_smollm3_fields(setting) if architecture == "SmolLM3ForCausalLM" else {}),
        **(_phi3_fields(setting, rope_params) if architecture == "Phi3ForCausalLM" else {}),
        **(_olmo2_fields(architecture, setting, rope_params) if architecture in _OLMO2_ARCHITECTURES else {}),
        **(_deepseek_v2_fields(setting, rope_params) if architecture == "DeepseekV2ForCausalLM" else {}),
        **(_deepseek_v3_fields(setting, rope_params) if architecture == "DeepseekV3ForCausalLM" else {}),
        **(_glm4_moe_fields(setting, rope_params) if architecture == "Glm4MoeForCausalLM" else {}),
        **(_gpt_oss_fields(setting) if architecture == "GptOssForCausalLM" else {}),
        **(_llama4_fields(setting) if architecture == "Llama4ForCausalLM" else {}),
        **(_moe_fields(architecture, setting) if architecture in _MOE_ARCHITECTURES else {}),
        architecture=architecture,
        vocab_size=setting["vocab_size"],
        hidden_size=setting["hidden_size"],
        intermediate_size=setting["intermediate_size"],
        num_hidden_layers=setting["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=setting.get("num_key_value_heads") or num_heads,
        head_dim=setting.get("head_dim") or setting["hidden_size"] // num_heads,
        rms_norm_eps=float(setting["rms_norm_eps"]),
        rope_theta=float(_global_rope(rope_params).get("rope_theta", setting["rope_theta"])),
        max_position_embeddings=setting["max_position_embeddings"],
        tie_word_embeddings=bool(setting["tie_word_embeddings"]),
        attention_bias=_qkv_bias(architecture, setting),
        attention_out_bias=_output_bias(architecture, setting),
        qk_norm=_qk_norm(architecture, setting),
        rope_scaling=rope_scaling_from_hf(_global_rope(rope_params), setting["max_position_embeddings"]),
        sliding_window=_sliding_window(architecture, setting),
        bos_token_id=bos_token_id,
        eos_token_ids=_token_ids(setting["eos_token_id"], generation.get("eos_token_id")),
        checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or stored_dtype()),
    )
