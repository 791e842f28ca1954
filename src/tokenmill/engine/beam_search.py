"""Beam search as Hugging Face transformers defines it (`generate(num_beams=W)`, do_sample=False), no torch.

Each step every running beam is extended by one token: its candidates are its top K next tokens (K = W x
max(2, 1 + number of EOS ids)) with the beam's cumulative log-probability added, and the best K
candidates over all beams are kept. A candidate that ends (an EOS token, or the last token `max_tokens`
allows) becomes a finished hypothesis if it ranks among the first W, scored cum_logprob / generated
length ** length_penalty; the best W candidates that do not end are the next running beams. The search
stops when every candidate ends, when no running beam can still beat the worst finished hypothesis
(HF's heuristic, `early_stopping` False or "never"), or with `early_stopping` True when W hypotheses
are finished. The engine computes each step's candidates: a beam is a request of one token whose prompt
is the beam's tokens so far, whose blocks it shares with its parent through the prefix cache
(docs/beam_search.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from tokenmill.sampling_params import SamplingParams

_NEG = -1.0e9  # HF's score of an impossible beam


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings, shaped like vLLM's `BeamSearchParams`; `length_penalty` and `early_stopping`
    as HF's generation config defines them."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature not in (0.0, 1.0):
            raise ValueError(f"temperature {self.temperature} is not honoured by beam search, which ranks the "
                             "model's own log-probabilities (give 0 or 1)")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """A hypothesis: generated `tokens`, each one's `logprobs`, their sum `cum_logprob`, its HF score
    (cum_logprob / len(tokens) ** length_penalty) and why it ended ('stop': an EOS token, 'length')."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float = _NEG
    finish_reason: Optional[str] = None
    text: Optional[str] = None


@dataclass
class BeamSearchOutput:
    """One prompt's result: its hypotheses, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Candidate:
    parent: BeamSearchSequence
    token: int
    logprob: float
    score: float  # cumulative log-probability with this token


class BeamSearch:
    """The search for one prompt: `running` beams to extend, then `advance` with each beam's top next tokens."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: Sequence[int]) -> None:
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = params.beam_width * max(2, 1 + len(self.eos))
        self.running = [BeamSearchSequence([], [], 0.0)]  # HF's other initial beams score -1e9: never chosen
        self.finished: list[BeamSearchSequence] = []
        self.generated = 0
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def beam_prompts(self) -> list[list[int]]:
        """The token ids of each running beam (prompt + generated), whose next tokens the engine scores."""
        return [self.prompt + beam.tokens for beam in self.running]

    def advance(self, next_tokens: Sequence[dict[int, float]]) -> None:
        """One step: `next_tokens[i]` holds running beam i's top next tokens and their log-probabilities
        (at least `num_candidates` of them)."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        candidates = [_Candidate(beam, token, logprob, beam.cum_logprob + logprob)
                      for beam, tops in zip(self.running, next_tokens)
                      for token, logprob in sorted(tops.items(), key=lambda kv: -kv[1])[:self.num_candidates]]
        candidates.sort(key=lambda c: -c.score)  # stable: among equal scores, earlier beams first (as topk)
        candidates = candidates[:self.num_candidates]
        last = self.generated + 1 >= self.params.max_tokens
        ends = [last or c.token in self.eos for c in candidates]
        ongoing = sorted(range(len(candidates)), key=lambda i: -(candidates[i].score + (_NEG if ends[i] else 0.0)))
        closing = self.improvable and not (len(self.finished) == width and self.params.early_stopping is True)
        fresh = []
        for rank, (candidate, ended) in enumerate(zip(candidates, ends)):
            if ended and rank < width and closing:
                fresh.append(self._extend(candidate, "length" if candidate.token not in self.eos else "stop",
                                          candidate.score / ((self.generated + 1) ** penalty)))
        self.finished = sorted(self.finished + fresh, key=lambda s: -s.score)[:width]
        self.running = [self._extend(candidates[i], None, candidates[i].score + (_NEG if ends[i] else 0.0))
                        for i in ongoing[:width]]
        self.generated += 1
        self._check_done(all(ends))

    def _check_done(self, every_candidate_ended: bool) -> None:
        params, width = self.params, self.params.beam_width
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = params.max_tokens
        else:
            best_length = self.generated
        best_possible = self.running[0].cum_logprob / (best_length ** params.length_penalty) if self.running else _NEG
        worst_finished = min(s.score for s in self.finished) if len(self.finished) == width else _NEG
        self.improvable = self.improvable and best_possible > worst_finished
        all_finished = len(self.finished) == width
        self.done = (not self.improvable or (all_finished and params.early_stopping is True)
                     or every_candidate_ended)

    @staticmethod
    def _extend(candidate: _Candidate, finish_reason: Optional[str], score: float) -> BeamSearchSequence:
        parent = candidate.parent
        sequence = BeamSearchSequence(parent.tokens + [candidate.token], parent.logprobs + [candidate.logprob],
                                      candidate.score, score, finish_reason)
        if finish_reason is None:  # a running beam's `score` is its cumulative log-probability (HF's)
            sequence.cum_logprob = score
        return sequence

    def output(self) -> BeamSearchOutput:
        """The finished hypotheses, best first."""
        return BeamSearchOutput(self.prompt, list(self.finished))


def beam_step_params(num_candidates: int) -> SamplingParams:
    """The engine request of one beam step: one token, with the `num_candidates` best next tokens' raw
    log-probabilities (the sampled token itself is not used)."""
    if num_candidates > 20:
        raise ValueError(f"beam search ranks {num_candidates} candidates per beam; at most 20 are available "
                         "(beam_width <= 10, or <= 6 with two EOS tokens)")
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=num_candidates,
                          skip_special_tokens=False)


def with_texts(results: list[BeamSearchOutput], tokenizer: Any) -> list[BeamSearchOutput]:
    """`results` with every hypothesis' text decoded (special tokens skipped)."""
    for result in results:
        for sequence in result.sequences:
            sequence.text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    return results


def top_logprobs(output: Any) -> dict[int, float]:
    """A finished one-token RequestOutput's top next tokens -> log-probability."""
    return {token: entry.logprob for token, entry in output.outputs[0].logprobs[0].items()}
