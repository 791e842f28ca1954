"""Vectorised sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tokenmill.sampling.batch import SamplingRow
from tokenmill.sampling.logits_processors import BUILT_IN, LogitsProcessor
from tokenmill.sampling.penalties import apply_min_tokens, apply_penalties
from tokenmill.sampling_params import SamplingParams


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           default_generator: Optional[torch.Generator] = None,
           processors: Sequence[LogitsProcessor] = ()) -> torch.Tensor:
    """Pick one token per row of float32 `logits` [B, V]; returns int64 [B].

    Order: the logits processors (`adjust_logits`: the built-ins, then `processors`), then greedy rows take the
    argmax; the others divide by temperature, keep top-k, then top-p, then min-p (`filtered_probs`),
    and draw with the exponential-race trick argmax(p / E), E ~ Exp(1) — which lets seeded rows draw
    their noise from their own generator, so a seeded request samples the same tokens whatever else
    is in the batch.
    """
    logits = adjust_logits(logits, rows, processors)
    on_host = logits.device.type == "cpu"
    if on_host:
        check_some_allowed((logits > float("-inf")).any(dim=-1))
        tokens = row_argmax(logits)
    else:
        tokens, allowed = argmax_and_allowed(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        probs = filtered_probs(logits[random_rows], [rows[i].params for i in random_rows])
        noise = _exponential_noise(probs.shape, [rows[i].generator for i in random_rows], probs.device,
                                   default_generator)
        tokens[random_rows] = row_argmax(probs / noise)
    # on a GPU the check would wait for the device: a row with no allowed token is marked instead, and
    # read with the sampled ids (the step's one device-to-host copy)
    return tokens if on_host else torch.where(allowed, tokens, NO_TOKEN)


def adjust_logits(logits: torch.Tensor, rows: list[SamplingRow],
                  processors: Sequence[LogitsProcessor] = ()) -> torch.Tensor:
    """The logits processors applied (sampling/logits_processors.py: logit bias, allowed_token_ids, bad words, then
    penalties and min_tokens masking, then `processors`), to a copy: the caller's logits stay as computed."""
    active = [p for p in BUILT_IN if any(p.applies(r.params) for r in rows)]
    penalties = any(r.params.uses_penalties or len(r.output_token_ids) < r.params.min_tokens for r in rows)
    extra = [p for p in processors if any(p.applies(r.params) for r in rows)]
    if active or penalties or extra:
        logits = logits.clone()
        for processor in active:
            logits = processor.apply(logits, rows)
        apply_penalties(logits, rows)
        apply_min_tokens(logits, rows)
        for processor in extra:
            logits = processor.apply(logits, rows)
    return logits


NO_TOKEN = -1  # sample's id for a row that allows no token, on a GPU (on CPU it raises)
NOTHING_ALLOWED = ("the output constraint, logit_bias, allowed_token_ids, bad_words, min_tokens and the logits "
                   "processors together forbid every token")


def argmax_and_allowed(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's argmax, whether the row allows any token) of logits [B, V] from one reduction, with no
    wait for the device: a row allows a token iff its maximum is above -inf (a NaN maximum is not)."""
    best, tokens = logits.max(dim=-1)
    return tokens, best > float("-inf")


def check_some_allowed(allowed: torch.Tensor) -> None:
    """Raise ValueError when a row of adjusted logits allows no token (`allowed` [B] false: every entry
    -inf or NaN): its output constraint, logit_bias and min_tokens together forbid everything."""
    if not bool(allowed.all()):
        rows = (~allowed).nonzero().flatten().tolist()
        raise ValueError(f"no token is allowed in rows {rows}: {NOTHING_ALLOWED}")


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy row samples from: softmax of logits / temperature after top-k,
    top-p and min-p truncation. logits: adjusted float32 [B, V]; returns [B, V]."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    sub = logits / temps.unsqueeze(1)
    sub = _top_k_top_p(sub, [p.top_k for p in params], [p.top_p for p in params])
    sub = _min_p(sub, [p.min_p for p in params])
    return sub.softmax(dim=-1)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum of x [B, V], as `x.argmax(dim=-1)` picks it (the first on ties;
    NaN counts as the maximum). On CPU float32 it runs in NumPy, whose argmax is vectorised where
    PyTorch's CPU argmax is not (measured here for rows of 49,152: 6 against 104 us for one row, 139
    against 913 us for 16)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [vocab if k == -1 else min(k, vocab) for k in top_k]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k_tensor = torch.tensor(ks, device=logits.device).unsqueeze(1)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(positions >= k_tensor, float("-inf"))
    p_tensor = torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    sorted_logits = sorted_logits.masked_fill(mass_before >= p_tensor, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    if all(p == 0.0 for p in min_p):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    threshold = threshold * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_noise(shape: torch.Size, generators: list[Optional[torch.Generator]],
                       device: torch.device, default_generator: Optional[torch.Generator]) -> torch.Tensor:
    noise = torch.empty(shape, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        block = torch.empty(len(unseeded), shape[1], device=device).exponential_(generator=default_generator)
        noise[unseeded] = block
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise
