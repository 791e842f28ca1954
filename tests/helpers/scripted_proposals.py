"""A proposer that knows each prompt's greedy continuation (from a run without speculation) and proposes it right
for a number of tokens that cycles through 0, 1, .., k, then one wrong token: every accepted length occurs, so a
verification's rejected rows are undone at every position. For targets whose random outputs nothing else predicts
(n-gram lookups find no repeats, and no draft model agrees with them)."""

from __future__ import annotations

from typing import Any

from tokenmill import LLM
from tokenmill.spec_decode.controller import Draft


class ScriptedProposer:
    """Proposals from `continuations` (prompt ids -> the greedy output ids); `accepted` records, per proposal, how
    many of its tokens were right (what the target must accept)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        self.continuations, self.vocab_size = continuations, vocab_size
        self.accepted: list[int] = []

    def propose(self, wanted: list[tuple[Any, int]]) -> dict[str, Draft]:
        """Each request's next `room` true tokens, the first wrong one after a cycling count of right ones."""
        drafts = {}
        for request, room in wanted:
            done = len(request.output_token_ids)
            truth = self.continuations[tuple(request.prompt_token_ids)][done:done + room]
            if not truth:
                continue
            right = len(self.accepted) % (len(truth) + 1)
            wrong = [(truth[right] + 1) % self.vocab_size] if right < len(truth) else []
            drafts[request.request_id] = Draft(truth[:right] + wrong)
            self.accepted.append(right)
        return drafts

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""


def propose_scripted(llm: LLM, continuations: dict[tuple[int, ...], list[int]]) -> ScriptedProposer:
    """Make `llm` (an engine built with speculation, any method) propose from `continuations` (prompt ids -> greedy
    output ids) through a ScriptedProposer, which it returns."""
    proposer = ScriptedProposer(continuations, llm.llm_engine.arch.vocab_size)
    llm.llm_engine.speculation.proposer = proposer
    return proposer


def assert_speculation_changes_no_bit(path: str, engine: dict[str, Any], k: int = 3) -> ScriptedProposer:
    """A recurrent-state model (engine options `engine`, the default dtype) gives the same greedy ids and logprobs,
    bit for bit, with scripted proposals of up to `k` tokens (every accepted length 0..k: the states of rejected
    rows undone at every position) as without, three requests batched and one swap-preempted (its states and K/V
    copied out and back) mid-speculation; returns the proposer."""
    from helpers.forced_preemption import OTHERS, PROMPT, greedy_runs

    prompts = [PROMPT, *OTHERS[:2]]
    plain = greedy_runs(LLM(path, **engine), prompts, max_tokens=16)
    llm = LLM(path, **engine, preemption_mode="swap", speculative_min_acceptance=0.0,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    proposer = propose_scripted(llm, {tuple(prompt): list(ids) for prompt, (ids, _) in zip(prompts, plain)})
    assert greedy_runs(llm, prompts, preempt_at_step=4, max_tokens=16) == plain
    assert set(proposer.accepted) == set(range(k + 1)) and llm.llm_engine.stats().spec.accepted_per_position[-1] > 0
    return proposer
