"""What the server may read of a running engine, without touching the engine thread's LLMEngine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.kv_transfer import KVTransfers
    from tokenmill.engine.lora_registry import LoRARegistry


@dataclass(frozen=True)
class EngineInfo:
    """A snapshot taken when the engine is built. Its fields never change afterwards, so any thread reads
    them while the engine thread steps; `loras`, the adapter registry, guards its own changes with a lock."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: Optional[str]
    tokenizer: Any  # thread-safe for encoding and decoding
    loras: Optional[LoRARegistry]
    kv_transfers: Optional[KVTransfers]  # other threads call only its thread-safe needs_fetch and fetch

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        """The snapshot of a just-built engine."""
        return cls(engine.max_model_len, engine.arch.vocab_size, tuple(engine.eos_token_ids),
                   engine.source.chat_template, engine.tokenizer, engine.loras, engine.kv_transfers)
