"""Logits processors: what changes a batch's logits before sampling, applied in one place (`adjust_logits`), each
to the whole batch at once.

A processor has `applies(params)` (whether a request uses it: the others' rows must come out unchanged) and
`apply(logits, rows)`, which changes float32 logits [B, V] in place (or returns new ones) for the rows of
`rows` (sampling/batch.py's SamplingRow: each request's params, its `extra_args`, its prompt and output so far). The
built-ins are processors too, applied first in this order: logit_bias, allowed_token_ids, bad_words, then the
penalties and min_tokens. Third-party processors (a class with those two methods, constructed without arguments)
are named with `--logits-processors module:Class` or by the name under which a package registers them in the
`tokenmill.logits_processors` entry-point group; they run after the built-ins, in the order given, and read their
per-request arguments from `SamplingParams.extra_args` (the server's `vllm_xargs`). A processor's arithmetic for a
row must not depend on the other rows, or batch invariance is lost. Speculative decoding with third-party
processors is refused (vLLM refuses the pair too): a verification scores every proposed position, which a
processor that keeps per-request state would see out of order.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from tokenmill.named_objects import import_named
from tokenmill.sampling.batch import SamplingRow
from tokenmill.sampling_params import SamplingParams

ENTRY_POINT_GROUP = "tokenmill.logits_processors"


class LogitsProcessor(Protocol):
    """See the module docstring."""

    def applies(self, params: SamplingParams) -> bool:
        """Whether a request of `params` uses this processor."""

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The batch's logits [B, V] with this processor applied to the rows it applies to."""


class LogitBias:
    """Add each request's `logit_bias` to its token ids' logits."""

    def applies(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                ids = torch.tensor(list(r.params.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i, ids] += bias
        return logits


class AllowedTokenIds:
    """Forbid every token outside a request's `allowed_token_ids`."""

    def applies(self, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, r in enumerate(rows):
            if r.params.allowed_token_ids is not None:
                keep = torch.tensor(r.params.allowed_token_ids, dtype=torch.long, device=logits.device)
                row = torch.full_like(logits[i], float("-inf"))
                row[keep] = logits[i, keep]
                logits[i] = row
        return logits


class BadWords:
    """Forbid the last token of each of a request's bad words wherever its output ends with the tokens before it
    (a one-token word: everywhere), as vLLM's bad_words does."""

    def applies(self, params: SamplingParams) -> bool:
        return bool(params.bad_words_token_ids)

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, r in enumerate(rows):
            output = list(r.output_token_ids[-_longest(r.params.bad_words_token_ids):]) \
                if r.params.bad_words_token_ids else []
            for word in r.params.bad_words_token_ids or ():
                before = word[:-1]
                if not before or (len(output) >= len(before) and output[len(output) - len(before):] == before):
                    logits[i, word[-1]] = float("-inf")
        return logits


def _longest(words: list[list[int]]) -> int:
    return max(len(word) for word in words)


BUILT_IN: tuple[LogitsProcessor, ...] = (LogitBias(), AllowedTokenIds(), BadWords())


def load_logits_processors(names: Sequence[str]) -> list[LogitsProcessor]:
    """The processors `names` (module:Class, or an entry-point name of the tokenmill.logits_processors group),
    each constructed once; ValueError naming one that cannot be found, made, or lacks applies/apply."""
    loaded = []
    for name in names:
        cls = _find(name)
        try:
            processor = cls()
        except Exception as exc:
            raise ValueError(f"logits processor {name!r} could not be constructed without arguments: {exc}") from None
        if not callable(getattr(processor, "applies", None)) or not callable(getattr(processor, "apply", None)):
            raise ValueError(f"logits processor {name!r} has no applies(params) and apply(logits, rows) methods "
                             "(sampling/logits_processors.py)")
        loaded.append(processor)
    return loaded


def _find(name: str) -> Any:
    if ":" in name:
        return import_named(name, "logits processor")
    from importlib.metadata import entry_points

    found = [point for point in entry_points(group=ENTRY_POINT_GROUP) if point.name == name]
    if not found:
        raise ValueError(f"logits processor {name!r} not found: give module:Class, or the name of an entry point "
                         f"of the {ENTRY_POINT_GROUP!r} group")
    return found[0].load()
