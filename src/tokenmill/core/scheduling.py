"""The scheduler's limits and its speculative-decoding counters: plain data (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenmill.core.swap_space import PreemptionCosts


@dataclass(frozen=True)
class SchedulingLimits:
    """The per-step limits and admission policy the scheduler enforces."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    policy: str = "fcfs"
    # Steps that may be in flight at once (pipeline stages); with more than one, each step takes its
    # share of the live requests so the next step has requests of its own to run.
    max_steps_in_flight: int = 1
    # Most LoRA adapters one step runs (0: no limit); a waiting request of another adapter is passed over
    # until a running one's adapter finishes, as vLLM's --max-loras does.
    max_loras: int = 0
    # How a preempted request comes back: recompute its tokens, swap its blocks out to host slots and
    # back, or (auto) whichever `costs` estimates cheaper for it (core/swap_space.py).
    preemption_mode: str = "recompute"
    costs: Optional[PreemptionCosts] = None
    # Image positions the vision encoder computes per step (0: no limit): a chunk that would start an image
    # past it stops before that image, unless the step has encoded none yet (an image larger than the budget
    # is encoded alone in its step), as vLLM's encoder budget does.
    max_num_encoder_input_tokens: int = 0
    # Async scheduling: a request in the step running may be scheduled in the next one with a placeholder
    # for the token that step samples (core/scheduler.py), except when speculative decoding proposes from
    # every request's last token.
    async_scheduling: bool = False
    speculative: bool = False
    # Prompt tokens (chunks of more than one token) one step computes, within max_num_batched_tokens (0: no cap of
    # its own): decodes are not counted, so a step stays short for a request that arrives while it runs.
    max_num_prompt_tokens: int = 0


@dataclass
class SpecTotals:
    """Speculative decoding counters since start: verification rounds, proposed, accepted and emitted tokens."""

    num_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted proposals plus the token sampled after them, in rounds with proposals
    # per proposal position j (0-based): the rounds that proposed a j-th token, and those that accepted it (vLLM's
    # num_accepted_tokens_per_pos); tuples, so that a copy (dataclasses.replace) shares nothing that changes
    drafted_per_position: tuple[int, ...] = ()
    accepted_per_position: tuple[int, ...] = ()

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """Count one request's verification round."""
        self.num_rounds += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.drafted_per_position = _count_first(self.drafted_per_position, num_drafts, num_drafts)
        self.accepted_per_position = _count_first(self.accepted_per_position, num_accepted, num_drafts)


def _count_first(counts: tuple[int, ...], n: int, width: int) -> tuple[int, ...]:
    """`counts` grown to `width` positions, with one more at each of the positions 0..n-1."""
    grown = counts + (0,) * (width - len(counts))
    return tuple(count + (index < n) for index, count in enumerate(grown))
