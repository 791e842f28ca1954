"""Tiny random-weight HF checkpoints (Llama, Qwen2, Qwen3, Mistral) with the SmolLM2 tokenizer."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from tokenmill.models.loader.resolve import resolve_model_path
from tokenmill.models.loader.tokenizer import load_gguf_tokenizer

SMOLLM2_VOCAB_SIZE = 49152
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

_BASE_CONFIG: dict[str, Any] = {
    "vocab_size": SMOLLM2_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 512},
    "qwen2": {},
    "qwen3": {"head_dim": 32},  # != hidden / heads, as in real Qwen3 models
}


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The SmolLM2 tokenizer, converted from the packaged GGUF through tokenmill's cache."""
    return load_gguf_tokenizer(resolve_model_path(None))


def make_tiny_hf_model(
    dir: str | Path,
    arch: str = "llama",
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Save a tiny random model of `arch` (llama, mistral, qwen2, qwen3) and its tokenizer in `dir`.

    `config_overrides` go to the transformers config class (e.g. `tie_word_embeddings=True`,
    `rope_parameters=LLAMA3_ROPE_SCALING`); `sharded=True` writes several safetensors files and
    `model.safetensors.index.json`; `dtype` is the stored dtype. Weights are seeded, so repeated
    calls agree.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(dir)
    config = AutoConfig.for_model(arch, **{**_BASE_CONFIG, **_ARCH_CONFIG[arch], **config_overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, max_shard_size="1MB" if sharded else "10GB")
    smollm2_tokenizer().save_pretrained(path)
    return path
