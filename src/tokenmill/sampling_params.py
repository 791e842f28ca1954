"""Per-request sampling controls, validated once at construction (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from tokenmill.structured.spec import StructuredOutput

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, shaped like vLLM's `SamplingParams`.

    `temperature == 0` means greedy. `max_tokens=None` means "until the context is full".
    `logprobs=N` returns the sampled token's log-probability plus the top N (0 = only the sampled
    one); `prompt_logprobs=N` does the same for every prompt token after the first.
    Log-probabilities are those of the model's raw distribution, before temperature and penalties.
    `logit_bias` adds a bias to the logits of the given token ids before any other control.
    `structured_output` constrains the whole output (a JSON schema, regex, choice or grammar): tokens it
    forbids are masked before every other control, and the request stops when it is complete.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None
    structured_output: Optional[StructuredOutput] = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _validate(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}",
        )
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(self.repetition_penalty > 0.0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty}")
        _require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
                 f"must be in [-2, 2], got {self.presence_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
                 f"must be in [-2, 2], got {self.frequency_penalty}")
        _require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                 "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
                 f"must be an integer >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                 "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        _require(self.prompt_logprobs is None
                 or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
                 "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        _require(all(isinstance(s, str) and s for s in self.stop_strings), "stop",
                 "must be a non-empty string or a list of non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be a list of non-negative token ids")
        _require(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _require(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                 "structured_output", "must be a tokenmill StructuredOutput")
        _require(all(isinstance(t, int) and t >= 0 and -100 <= b <= 100 for t, b in (self.logit_bias or {}).items()),
                 "logit_bias", "must map non-negative token ids to biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        """True when the next token is always the argmax."""
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` >= 1 of an n>1 request: n=1, seed + index, and no prompt
        logprobs (sample 0 reports those for the whole request)."""
        clone = SamplingParams(**{k: getattr(self, k) for k in _INIT_FIELDS})
        clone.n, clone.prompt_logprobs = 1, None
        clone.seed = None if self.seed is None else self.seed + index
        return clone


_INIT_FIELDS = [f for f in SamplingParams.__dataclass_fields__ if f != "stop_strings"]


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
