"""The batch-invariant float product of the CUDA path, in Triton: y = x W^T (+ b) whose every output row is
computed the same way whatever the number of rows (thinking-machines-lab's batch_invariant_ops and vLLM's
VLLM_BATCH_INVARIANT make the same choice). cuBLAS picks its kernel, tile shape and split of the reduction
by the row count, so a request's row sums in another order in a batch of 7 than alone; here nothing the
arithmetic of a row depends on is chosen from the row count.

Invariant (batch invariance): the tile sizes, warps and stages are a function of (out_features, in_features,
dtype) only (`tiling`); every output element is reduced over the input features in one sequential loop of
BLOCK_K chunks, each chunk one `tl.dot` into a float32 accumulator, and no split of the reduction; an output
row never reads another row's values (rows past m load zeros and are never stored). So a row's bits depend
on its own input, the weight and the (n, k, dtype) tiling, not on m or on where the row sits in its tile
(every row of a tile goes through the same MMA instructions). The row count changes only the number of
tiles, and the persistent grid (at most one program per SM, each walking tiles in a fixed stride) changes
which program computes a tile, never how.

Layout: `pack_weight` stores W^T [k, n] row-major (out-features contiguous), the classic Triton matmul
layout: a weight tile [BLOCK_K, BLOCK_N] is a coalesced load and goes to `tl.dot` as the right operand
without a transpose. Imported only where a Triton product is chosen (TritonProducts), never on a CPU start.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.kernels.triton_interpreter import prepare_interpreter

prepare_interpreter()  # (under the interpreter: a row's dot the same wherever it sits in its tile, cheaper launches)

INTERPRETED = envs.triton_interpreted()
# Triton's interpreter runs a program at a time, each launch of a program costing ~50 ms: two programs
# keep the persistent loop (several tiles per program, in strides) exercised at half that cost
INTERPRETED_PROGRAMS = 2
GROUP_M = 8  # tile rows walked together so their weight tiles stay in L2 (order only: no effect on the sums)


class Tiling(NamedTuple):
    """The kernel's constants for one weight shape and dtype."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiling(n: int, k: int, dtype: torch.dtype) -> Tiling:
    """The tiling of an [n, k] weight of `dtype`. Invariant: a function of these three alone (never of the
    row count), which is what makes the product batch-invariant. 16-bit: 64-row tiles (one warp group's
    MMA) over 64 features; 128 outputs wide from 8,192 outputs on (gate/up projections, the LM head: tiles
    enough to fill the SMs with few rows), else 64 wide so that a decode step of few rows still has
    n / 64 tiles to spread. Float32 multiplies exactly (no TF32), on the CUDA cores: smaller tiles.
    Not yet tuned on a GPU."""
    del k  # the reduction's chunk does not depend on its length: every chunk is BLOCK_K wide
    if dtype == torch.float32:
        return Tiling(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=3)
    return Tiling(block_m=64, block_n=128 if n >= 8192 else 64, block_k=64, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["m", "num_programs"])
def invariant_matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, m, n, k, x_stride, out_stride, num_programs,
                            HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """Persistent program: tiles pid, pid + num_programs, ... of out [m, n] = x [m, k] @ w [k, n] (+ bias),
    each over the full k in BLOCK_K chunks in order, accumulated in float32 and rounded once to out's dtype.
    `m` and `num_programs` are not specialised: one compiled kernel serves every row count (Triton would
    otherwise compile m == 1 and 16-divisible m apart: other code, though not other sums)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * tiles_n
    for tile in range(pid, tiles_m * tiles_n, num_programs):
        group = tile // per_group
        first_m = group * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % per_group) % group_rows
        tile_n = (tile % per_group) // group_rows
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        feats = tl.arange(0, BLOCK_K)
        # rows past m and columns past n load zeros: their results are never stored, and no stored
        # element reads them
        row_ok = rows[:, None] < m
        col_ok = cols[None, :] < n
        x_tile = x_ptr + rows.to(tl.int64)[:, None] * x_stride + feats[None, :]
        w_tile = w_ptr + feats.to(tl.int64)[:, None] * n + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, tl.cdiv(k, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_tile, mask=row_ok, other=0.0)
                b = tl.load(w_tile, mask=col_ok, other=0.0)
            else:  # the last chunk's missing features are zeros on both sides: they add exact zeros
                left = k - step * BLOCK_K
                a = tl.load(x_tile, mask=row_ok & (feats[None, :] < left), other=0.0)
                b = tl.load(w_tile, mask=col_ok & (feats[:, None] < left), other=0.0)
            if UPCAST:  # the interpreter computes 16-bit products wrongly: exact float32 products instead
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:  # float32 multiplied exactly (no TF32), as F.linear does by default
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            x_tile += BLOCK_K
            w_tile += BLOCK_K * n
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [n, k] (float32, bfloat16 or float16) as the kernel reads it: W^T [k, n] contiguous,
    of the weight's dtype, on its device."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"pack_weight takes a 2-D float32, bfloat16 or float16 weight, not {weight.dtype} "
                         f"of shape {tuple(weight.shape)}")
    return weight.t().contiguous()


def invariant_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [m, k] (rows with unit column stride, the packed weight's dtype and device) times a weight from
    `pack_weight` (+ a float32 bias of `out_features` values) -> [m, out_features] in x's dtype, every row
    computed alike whatever m is (the module's invariant)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"invariant_linear takes x [m, k] with contiguous rows, not shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m, k = x.shape
    if x.dtype != packed.dtype or x.device != packed.device:
        raise ValueError(f"invariant_linear takes inputs of the weight's dtype and device ({packed.dtype} on "
                         f"{packed.device}), not {x.dtype} on {x.device}")
    if tuple(packed.shape) != (k, out_features):
        raise ValueError(f"invariant_linear: the packed weight is {tuple(packed.shape)}, not (in_features {k}, "
                         f"out_features {out_features}) for these inputs")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features
                             or bias.device != x.device):
        raise ValueError("invariant_linear takes a float32 bias of one value per output, on the inputs' device")
    out = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = tiling(out_features, k, x.dtype)
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(out_features, t.block_n)
    programs = min(tiles, _program_count(x.device))
    upcast = INTERPRETED and x.dtype != torch.float32
    invariant_matmul_kernel[(programs,)](
        x, packed, bias if bias is not None else packed, out, m, out_features, k, x.stride(0), out.stride(0),
        programs, HAS_BIAS=bias is not None, EVEN_K=k % t.block_k == 0, UPCAST=upcast,
        IEEE=x.dtype == torch.float32 or upcast, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=GROUP_M, num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def _program_count(device: torch.device) -> int:
    """The persistent grid's size: one program per SM on CUDA, a fixed few in the interpreter."""
    if device.type != "cuda":
        return INTERPRETED_PROGRAMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
