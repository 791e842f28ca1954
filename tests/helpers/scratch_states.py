"""A model's final states over a whole sequence computed from scratch (a fresh KV cache, nothing of an earlier call
read): the reference an incremental draft's states are checked against."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tokenmill import SamplingParams


def states_from_scratch(runner, block_size: int, max_positions: int
                        ) -> Callable[[list[int], Optional[torch.Tensor]], torch.Tensor]:
    """f(tokens, step_hidden=None): the final states of `runner`'s model over `tokens` at positions 0.., every position
    written again in a KV cache of its own of `max_positions` positions; `step_hidden`: a draft's input hidden states
    (see Eagle3Head.step_hidden / MultiTokenPredictor.step_hidden)."""
    from tokenmill.core.kv_spec import single_group
    from tokenmill.models.arch import kv_cache_spec
    from tokenmill.worker.model_runner import ModelRunner
    from tokenmill.worker.request_state import BatchItem

    model, blocks = runner.model, -(-max_positions // block_size)
    layout = single_group(len(model.layers), kv_cache_spec(model.arch, 4))
    fresh = ModelRunner(model, runner.backend, blocks, block_size, layout, torch.float32, torch.device("cpu"), (2,))
    greedy = SamplingParams(temperature=0, max_tokens=1)

    def states(tokens: list[int], step_hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        if step_hidden is not None:
            model.step_hidden = step_hidden
        hidden, _ = fresh.forward([BatchItem("fresh", tokens, 0, [list(range(blocks))], True, greedy, tokens, [])])
        return hidden

    return states
