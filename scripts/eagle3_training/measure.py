"""What the written head achieves in tokenmill's own engine on held-out text: greedy continuations of held-out
windows with the head proposing (eagle3) and without speculation, whether they are identical, the mean
acceptance length (1 + accepted proposals per verification round) and the acceptance at each proposal position.

Beside it, the same figures predicted from the training-time head (float32) over the target's states of the
plain run: the rounds the engine plays, replayed (proposal s of a round from row r is the training-time test's
step s at row r). The two agree when the head tokenmill loads computes what was trained; they differ by the
engine's compute dtype (a bfloat16 target and head flip a few near-ties)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_training.collect import TargetStates, collect_target_states
from eagle3_training.head import TrainableEagle3Head
from eagle3_training.train import make_batch


@dataclass
class Rounds:
    """Verification rounds: how many, and per proposal position the rounds that proposed / accepted it."""

    count: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """Count one round."""
        self.count += 1
        for counts, n in ((self.drafted, num_drafts), (self.accepted, num_accepted)):
            counts.extend([0] * (num_drafts - len(counts)))
            for j in range(n):
                counts[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted proposals per round."""
        return 1 + sum(self.accepted) / max(1, self.count)

    @property
    def per_position(self) -> list[float]:
        """Of the rounds that proposed a j-th token, the share that accepted it."""
        return [a / d for a, d in zip(self.accepted, self.drafted)]


@dataclass
class Acceptance:
    """The figures of one held-out run."""

    identical: bool  # greedy outputs with the head equal those without speculation, token for token
    engine: Rounds  # as tokenmill's engine counted them
    predicted: Rounds  # replayed with the training-time head
    seconds_plain: float
    seconds_speculative: float


@torch.no_grad()
def replay_rounds(head: TrainableEagle3Head, states: list[TargetStates], prompt_lengths: list[int],
                  output_len: int, k: int, embedding: torch.Tensor, target_to_draft: torch.Tensor) -> Rounds:
    """The rounds a greedy request of each sequence plays with `head` proposing up to k tokens (as
    spec_decode/controller.py grants them: never past output_len): after the prompt's first token, each round
    proposes from the row before the last token, accepts while the proposals equal the target's greedy tokens,
    and adds the accepted ones plus one."""
    rounds = Rounds()
    for seq, prompt in zip(states, prompt_lengths):
        batch = make_batch([seq], k, embedding, target_to_draft)
        proposals = [head.logits(s).argmax(-1)[0] for s in head.unrolled(batch.embeds, batch.taps, k)]
        labels = batch.label_greedy[0]
        produced, last = 1, prompt  # output tokens so far; index of the last token
        while (room := min(k, output_len - produced - 1)) > 0:
            row, accepted = last - 1, 0
            while accepted < room and int(proposals[accepted][row]) == int(labels[accepted, row]):
                accepted += 1
            rounds.add(room, accepted)
            produced, last = produced + accepted + 1, last + accepted + 1
    return rounds


def measure_acceptance(plain: Any, model: str, folder: Path, head: TrainableEagle3Head, layers: tuple[int, ...],
                       windows: list[list[int]], output_len: int, k: int, engine_options: dict[str, Any],
                       embedding: torch.Tensor, target_to_draft: torch.Tensor, log=print) -> Acceptance:
    """Run the windows through `plain` (an LLM on the target, no speculation, prefix caching off), keeping the
    target's states, and through a new LLM with the head in `folder` (k proposals a round; every request
    speculates: no batch threshold, no acceptance floor)."""
    from tokenmill import LLM, SamplingParams

    started = time.perf_counter()
    states = collect_target_states(plain, layers, windows, output_len, len(windows), log)
    seconds_plain = time.perf_counter() - started
    speculative = LLM(model, **engine_options, speculative_max_batch=max(1, len(windows)),
                      speculative_min_acceptance=0.0,
                      speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": k})
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    got = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
           for o in speculative.generate(windows, params, use_tqdm=False)]
    seconds_speculative = time.perf_counter() - started
    totals = speculative.llm_engine.stats().spec
    speculative.shutdown()
    engine = Rounds(totals.num_rounds, list(totals.drafted_per_position), list(totals.accepted_per_position))
    head.eval()
    predicted = replay_rounds(head.float(), states, [len(w) for w in windows], output_len, k, embedding,
                              target_to_draft)
    return Acceptance(got == [s.tokens.tolist() for s in states], engine, predicted, seconds_plain,
                      seconds_speculative)
