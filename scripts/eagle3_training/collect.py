"""What the head learns from, computed by tokenmill's own engine on the target (the numbers the head reads when it
serves): for every position of a sequence, the residual stream entering the three tapped layers, the final normed
hidden state (whose logits are the target's prediction) and the target's greedy next token.

A sequence is a window of text followed by the target's own greedy continuation of it (EAGLE-3 trains on the
target's own outputs: those are the tokens a draft meets when it serves); the continuation's last token is never
fed, so it has no row."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TargetStates:
    """One sequence as the target saw it: tokens [n + 1] (every fed token and the one sampled after the last) and,
    per fed position, taps [n, 3 x hidden], final [n, hidden] (both in the compute dtype) and greedy [n]
    (the target's argmax of the next token)."""

    tokens: torch.Tensor
    taps: torch.Tensor
    final: torch.Tensor
    greedy: torch.Tensor


class _Recorder:
    """A target runner's `hidden_tap` (see spec_decode/hidden_states.py) that keeps every chunk's rows.

    Invariant: the model keeps the taps of its last forward pass in `aux_hidden` when the runner calls `record`
    (the runner calls it right after the forward pass; `aux_hidden_layers` is set)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.blocks: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def record(self, batch, chunks, hidden: torch.Tensor) -> None:
        greedy = self.model.compute_logits(hidden).argmax(-1)
        for item, chunk in zip(batch, chunks):
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            self.blocks.setdefault(item.request_id, []).append(  # (held on the CPU, where the head trains)
                (item.start, self.model.aux_hidden[rows].cpu().clone(), hidden[rows].cpu().clone(),
                 greedy[rows].cpu().clone()))

    def drop(self, request_ids) -> None:  # the rows are kept until `assemble` reads them
        pass

    def assemble(self, request_id: str, fed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(taps, final, greedy) of positions [0, fed); a later chunk over a position (a recomputation after
        preemption) replaces an earlier one's row."""
        blocks = self.blocks.pop(request_id)
        taps = blocks[0][1].new_empty(fed, blocks[0][1].shape[1])
        final = blocks[0][2].new_empty(fed, blocks[0][2].shape[1])
        greedy = torch.empty(fed, dtype=torch.long)
        covered = torch.zeros(fed, dtype=torch.bool)
        for start, block_taps, block_final, block_greedy in blocks:
            end = min(fed, start + len(block_taps))
            taps[start:end], final[start:end] = block_taps[:end - start], block_final[:end - start]
            greedy[start:end], covered[start:end] = block_greedy[:end - start], True
        assert bool(covered.all()), f"request {request_id}: positions without rows"
        return taps, final, greedy


def collect_target_states(llm: Any, layers: tuple[int, ...], windows: list[list[int]], continuation: int,
                          batch: int, log=print) -> list[TargetStates]:
    """Run the target in `llm` (an in-process tokenmill LLM, prefix caching off) over each window and `continuation`
    greedy tokens after it, `batch` windows at a time, and keep what the head learns from."""
    from tokenmill import SamplingParams

    engine = llm.llm_engine
    runner, model = engine.runner, engine.runner.model
    if engine.config.cache.prefix_caching:
        raise ValueError("collecting hidden states needs every position computed: turn prefix caching off")
    recorder = _Recorder(model)
    model.aux_hidden_layers, runner.hidden_tap = layers, recorder
    params = SamplingParams(temperature=0, max_tokens=max(1, continuation), ignore_eos=True)
    states, started, tokens_done = [], time.perf_counter(), 0
    try:
        for first in range(0, len(windows), batch):
            outputs = llm.generate(windows[first:first + batch], params, use_tqdm=False)
            for output in outputs:
                tokens = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
                taps, final, greedy = recorder.assemble(output.request_id, len(tokens) - 1)
                states.append(TargetStates(torch.tensor(tokens), taps, final, greedy))
                tokens_done += len(tokens) - 1
            seconds = time.perf_counter() - started
            log(f"  target states: {len(states)}/{len(windows)} sequences, {tokens_done} positions, "
                f"{seconds:.0f} s ({tokens_done / max(seconds, 1e-9):.0f} positions/s)")
    finally:
        model.aux_hidden_layers, runner.hidden_tap, model.aux_hidden = (), None, None
    return states
