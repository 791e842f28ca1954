"""Who speculates in the next step, and how much: the batch-size threshold and the acceptance floor (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Any, Iterable, Protocol

from tokenmill.core.sched_output import RequestUpdate
from tokenmill.request import Request, RequestStatus

# A request's acceptance rate is judged over its last WINDOW verification rounds, once it has MIN_ROUNDS.
WINDOW = 4
MIN_ROUNDS = 2
# A request below the floor sits out this many steps, doubled after each further failure, up to the cap.
COOLDOWN_STEPS = 8
MAX_COOLDOWN_STEPS = 128


@dataclass
class Draft:
    """One request's proposals for the next step, and for a sampled (non-greedy) draft the [len, vocab]
    distributions they were drawn from (the rejection rule needs them; None for deterministic ones)."""

    token_ids: list[int]
    probs: Any = None


class Proposer(Protocol):
    """Makes speculative proposals for requests in the decode phase."""

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Proposals (at most the given count each) by request id; a request may get none."""

    def forget(self, request_id: str) -> None:
        """Drop whatever state is kept for a request that stopped running."""


@dataclass
class _Acceptance:
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted), newest last
    paused_until: int = 0
    cooldown: int = COOLDOWN_STEPS


class SpeculationController:
    """After each step, asks the proposer for proposals for the running requests that should speculate.

    Speculation stands aside when it cannot pay: for the whole batch while more than `max_batch`
    sequences run (their decode steps are no longer idle enough to verify extra tokens for free), and
    for a request whose acceptance rate over its recent rounds fell below `min_acceptance` (it sits out
    a cooldown, then tries again). Requests that speculate and requests that do not share every step.
    """

    def __init__(self, proposer: Proposer, num_tokens: int, max_batch: int, min_acceptance: float) -> None:
        self.proposer = proposer
        self.num_tokens, self.max_batch, self.min_acceptance = num_tokens, max_batch, min_acceptance
        self.step_index = 0
        self._acceptance: dict[str, _Acceptance] = {}
        self._asked: set[str] = set()  # requests the proposer may keep state for

    def observe(self, updates: Iterable[RequestUpdate]) -> None:
        """Record the step's verification rounds."""
        for update in updates:
            if update.num_draft_tokens:
                state = self._acceptance.setdefault(update.request_id, _Acceptance())
                state.rounds = (state.rounds + [(update.num_draft_tokens, update.num_accepted_tokens)])[-WINDOW:]
                self._judge(state)

    def _judge(self, state: _Acceptance) -> None:
        if len(state.rounds) < MIN_ROUNDS:
            return
        proposed = sum(p for p, _ in state.rounds)
        accepted = sum(a for _, a in state.rounds)
        if accepted < self.min_acceptance * proposed:
            state.paused_until = self.step_index + state.cooldown
            state.cooldown = min(2 * state.cooldown, MAX_COOLDOWN_STEPS)
            state.rounds = []
        elif len(state.rounds) == WINDOW:
            state.cooldown = COOLDOWN_STEPS

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of requests that ended between steps (aborts), so a draft frees their KV now."""
        for request_id in request_ids:
            self._acceptance.pop(request_id, None)
            if request_id in self._asked:
                self._asked.discard(request_id)
                self.proposer.forget(request_id)

    def propose(self, running: list[Request], busy: AbstractSet[str] = frozenset()) -> dict[str, Draft]:
        """The drafts of the running requests that speculate in their next step (at most their room each);
        none for the `busy` ones, whose step is still in flight."""
        self.step_index += 1
        live = {r.request_id for r in running}
        self.forget([rid for rid in self._acceptance.keys() | self._asked if rid not in live])
        if len(running) > self.max_batch:
            return {}
        wanted = [(request, room) for request in running
                  if request.request_id not in busy and (room := self._room(request)) > 0]
        if not wanted:
            return {}
        self._asked.update(request.request_id for request, _ in wanted)
        drafts = self.proposer.propose(wanted)
        kept = {}
        for request, room in wanted:
            draft = drafts.get(request.request_id)
            if draft is not None and draft.token_ids:
                probs = None if draft.probs is None else draft.probs[:room]
                kept[request.request_id] = Draft(list(draft.token_ids[:room]), probs)
        return kept

    def _room(self, request: Request) -> int:
        """How many tokens `request` may propose next step: 0 unless it is decoding and not paused."""
        if (request.status is not RequestStatus.RUNNING or request.num_samples_to_fork
                or not request.output_token_ids or request.num_computed_tokens != request.num_tokens - 1):
            return 0
        params = request.sampling_params
        if params.seed is not None and not params.greedy:
            # a seeded sample is reproducible only without speculation: whether a request speculates, and
            # so which random draws the rejection rule takes, depends on the rest of the batch here
            return 0
        state = self._acceptance.get(request.request_id)
        if state is not None and self.step_index < state.paused_until:
            return 0
        # the step adds the accepted proposals and one more token: never past max_tokens
        return min(self.num_tokens, request.max_tokens - len(request.output_token_ids) - 1)

    def is_paused(self, request_id: str) -> bool:
        """Whether the request currently sits out for low acceptance."""
        state = self._acceptance.get(request_id)
        return state is not None and self.step_index < state.paused_until

