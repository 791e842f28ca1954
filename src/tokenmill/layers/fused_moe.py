"""The fused mixture of experts: routing, sorting and every expert's products in a fixed number of Triton
launches, with no host synchronisation, so a MoE layer runs inside a CUDA graph.

A step of T tokens, top_k choices each, over this rank's E experts:
1. `route`: one program per token: softmax in float32, top k, renormalised or not, times
   routed_scaling_factor (layers/moe.py's `route`, in one kernel); or, for a router with a correction bias,
   DeepSeek-V3's sigmoid grouped top k (layers/moe.py's `route_grouped_sigmoid`).
2. `plan`: the T * top_k (token, choice) slots sorted by expert, stably (token order within an expert), each
   expert's run padded to whole BLOCK_M-row blocks; three small kernels (count per chunk, offsets, scatter).
   The buffers have a fixed worst-case size, cdiv(S, BLOCK_M) + min(E, S) blocks for S slots, so no shape
   depends on the routing.
3. `gate_up`: one grouped product over all experts, each program one block of one expert's rows times
   BLOCK_N of its gate rows and the same of its up rows, writing silu(gate) * up -> [S, intermediate].
4. `down`: one grouped product of those rows with the experts' down weights -> [S, hidden] by slot.
The caller sums each token's choices with the routing weights (layers/moe.py's `combine`: float32, in rank
order), so the result has the same semantics as the Python loop over experts.

Weights are stacked once after loading into [E, N, K]: float weights in the compute dtype; quantised
weights in kernels/quantized.py's layout (values [E, N, bytes], scales and offsets [E, N, blocks], optional
int8 sub-scales), dequantised in registers inside the product (weight-only: the activations stay in the
compute dtype, as a W4A16 product).

Batch invariance: with `batch_invariant` the tile sizes are fixed (they depend on the weight's shape only),
so a row's arithmetic does not depend on how many rows its expert got; without it BLOCK_M grows with the
average rows per expert (prefill).

Imported only where the fused path runs (it imports triton).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton

from tokenmill.kernels.quantized import QuantizedWeight, cat_rows
from tokenmill.layers.fused_moe_kernels import (count_chunk_kernel, expert_offsets_kernel, grouped_gemm_kernel,
                                                route_grouped_sigmoid_kernel, route_topk_kernel,
                                                scatter_slots_kernel)

_FORMATS = {"float": 0, "int8": 1, "int4": 2}
BLOCK_K = 64  # a multiple of 64: an int4 step reads whole block pairs
INVARIANT_BLOCK_M = 16  # decode-sized blocks; fixed under batch invariance
_BLOCKS_TILE = 64


def route(logits: torch.Tensor, top_k: int, normalize: bool, scale: float = 1.0,
          correction_bias: Optional[torch.Tensor] = None, num_groups: int = 1, topk_groups: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's `route` in one kernel, or with `correction_bias` its `route_grouped_sigmoid`:
    logits [T, E] -> (weights float32 [T, top_k], ids int64 [T, top_k])."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens and correction_bias is not None:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        route_grouped_sigmoid_kernel[(num_tokens,)](
            logits, correction_bias.contiguous(), weights, ids, num_experts, logits.stride(0), float(scale),
            TOP_K=top_k, K_P=triton.next_power_of_2(top_k), E_P=triton.next_power_of_2(num_experts),
            GROUPS=num_groups, G_P=triton.next_power_of_2(num_groups), TOPK_GROUPS=topk_groups, NORMALIZE=normalize)
    elif num_tokens:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        route_topk_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), float(scale),
                                         TOP_K=top_k, K_P=triton.next_power_of_2(top_k),
                                         E_P=triton.next_power_of_2(num_experts), NORMALIZE=normalize)
    return weights, ids


@dataclass
class SortedSlots:
    """A step's slots sorted by expert (see the module docstring): `sorted_slots` int32 [blocks * block_m]
    (the sentinel `num_slots` on padding), `block_expert` int32 [blocks] (-1: unused)."""

    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    num_slots: int
    top_k: int
    block_m: int


def plan(ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int) -> SortedSlots:
    """Sort the slots of ids [T, top_k] (global expert ids) by this rank's experts [first_expert,
    first_expert + num_experts); slots of other experts are left out. Device-only, fixed-size outputs."""
    num_tokens, top_k = ids.shape
    num_slots = num_tokens * top_k
    device = ids.device
    flat = ids.reshape(-1)
    e_p = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 4096 // e_p))  # the [chunk, experts] one-hot tile stays register-sized
    num_chunks = max(1, triton.cdiv(num_slots, chunk))
    max_blocks = triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)
    sorted_slots = torch.full((max_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    counts = torch.empty(num_chunks, e_p, dtype=torch.int32, device=device)
    chunk_base = torch.empty(num_chunks, e_p, dtype=torch.int32, device=device)
    count_chunk_kernel[(num_chunks,)](flat, counts, num_slots, first_expert, num_experts, CHUNK=chunk, E_P=e_p)
    expert_offsets_kernel[(1,)](counts, chunk_base, block_expert, num_chunks, num_experts, max_blocks,
                                BLOCK_M=block_m, E_P=e_p, BLOCKS_TILE=_BLOCKS_TILE)
    scatter_slots_kernel[(num_chunks,)](flat, chunk_base, sorted_slots, num_slots, first_expert, num_experts,
                                        CHUNK=chunk, E_P=e_p)
    return SortedSlots(sorted_slots, block_expert, num_slots, top_k, block_m)


@dataclass
class StackedWeight:
    """Every local expert's [N, K] weight of one projection, stacked: `format` float (data [E, N, K] in the
    compute dtype) or int8/int4 (kernels/quantized.py's layout per expert, stacked on a first dimension)."""

    format: str
    rows: int  # N
    cols: int  # K
    data: torch.Tensor
    scale: Optional[torch.Tensor] = None
    offset: Optional[torch.Tensor] = None
    sub_scale: Optional[torch.Tensor] = None

    @staticmethod
    def of(weights: Sequence[object]) -> "StackedWeight":
        """Stack the experts' weights (float tensors, or QuantizedWeights: int4 stays int4 only where every
        expert's is, else all become int8, as a fused projection's parts do). ValueError on a mix of
        float and quantised experts or on experts of different shapes."""
        quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
        if quantized and len(quantized) != len(weights):
            raise ValueError("a mixture of experts needs all experts' weights float or all quantised, "
                             f"got {len(quantized)} quantised of {len(weights)}")
        shapes = {tuple(w.shape) for w in weights}
        if len(shapes) != 1:
            raise ValueError(f"the experts' weights differ in shape: {sorted(shapes)}")
        rows, cols = shapes.pop()
        if not quantized:
            return StackedWeight("float", rows, cols, torch.stack([w.contiguous() for w in weights]))
        fmt = "int4" if all(w.format == "int4" for w in quantized) else "int8"
        parts = [w.to_format(fmt) for w in quantized]
        # one scale dtype for all (cat_rows promotes to float32 when any part has float32 scales)
        merged = cat_rows(parts)
        count = len(parts)
        sub = None if merged.sub_scale is None else merged.sub_scale.view(count, rows, -1)
        return StackedWeight(fmt, rows, cols, merged.data.view(count, rows, -1), merged.scale.view(count, rows, -1),
                             merged.offset.view(count, rows, -1), sub)

    def strides(self) -> tuple[int, int, int, int, int, int]:
        """(expert, row) strides of the values, the scales/offsets and the sub-scales (0 where absent)."""
        scale = (0, 0) if self.scale is None else (self.scale.stride(0), self.scale.stride(1))
        sub = (0, 0) if self.sub_scale is None else (self.sub_scale.stride(0), self.sub_scale.stride(1))
        return (self.data.stride(0), self.data.stride(1), *scale, *sub)


class FusedExperts:
    """A MoE layer's local experts as two stacked weights and the grouped products over them.

    `gate_up` [E, 2 * I, H]: each expert's gate rows then its up rows (its MergedColumnParallelLinear's
    layout, so this rank's slice of the intermediate under tensor parallelism); `down` [E, H_out, I_in]: I_in
    is I, or the whole intermediate where split experts gather it first (layers/moe.py)."""

    def __init__(self, gate_up: StackedWeight, down: StackedWeight, first_expert: int, batch_invariant: bool,
                 block_n: int = 64) -> None:
        if gate_up.rows % 2:
            raise ValueError(f"gate_up has {gate_up.rows} rows: it needs as many gate rows as up rows")
        self.gate_up, self.down = gate_up, down
        self.first_expert, self.num_experts = first_expert, gate_up.data.shape[0]
        self.batch_invariant = batch_invariant
        self.block_n = block_n
        self.format = gate_up.format if gate_up.format == down.format else f"{gate_up.format}+{down.format}"

    @property
    def intermediate_size(self) -> int:
        """The width of this rank's gate (and up) rows: its slice of the experts' intermediate."""
        return self.gate_up.rows // 2

    def block_m(self, num_slots: int) -> int:
        """Rows per block: fixed under batch invariance; else grown with the average rows per expert."""
        if self.batch_invariant:
            return INVARIANT_BLOCK_M
        per_expert = num_slots / self.num_experts
        return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64

    def plan(self, ids: torch.Tensor) -> SortedSlots:
        """The step's slots sorted by this rank's experts."""
        return plan(ids, self.first_expert, self.num_experts, self.block_m(ids.numel()))

    def gate_up_act(self, x: torch.Tensor, slots: SortedSlots) -> torch.Tensor:
        """x [T, H] -> silu(gate) * up [S, I] by slot, in x's dtype (rows of other ranks' experts unwritten)."""
        out = x.new_empty(slots.num_slots, self.intermediate_size)
        self._product(x, out, self.gate_up, slots, rows_per_a=slots.top_k, gated=True)
        return out

    def down_product(self, h: torch.Tensor, slots: SortedSlots, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """h [S, I] -> [S, H_out] by slot, in `dtype` (default h's)."""
        out = h.new_empty(slots.num_slots, self.down.rows, dtype=dtype or h.dtype)
        self._product(h, out, self.down, slots, rows_per_a=1, gated=False)
        return out

    def _product(self, a: torch.Tensor, out: torch.Tensor, weight: StackedWeight, slots: SortedSlots,
                 rows_per_a: int, gated: bool) -> None:
        if weight.format == "float" and weight.data.dtype != a.dtype:
            raise ValueError(f"the experts' weights are {weight.data.dtype}, the input {a.dtype}")
        if a.stride(1) != 1:
            a = a.contiguous()
        n = weight.rows // 2 if gated else weight.rows
        block_n = min(self.block_n, max(16, triton.next_power_of_2(n)))
        blocks = slots.block_expert.shape[0]
        if not blocks or not n:
            return
        grid = (blocks * triton.cdiv(n, block_n),)
        dummy = weight.data  # an unused pointer where the weight has no scales or sub-scales
        grouped_gemm_kernel[grid](
            a, out, weight.data, dummy if weight.scale is None else weight.scale,
            dummy if weight.offset is None else weight.offset, dummy if weight.sub_scale is None else weight.sub_scale,
            slots.sorted_slots, slots.block_expert, slots.num_slots, n, weight.cols, a.stride(0), out.stride(0),
            *weight.strides(), ROWS_PER_A=rows_per_a, GATED=gated, FORMAT=_FORMATS[weight.format],
            HAS_SUB=weight.sub_scale is not None, IEEE=a.dtype == torch.float32,
            BLOCK_M=slots.block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K)
