"""What the server may read of a running engine, without touching the engine thread's LLMEngine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.kv_transfer import KVTransfers
    from tokenmill.engine.lora_registry import LoRARegistry


@dataclass(frozen=True)
class EngineInfo:
    """A snapshot taken when the engine is built. Its fields never change afterwards, so any thread reads
    them while the engine thread steps; `loras`, the adapter registry, guards its own changes with a lock.
    `sampling_defaults`: what the model's generation config recommends (`sampling_defaults`).
    `accepts_images`: the model reads images as well as text; a vision-language model sets it, and then
    takes the images the server loads for its prompts (`ChatRun.images`); a text-only model refuses
    requests with images with a 400. `architecture`: the checkpoint's (config.json's `architectures`), which
    decides its chat format (GPT-OSS: harmony)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: Optional[str]
    tokenizer: Any  # thread-safe for encoding and decoding
    loras: Optional[LoRARegistry]
    kv_transfers: Optional[KVTransfers]  # other threads call only its thread-safe needs_fetch and fetch
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    accepts_images: bool = False
    architecture: str = ""

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        """The snapshot of a just-built engine."""
        return cls(engine.max_model_len, engine.arch.vocab_size, tuple(engine.eos_token_ids),
                   engine.source.chat_template, engine.tokenizer, engine.loras, engine.kv_transfers,
                   sampling_defaults(engine.source.path), engine.arch.vision is not None, engine.arch.architecture)


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_path: str) -> dict[str, Any]:
    """The sampling controls the model's `generation_config.json` recommends (temperature, top_p, top_k,
    min_p, repetition_penalty; as vLLM reads them), for requests that leave them unset; {} for a GGUF file
    or a folder without one."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {key: config[key] for key in SAMPLING_KEYS
            if isinstance(config, dict) and isinstance(config.get(key), (int, float))
            and not isinstance(config.get(key), bool)}
