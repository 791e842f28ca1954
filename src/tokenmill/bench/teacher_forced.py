"""Scoring texts as a model reads them: each token's log-probability after its prefix (prompt logprobs),
for perplexity and top-1 agreement between two ways of serving one model."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.sampling_params import SamplingParams


def teacher_forced(llm: Any, texts: list[list[int]]) -> tuple[float, list[int]]:
    """(perplexity, the most likely token at each scored position) of token-id texts under `llm` (an
    LLM): every token after the first of each text is scored, in order."""
    outputs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    nll, best = 0.0, []
    for output, tokens in zip(outputs, texts):
        for entry, token in zip(output.prompt_logprobs[1:], tokens[1:]):
            nll -= entry[token].logprob
            best.append(min(entry.items(), key=lambda item: item[1].rank)[0])
    return math.exp(nll / len(best)), best
