"""Building the speculation controller and its proposer from the engine's configuration."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Protocol

from tokenmill.config import EngineConfig
from tokenmill.spec_decode.controller import SpeculationController
from tokenmill.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    import torch

    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.models.arch import ArchConfig
    from tokenmill.structured.step_grammars import StepGrammars


class SpeculationTarget(Protocol):
    """What a draft proposer's setup reads of the engine it proposes for (engine/llm_engine.py's `LLMEngine`);
    `step_grammars` is read at every proposal, as the engine builds it on the first constrained request."""

    arch: ArchConfig
    tokenizer: Any
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    kv_cache: KVCacheManager
    eos_token_ids: tuple[int, ...]
    source: Any  # the target's ModelSource (mtp reads its checkpoint again)
    runner: Any  # the target's ModelRunner, in the engine's process (eagle3 and mtp read its hidden states)

    @property
    def step_grammars(self) -> Optional[StepGrammars]:
        """The constrained requests' matchers, None before structured output is first used."""


def make_speculation(config: EngineConfig, engine: SpeculationTarget) -> SpeculationController:
    """The controller for config.speculative (method ngram, draft, eagle3 or mtp), proposing for `engine`'s
    requests."""
    spec = config.speculative
    if spec.speculative_method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.speculative_method in ("eagle3", "mtp"):
        from tokenmill.spec_decode.hidden_drafts import hidden_state_proposer

        proposer = hidden_state_proposer(config, engine, draft_blocks(engine.kv_cache))
    else:
        proposer = _draft_proposer(config, engine)
    return SpeculationController(proposer, spec.num_speculative_tokens, spec.speculative_max_batch,
                                 spec.speculative_min_acceptance)


def _draft_proposer(config: EngineConfig, engine: SpeculationTarget):
    from tokenmill.worker.model_setup import load_model
    from tokenmill.models.loader import load_model_source
    from tokenmill.spec_decode.draft import DraftProposer

    spec = config.speculative
    source = load_model_source(spec.draft_model)
    if source.arch.vocab_size != engine.arch.vocab_size or source.tokenizer.get_vocab() != engine.tokenizer.get_vocab():
        raise ValueError(f"the draft model {spec.draft_model!r} does not share the target's tokenizer "
                         f"(vocabulary of {source.arch.vocab_size} against {engine.arch.vocab_size} tokens, or "
                         f"different token strings)")
    if source.arch.keeps_recurrent_state:
        raise ValueError(f"the draft model {spec.draft_model!r} ({source.arch.architecture}) keeps a recurrent state "
                         "per request, which a draft cannot roll back past its rejected proposals; draft with an "
                         "attention-only model")
    if source.arch.max_position_embeddings < engine.max_model_len:
        raise ValueError(f"the draft model's context length ({source.arch.max_position_embeddings}) is shorter than "
                         f"max_model_len ({engine.max_model_len}); lower max_model_len")
    draft_config = dataclasses.replace(config.model, quantization=spec.draft_quantization)
    model, backend = load_model(source, draft_config, engine.device, engine.dtype, engine.max_model_len,
                                spec.draft_num_layers)
    return DraftProposer(model, backend, draft_blocks(engine.kv_cache), engine.kv_cache.block_size, engine.dtype,
                         engine.device, engine.eos_token_ids, config.model.seed,
                         lambda: engine.step_grammars.matchers if engine.step_grammars is not None else None)


def draft_blocks(target: Any) -> int:
    """The draft's pool size: as many tokens as the target's pool holds for requests that every KV cache
    group keeps whole (each of the draft's blocks holds all its layers; each token of the target takes a
    block in each of its groups)."""
    return max(1, target.num_blocks // target.num_groups)
