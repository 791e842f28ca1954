"""A PEFT LoRA adapter's `adapter_config.json`, checked against what the engine runs (no torch here)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the decoder's projections an adapter may target, by their checkpoint names
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    """rank r, the delta's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) and the targeted projections."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...]

    @classmethod
    def read(cls, folder: str, max_rank: int) -> "AdapterConfig":
        """The adapter in `folder`; ValueError naming what this engine cannot run (a missing folder or
        file, a rank above `max_rank`, a target, bias, DoRA or modules_to_save it does not support)."""
        path = Path(folder) / "adapter_config.json"
        if not path.is_file():
            raise ValueError(f"no LoRA adapter at {folder!r}: adapter_config.json not found")
        config: dict[str, Any] = json.loads(path.read_text())
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{folder}: peft_type {config.get('peft_type')!r} is not LoRA")
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{folder}: rank r must be an integer >= 1, got {rank!r}")
        if rank > max_rank:
            raise ValueError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
        unsupported = {name: config.get(name) for name in ("use_dora", "modules_to_save", "fan_in_fan_out")
                       if config.get(name)}
        if config.get("bias", "none") != "none":
            unsupported["bias"] = config["bias"]
        if unsupported:
            raise ValueError(f"{folder}: LoRA options {unsupported} are not supported")
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else list(targets)
        if targets == ["all-linear"]:
            targets = list(TARGET_MODULES)
        unknown = [t for t in targets if t not in TARGET_MODULES]
        if unknown or not targets:
            raise ValueError(f"{folder}: target modules {unknown or targets} are not supported "
                             f"(supported: {', '.join(TARGET_MODULES)})")
        alpha = config.get("lora_alpha", 8)
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        return cls(rank, float(scaling), tuple(targets))
