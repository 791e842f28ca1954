"""Repetition, presence and frequency penalties, and min_tokens masking, vectorised over the batch (the other
built-in controls are in logits_processors.py)."""

from __future__ import annotations

import torch

from tokenmill.sampling.batch import SamplingRow, padded_ids


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Penalise, in place, the logits of rows that ask for it.

    Repetition (HF/CTRL style): logits of tokens seen in prompt or output are divided by the
    penalty when positive and multiplied when negative. Presence and frequency (OpenAI style)
    subtract `presence` once and `frequency` per occurrence for tokens in the output only.
    """
    index = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not index:
        return
    vocab, device = logits.shape[1], logits.device
    sel = [rows[i] for i in index]
    sub = logits[index]
    out_ids = padded_ids([r.output_token_ids for r in sel], vocab, device)
    counts = torch.zeros(len(sel), vocab + 1, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    prompt_ids = padded_ids([r.prompt_token_ids for r in sel], vocab, device)
    seen = torch.zeros(len(sel), vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, prompt_ids, True)
    seen = seen[:, :vocab] | (counts > 0)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=device).unsqueeze(1)

    rep = column([r.params.repetition_penalty for r in sel])
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column([r.params.frequency_penalty for r in sel]) * counts
    sub = sub - column([r.params.presence_penalty for r in sel]) * (counts > 0).to(sub.dtype)
    logits[index] = sub


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid, in place, end-of-sequence and stop tokens for rows that have not reached min_tokens."""
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            banned = list(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                banned += list(r.eos_token_ids)
            if banned:
                logits[i, banned] = float("-inf")
