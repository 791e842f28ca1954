"""Read a Hugging Face `config.json` (+ `generation_config.json`) into an `ArchConfig`.

Keys missing from `config.json` take the defaults of the matching transformers config class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

from tokenmill.models.arch import ArchConfig, RopeScaling

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
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
}
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
    candidates = list(declared) or [_ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type"), "")]
    for name in candidates:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = declared or config.get("model_type")
    raise ValueError(
        f"unsupported model architecture {found!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def rope_scaling_from_hf(params: Optional[dict[str, Any]]) -> Optional[RopeScaling]:
    """Translate HF `rope_scaling` / `rope_parameters` into a `RopeScaling` (None when unscaled)."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
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
    raise ValueError(f"unsupported RoPE scaling type {kind!r}; supported: default, linear, llama3")


def _token_ids(*values: Any) -> tuple[int, ...]:
    """Merge int / list / None token-id settings into one ordered tuple without duplicates."""
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _sliding_window(architecture: str, setting: dict[str, Any]) -> Optional[int]:
    if architecture == "MistralForCausalLM":
        return setting["sliding_window"]
    qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if qwen and setting.get("use_sliding_window"):
        return setting["sliding_window"]
    return None


def arch_config_from_hf(
    folder: str | Path, stored_dtype: Callable[[], str] = lambda: "float32"
) -> ArchConfig:
    """Build the `ArchConfig` of the HF checkpoint folder `folder`.

    `checkpoint_dtype` is taken from `dtype` / `torch_dtype`; when neither is set, `stored_dtype()`
    is asked for the dtype the weights actually have.
    """
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else {}

    architecture = _architecture(config)
    setting = {**_COMMON_DEFAULTS, **_DEFAULTS[architecture], **config}
    rope_params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    num_heads = setting["num_attention_heads"]
    bos_token_id = setting["bos_token_id"]
    if bos_token_id is None:
        bos_token_id = generation.get("bos_token_id")

    return ArchConfig(
        architecture=architecture,
        vocab_size=setting["vocab_size"],
        hidden_size=setting["hidden_size"],
        intermediate_size=setting["intermediate_size"],
        num_hidden_layers=setting["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=setting.get("num_key_value_heads") or num_heads,
        head_dim=setting.get("head_dim") or setting["hidden_size"] // num_heads,
        rms_norm_eps=float(setting["rms_norm_eps"]),
        rope_theta=float(rope_params.get("rope_theta", setting["rope_theta"])),
        max_position_embeddings=setting["max_position_embeddings"],
        tie_word_embeddings=bool(setting["tie_word_embeddings"]),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(setting["attention_bias"]),
        qk_norm=architecture == "Qwen3ForCausalLM",
        rope_scaling=rope_scaling_from_hf(rope_params),
        sliding_window=_sliding_window(architecture, setting),
        bos_token_id=bos_token_id,
        eos_token_ids=_token_ids(setting["eos_token_id"], generation.get("eos_token_id")),
        checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or stored_dtype()),
    )
