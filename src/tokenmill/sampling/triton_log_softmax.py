"""A row's log-softmax computed the same way whatever the number of rows, in Triton: the logprobs of a
batch-invariant CUDA run (sampling/logprobs.py). PyTorch's CUDA log_softmax reduces a row in one block or
warp today, but which kernel and block shape it takes is its choice, not a promise (the CUDA path of
thinking-machines-lab's batch_invariant_ops replaces it for that reason).

Invariant (batch invariance): one program per row; BLOCK and the warps are a function of the row's
width alone; the row is read in BLOCK-wide chunks in order, each lane keeping its own running maximum
and rescaled sum, and the lanes are reduced once at the end. So a row's bits depend on its own logits
and the width only. Imported only where that path is chosen (never on a CPU start).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 4096  # lanes a program reads at a time (a vocabulary of 128k: 32 chunks)


@triton.jit
def log_softmax_kernel(in_ptr, out_ptr, width, in_stride, out_stride, BLOCK: tl.constexpr):
    """Program (row): out = (x - max x) - log(sum exp(x - max x)) over the row's `width` float32 values,
    in two passes (the running max and sum, then the writes)."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    source = in_ptr + row * in_stride
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        x = tl.load(source + start + lanes, mask=start + lanes < width, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # a lane that has seen only -inf stays at sum 0 (exp(-inf - -inf) would be NaN)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.exp(x - safe)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    log_total = tl.log(tl.sum(lane_sum * tl.exp(lane_max - safe_max), 0))
    target = out_ptr + row * out_stride
    for start in range(0, width, BLOCK):
        mask = start + lanes < width
        x = tl.load(source + start + lanes, mask=mask, other=0.0).to(tl.float32)
        tl.store(target + start + lanes, (x - row_max) - log_total, mask=mask)


def row_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension of float32 logits [N, V] (contiguous rows) -> float32 [N, V],
    each row computed alike whatever N is (the module's invariant)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"row_log_softmax takes float32 logits [N, V] with contiguous rows, not {logits.dtype} "
                         f"of shape {tuple(logits.shape)} strides {logits.stride()}")
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    rows, width = logits.shape
    if rows and width:
        block = min(_MAX_BLOCK, triton.next_power_of_2(width))
        log_softmax_kernel[(rows,)](logits, out, width, logits.stride(0), out.stride(0), BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    return out
