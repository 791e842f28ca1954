"""Verifying speculative proposals so that the output keeps the target's distribution exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.sampling.batch import SamplingRow
from tokenmill.sampling.sampler import adjust_logits, filtered_probs, row_argmax


@dataclass
class Proposal:
    """One request's proposals and where the target's logits for them are.

    Logits rows first_row .. first_row + len(drafts) score the positions that predict drafts[0],
    drafts[1], ..., and the token after the last draft. `draft_probs` [len(drafts), V] holds the
    distributions the drafts were drawn from; None means they were chosen deterministically (n-gram
    lookup, or a greedy draft), i.e. each with probability one.
    """

    drafts: list[int]
    first_row: int
    row: SamplingRow
    draft_probs: Optional[torch.Tensor] = None


def verify(logits: torch.Tensor, proposals: list[Proposal],
           default_generator: Optional[torch.Generator] = None) -> list[list[int]]:
    """The tokens each request gains: its accepted drafts, then one more from the target.

    Every position is scored under the request's sampling controls with its earlier drafts counted as
    output (penalties, min_tokens). Greedy requests keep drafts while they equal the target's argmax and
    then take the argmax. Sampling requests use the standard rejection rule: draft d is accepted with
    probability min(1, p(d)/q(d)); on the first rejection the token is drawn from norm(max(0, p - q));
    when every draft is accepted a bonus token is drawn from p. The result is distributed exactly as
    sampling from the target token by token.
    """
    rows, logit_rows = [], []
    for proposal in proposals:
        base = proposal.row
        for i in range(len(proposal.drafts) + 1):
            rows.append(SamplingRow(base.params, base.generator, base.prompt_token_ids,
                                    [*base.output_token_ids, *proposal.drafts[:i]], base.eos_token_ids))
            logit_rows.append(proposal.first_row + i)
    adjusted = adjust_logits(logits[torch.tensor(logit_rows, device=logits.device)], rows)
    argmax = row_argmax(adjusted).tolist()
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = None
    if random_rows:
        probs = torch.zeros_like(adjusted)
        probs[random_rows] = filtered_probs(adjusted[random_rows], [rows[i].params for i in random_rows])
    results, offset = [], 0
    for proposal in proposals:
        count = len(proposal.drafts) + 1
        if proposal.row.params.greedy:
            results.append(_accept_greedy(proposal.drafts, argmax[offset:offset + count]))
        else:
            generator = proposal.row.generator or default_generator
            results.append(_accept_sampled(proposal, probs[offset:offset + count], generator))
        offset += count
    return results


def _accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return drafts[:kept] + [targets[kept]]


def _accept_sampled(proposal: Proposal, p: torch.Tensor, generator: Optional[torch.Generator]) -> list[int]:
    drafts, q = proposal.drafts, proposal.draft_probs
    for i, draft in enumerate(drafts):
        p_draft = float(p[i, draft])
        q_draft = 1.0 if q is None else float(q[i, draft])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_draft < p_draft:
            continue
        if q is None:
            residual = p[i].clone()
            residual[draft] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere means p == q: rejection had probability 0
            residual = p[i]
        return drafts[:i] + [draw(residual, generator)]
    return drafts + [draw(p[len(drafts)], generator)]


def draw(weights: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    """A token drawn in proportion to non-negative `weights` [V]."""
    return int(torch.multinomial(weights, 1, generator=generator))
