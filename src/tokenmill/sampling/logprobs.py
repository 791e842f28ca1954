"""Log-probabilities of chosen tokens, their rank and the top alternatives."""

from __future__ import annotations

import torch

from tokenmill.core.sched_output import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int],
                   invariant: bool = False) -> list[TokenLogprobs]:
    """For each row of float32 logits [N, V], the log-softmax of `token_ids[row]`, its rank and top-N.

    Rank 1 is the most likely token; ties rank the chosen token first. `invariant`: see `row_log_softmax`.
    """
    return logprob_entries(logprob_tensors(logits, token_ids, max(num_top, default=0), invariant), num_top)


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, max_top: int,
                    invariant: bool = False) -> tuple[torch.Tensor, ...]:
    """`token_logprobs`' figures as tensors on the logits' device, nothing read on the host yet: (token ids,
    their log-probabilities, their ranks[, the top `max_top` log-probabilities and ids])."""
    logprobs = row_log_softmax(logits, invariant)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    if max_top > 0:
        return (token_ids, chosen, ranks, *logprobs.topk(max_top, dim=-1))
    return token_ids, chosen, ranks


def row_log_softmax(logits: torch.Tensor, invariant: bool) -> torch.Tensor:
    """log_softmax over each row of float32 logits [N, V]. `invariant` (a batch-invariant run) on CUDA: the
    Triton row kernel (sampling/triton_log_softmax.py), whose row arithmetic does not depend on N, which
    PyTorch's CUDA kernel choice does not promise; elsewhere PyTorch's (on CPU one vectorised pass per row,
    what the CPU batch-invariance tests check)."""
    if invariant and logits.device.type == "cuda":
        from tokenmill.sampling.triton_log_softmax import row_log_softmax as triton_row_log_softmax

        return triton_row_log_softmax(logits.contiguous())
    return logits.log_softmax(dim=-1)


def logprob_entries(tensors: tuple[torch.Tensor, ...], num_top: list[int]) -> list[TokenLogprobs]:
    """The entries of `logprob_tensors`' figures (read on the host), each row with its own top-N."""
    token_ids, chosen, ranks = tensors[:3]
    top_values, top_ids = (tensors[3].tolist(), tensors[4].tolist()) if len(tensors) > 3 else (None, None)
    result = []
    for row, (tok, lp, rank) in enumerate(zip(token_ids.tolist(), chosen.tolist(), ranks.tolist())):
        top = []
        if num_top[row] > 0:
            top = list(zip(top_ids[row][:num_top[row]], top_values[row][:num_top[row]]))
        result.append(TokenLogprobs(tok, lp, rank, top))
    return result
