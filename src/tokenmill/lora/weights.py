"""A PEFT adapter's tensors (`adapter_model.safetensors`), by decoder layer and projection."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from tokenmill.lora.adapter_config import TARGET_MODULES, AdapterConfig

WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (the adapter's own name,
# e.g. ".default", is dropped when saved)
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")

# (layer, projection) -> (A [r, in], B [out, r])
AdapterTensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(arch: Any) -> dict[str, tuple[int, int]]:
    """(out, in) features of each projection an adapter may target, from the model's ArchConfig."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    hidden, width = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}


def read_adapter(folder: str, config: AdapterConfig, shapes: dict[str, tuple[int, int]], num_layers: int,
                 shapes_only: bool = False) -> Optional[AdapterTensors]:
    """The adapter's A and B of every projection it targets (None with `shapes_only`, which only checks).
    `shapes`: each projection's (out, in) features in the base model. ValueError naming a tensor that does
    not fit the model: an unknown name, a layer past `num_layers`, a shape or rank that differs."""
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"no LoRA adapter weights at {folder!r}: {WEIGHTS_FILE} not found")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path), "pt") as tensors:
        for name in tensors.keys():
            match = _NAME.search(name)
            if match is None or match.group(2) not in TARGET_MODULES:
                raise ValueError(f"{folder}: adapter tensor {name!r} targets nothing this engine adapts "
                                 f"(supported: {', '.join(TARGET_MODULES)})")
            layer, module, which = int(match.group(1)), match.group(2), match.group(3)
            if layer >= num_layers:
                raise ValueError(f"{folder}: adapter tensor {name!r} is for layer {layer}; the model has {num_layers}")
            out_features, in_features = shapes[module]
            expected = (config.rank, in_features) if which == "A" else (out_features, config.rank)
            shape = tuple(tensors.get_slice(name).get_shape())
            if shape != expected:
                raise ValueError(f"{folder}: adapter tensor {name!r} has shape {shape}; this model needs {expected}")
            found.setdefault((layer, module), {})[which] = None if shapes_only else tensors.get_tensor(name)
    halves = [key for key, parts in found.items() if set(parts) != {"A", "B"}]
    if halves:
        raise ValueError(f"{folder}: projections {halves[:3]} have lora_A or lora_B without the other")
    if shapes_only:
        return None
    return {key: (parts["A"], parts["B"]) for key, parts in found.items()}
