"""A third-party logits processor as a plugin package would ship one (sampling/logits_processors.py's interface),
for the tests: a request with extra_args {"only_token": t} may only generate token t."""

from __future__ import annotations

import torch


class OnlyToken:
    """Forbid every token but extra_args["only_token"] for the requests that give it; others' rows untouched."""

    def applies(self, params) -> bool:
        return bool(params.extra_args) and "only_token" in params.extra_args

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        for i, row in enumerate(rows):
            if self.applies(row.params):
                token = int(row.params.extra_args["only_token"])
                kept = logits[i, token].clone()
                logits[i] = float("-inf")
                logits[i, token] = kept
        return logits


class NeedsArguments:
    """A processor that cannot be built without arguments (refused at start)."""

    def __init__(self, strength: float) -> None:
        self.strength = strength
