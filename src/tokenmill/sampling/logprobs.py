"""Log-probabilities of chosen tokens, their rank and the top alternatives."""

from __future__ import annotations

import torch

from tokenmill.core.sched_output import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """For each row of float32 logits [N, V], the log-softmax of `token_ids[row]`, its rank and top-N.

    Rank 1 is the most likely token; ties rank the chosen token first.
    """
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    max_top = max(num_top, default=0)
    top_values = top_ids = None
    if max_top > 0:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result = []
    for row, (tok, lp, rank) in enumerate(zip(token_ids.tolist(), chosen.tolist(), ranks.tolist())):
        top = []
        if num_top[row] > 0:
            top = list(zip(top_ids[row][:num_top[row]], top_values[row][:num_top[row]]))
        result.append(TokenLogprobs(tok, lp, rank, top))
    return result
