"""vLLM's `--speculative-config` JSON, read into tokenmill's speculative flags (no torch)."""

from __future__ import annotations

import argparse
import json
from typing import Any

# vLLM's method names -> speculative_method
METHODS = {"ngram": "ngram", "draft_model": "draft", "eagle3": "eagle3", "mtp": "mtp", "deepseek_mtp": "mtp",
           "glm4_moe_mtp": "mtp"}
# JSON keys -> the SpeculativeConfig field each sets
KEYS = {"method": "speculative_method", "model": "draft_model", "num_speculative_tokens": "num_speculative_tokens",
        "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
        "quantization": "draft_quantization"}


def speculative_json(text: str) -> str:
    """--speculative-config's argparse type: the text when it is a JSON object (read fully later)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected JSON like '{{\"method\": \"eagle3\", \"model\": ..., "
                                         f"\"num_speculative_tokens\": 3}}', got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return text


def speculative_settings(value: Any) -> tuple[dict[str, Any], str]:
    """(SpeculativeConfig field -> value, the canonical JSON text) of a speculative_config given as JSON text
    or a dict; ValueError naming an unknown key or method, or a missing method."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"speculative_config is not JSON: {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
    value = dict(value)
    # vLLM's draft_tensor_parallel_size: the draft runs beside the target, on its one rank
    if value.pop("draft_tensor_parallel_size", 1) not in (1, None):
        raise ValueError("speculative_config draft_tensor_parallel_size must be 1: the draft runs on one rank")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config key {unknown[0]!r} is not supported; supported keys: "
                         f"{', '.join(KEYS)}, draft_tensor_parallel_size (1)")
    method = value.get("method")
    if method is None:
        raise ValueError(f"speculative_config needs a method ({', '.join(METHODS)})")
    if method not in METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported; supported: {', '.join(METHODS)}")
    settings = {KEYS[key]: item for key, item in value.items()}
    settings["speculative_method"] = METHODS[method]
    return settings, json.dumps(value, sort_keys=True)
