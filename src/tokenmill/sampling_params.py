"""Per-request sampling controls, validated once at construction (no torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from tokenmill.core.block_hash import KeySalt
from tokenmill.lora.request import LoRARequest
from tokenmill.structured.spec import StructuredOutput

_GREEDY_EPS = 1e-5
# Bounds that keep float32 sampling arithmetic finite: logits (|x| < 1e4) divided by a temperature or
# scaled by a repetition penalty inside these ranges never overflow to inf or produce NaN.
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a 64-bit signed integer, as vLLM and torch take it
OUTPUT_KINDS = ("cumulative", "delta")


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
    `cache_salt` (vLLM's field) makes the request's prefix-cache blocks reachable only from requests with
    the same salt: one tenant cannot reuse, or time, another's cached prompts.
    `output_kind` (vLLM's RequestOutputKind): "cumulative" outputs hold everything so far, "delta" ones
    only what is new since the previous output (the server's streams: no output is copied twice).
    `allowed_token_ids` (vLLM's): only these tokens may be sampled. `bad_words`: words never to be generated (each
    tokenised with and without a leading space into `bad_words_token_ids` by the engine; a word's last token is
    forbidden wherever the output ends with the tokens before it). `extra_args` (vLLM's; the server's
    `vllm_xargs`): per-request arguments that third-party logits processors read
    (sampling/logits_processors.py).
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
    cache_salt: Optional[str] = None
    output_kind: str = "cumulative"
    # prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} on the prefill server,
    # the prefill answer's kv_transfer_params on the decode server (engine/kv_transfer.py)
    kv_transfer_params: Optional[dict] = None
    # the LoRA adapter the request runs with (None: the base model); the engine sets it from the server's
    # `model` or `LLM.generate(lora_request=...)`, and it travels with the request to the runner
    lora_request: Optional[LoRARequest] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    bad_words_token_ids: Optional[list[list[int]]] = None  # set by the engine from `bad_words` and its tokenizer
    extra_args: Optional[dict] = None
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

    @property
    def key_salt(self) -> KeySalt:
        """What keeps this request's prefix-cache blocks apart: its cache salt and LoRA adapter."""
        lora = self.lora_request
        return KeySalt(self.cache_salt, (lora.lora_name, lora.lora_path) if lora is not None else None)

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(_finite_in(self.temperature, 0.0, MAX_TEMPERATURE), "temperature",
                 f"must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        _require(_finite_in(self.top_p, 0.0, 1.0) and self.top_p > 0.0, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
                 "top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        _require(_finite_in(self.min_p, 0.0, 1.0), "min_p", f"must be in [0, 1], got {self.min_p!r}")
        low, high = REPETITION_PENALTY_RANGE
        _require(_finite_in(self.repetition_penalty, low, high), "repetition_penalty",
                 f"must be in [{low:g}, {high:g}], got {self.repetition_penalty!r}")
        _require(_finite_in(self.presence_penalty, -2.0, 2.0), "presence_penalty",
                 f"must be in [-2, 2], got {self.presence_penalty!r}")
        _require(_finite_in(self.frequency_penalty, -2.0, 2.0), "frequency_penalty",
                 f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                 "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
                 f"must be an integer >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
                 "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        _require(self.prompt_logprobs is None
                 or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
                 "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        _require(all(isinstance(s, str) and s for s in self.stop_strings), "stop",
                 "must be a non-empty string or a list of non-empty strings")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be a list of non-negative token ids")
        _require(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
                 "seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        _require(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                 "structured_output", "must be a tokenmill StructuredOutput")
        _require(all(_is_int(t) and t >= 0 and _finite_in(b, -100.0, 100.0)
                     for t, b in (self.logit_bias or {}).items()),
                 "logit_bias", "must map non-negative token ids to biases in [-100, 100]")
        _require(self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= 256),
                 "cache_salt", "must be a non-empty string of at most 256 characters")
        _require(self.output_kind in OUTPUT_KINDS, "output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        _require(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                    and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
                 "allowed_token_ids", "must be a non-empty list of non-negative token ids")
        _require(self.bad_words is None or (isinstance(self.bad_words, list)
                                            and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
                 "bad_words", "must be a list of non-empty strings")
        _require(self.extra_args is None or (isinstance(self.extra_args, dict)
                                             and all(isinstance(k, str) for k in self.extra_args)),
                 "extra_args", "must be an object with string keys")
        _require(self.structured_output is None or self.min_tokens == 0, "min_tokens",
                 "cannot be combined with a structured output constraint (the grammar decides where the "
                 "output may end)")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError naming the field when a token id it gives is outside the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            _require(not bad, name, f"token ids must be < the vocabulary size {vocab_size}; got {bad[:5]}")

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
        clone.seed = None if self.seed is None else _wrap_int64(self.seed + index)
        return clone


_INIT_FIELDS = [f for f in SamplingParams.__dataclass_fields__ if f != "stop_strings"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_in(value: object, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value <= high


def _wrap_int64(value: int) -> int:
    return (value - SEED_RANGE[0]) % (1 << 64) + SEED_RANGE[0]


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
