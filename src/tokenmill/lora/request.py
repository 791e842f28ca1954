"""Which LoRA adapter a request runs with, shaped like vLLM's `LoRARequest` (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: `lora_name` (what requests call it: the server's `model`), `lora_int_id` (>= 1, the
    engine's number for it) and `lora_path` (its PEFT folder: adapter_config.json + adapter weights)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
