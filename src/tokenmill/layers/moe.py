"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek, GPT-OSS, Llama 4): a router picks `top_k`
of `num_experts` gated experts per token, and the token's output is the routing-weighted sum of those experts'
outputs (Llama 4, scoring "sigmoid_input": the plain sum of the experts' outputs, each expert given the token's row
scaled by that expert's weight, `route_sigmoid_input`).

The experts run grouped: the (token, choice) pairs are sorted by expert, each expert multiplies all the
rows routed to it in one product, and the results are put back in (token, choice) order and summed with
the routing weights. Python loops over the experts hit by the step, never over tokens. Experts are the
decoder's gated MLPs, so their weights load, quantise (int8/int4, per expert) and pick kernels like any
projection.

Expert parallelism (`TPGroup.expert_parallel`, --enable-expert-parallel): under tensor parallelism the
block's input is replicated on every rank. Rank r of N holds only the experts [r*E/N, (r+1)*E/N), whole
(not split across ranks); the router and the shared experts are replicated.
- Dispatch: every rank routes every token (the same routing on every rank: same input, same router) and
  runs its experts on the (token, choice) slots routed to them. The rows are already there (the input is
  replicated), so dispatching costs no traffic.
- Combine, one all-to-all: the tokens are split into N contiguous shares, rank r owning share r. Each
  rank sends each slot's expert output (in x's dtype, as computed) to the owner of the slot's token. Each
  owner then takes the weighted sum of its tokens (`combine`) exactly as one rank does.
- The owners' sums are all-gathered, so every rank holds the whole [T, hidden] output again.
It is the one-rank output bit for bit: every slot's output is computed by exactly one rank (the holder of
its expert) and arrives unchanged at its token's owner, and `combine` is row-wise.
Traffic per MoE layer: each slot's output crosses at most once (T * top_k * hidden values in all, fewer
where a token's owner holds its expert), then T * hidden values are gathered.
Tensor parallelism of the experts (a tensor-parallel group without expert parallelism): every rank holds
every expert, split along the intermediate dimension as a dense MLP is (layers/linear.py): its slice of
each expert's gate and up rows, and of down either the output features for the whole intermediate (exact,
`tp.exact`, the default) or its slice's columns (partial sums). Each rank routes every token alike and
computes its slice of every slot's intermediate; then, once per layer for all experts:
- exact: the slices are all-gathered (each slot's whole intermediate on every rank), each rank computes
  and combines its output features, and those are all-gathered: the one-rank output bit for bit (every
  output element is the same dot product and the same weighted sum);
- partial sums: each rank combines its partial down outputs in float32 and the sums are all-reduced
  (TPGroup.all_reduce: in rank order), then rounded once to x's dtype.

Fused path (layers/fused_moe.py): wherever the product kernels are Triton's (TritonProducts: CUDA's default,
--linear-kernel triton: on CPU tensors in Triton's interpreter), `use_kernel` stacks the experts' weights
once and the layer routes, sorts and multiplies in a fixed number of Triton launches with no host sync (a
MoE layer then runs inside a CUDA graph; under expert parallelism the all-to-all's counts still need one).
Its combine is `combine`, so it has the loop's semantics; elsewhere (the CPU default) the loop below runs.

Batch invariance (a token's output does not depend on what shares its step): an expert's row count
depends on the batch, and PyTorch's float32 matmul gives a row other bits at other row counts (one row
runs as a GEMV, more as a GEMM: through F.linear every row of a 64-token step differed from the same
token alone). So every product here, the router's and the experts', goes through the model's linear
kernels (`DecoderForCausalLM.apply_kernels`): with `batch_invariant` and the native kernels those compute a row alike
at any row count, for float and quantised weights (layers/linear_kernels.py). Routing (softmax, top-k,
normalisation) is row-wise, and the weighted sum adds a token's choices in rank order in float32 (rounded
once: in bfloat16 more precise than HF, which rounds each expert's share), so neither depends on the
batch. Without the native kernels (TOKENMILL_KERNELS=off, linear_kernel="dense") the products are
`F.linear`, as in the dense layers, and no layer is batch-invariant.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.w8a8 import INT8, W8A8Weight
from tokenmill.layers.invariant_ops import elementwise
from tokenmill.layers.linear import default_weight_loader
from tokenmill.layers.linear_kernels import LinearKernel, make_kernel
from tokenmill.parallel.group import TPGroup

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tokenmill.models.arch import MoEConfig


class Router(nn.Module):
    """The gate: one logit per expert, x W^T with W [num_experts, hidden].

    Never quantised (it has no `quantize_to`; a quantised checkpoint's router is dequantised): a small
    error in a logit can flip which experts a token gets, which changes its output far more than the error.

    `correction_bias` (sigmoid routing, DeepSeek-V3's noaux_tc): the router also holds
    `e_score_correction_bias` [num_experts], and both it and the weight are float32 whatever the model's
    dtype, the logits computed in float32 (transformers keeps both in float32 too).
    `bias` (GPT-OSS): a per-expert bias added to the logits.
    """

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = False, bias: bool = False) -> None:
        super().__init__()
        dtype = torch.float32 if correction_bias else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False)
                                        if correction_bias else None)
        self.kernel: Optional[LinearKernel] = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        """Copy the checkpoint's router weight (a QuantizedWeight dequantised) or correction bias, naming the
        expert counts when the checkpoint's disagrees with the config's."""
        if param.dim() == 1 and tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"the checkpoint's router bias (e_score_correction_bias or bias) has shape "
                             f"{tuple(loaded.shape)}, but the "
                             f"config has num_experts={param.shape[0]}")
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"the checkpoint's router weight has shape {tuple(loaded.shape)}: "
                             f"{loaded.shape[0]} experts of width {loaded.shape[-1]}, but the config has "
                             f"num_experts={param.shape[0]} and hidden_size={param.shape[1]}")
        default_weight_loader(param, loaded)

    def use_kernel(self, packed: bool, native: Any = None, batch_invariant: bool = True) -> None:
        """After loading: multiply through `make_kernel` like the projections (unpacked: it is small)."""
        self.kernel = make_kernel(self.weight.data, None if self.bias is None else self.bias.data, False, native,
                                  batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> logits [T, num_experts] in x's dtype (as HF computes them), in float32 for a router
        with a correction bias."""
        if self.e_score_correction_bias is not None:
            x = x.float()
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)


def route(logits: torch.Tensor, top_k: int, normalize: bool, scale: float = 1.0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's top-k routing: softmax over all experts in float32, the `top_k` largest kept (in descending
    order), renormalised to sum 1 when `normalize`, times `scale`.

    logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]). Row-wise throughout.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's routing (transformers' GptOssTopKRouter): the `top_k` largest logits (in descending order), then
    a softmax over those k alone, in the logits' dtype as HF computes it; weights returned in float32.

    logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]). Row-wise throughout."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1).float(), ids


def route_sigmoid_input(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's routing (transformers' Llama4Router): the `top_k` largest logits (in descending order), each
    expert's weight sigmoid(logit) computed in float32 and rounded to the logits' dtype, as HF scales the expert's
    input by it. logits [T, E] -> (weights [T, top_k] in the logits' dtype, expert ids int64 [T, top_k]). Row-wise."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return elementwise(torch.sigmoid, values.float()).to(logits.dtype), ids


def route_grouped_sigmoid(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
                          topk_groups: int, normalize: bool, scale: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc routing, as transformers' DeepseekV3TopkRouter: scores sigmoid(logits) in
    float32; experts are chosen by score + `correction_bias`, within the `topk_groups` of `num_groups` equal
    groups of experts whose two best biased scores sum highest, the `top_k` best (in descending order); their
    weights are their unbiased scores, renormalised to sum 1 (+ 1e-20) when `normalize`, times `scale`.

    logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]). Row-wise throughout.
    Invariant (the config's check): top_k <= topk_groups * E / num_groups, so no masked expert is chosen."""
    scores = elementwise(torch.sigmoid, logits.float())
    choice = scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    per_group = num_experts // num_groups
    group_scores = choice.view(num_tokens, num_groups, per_group).topk(2, dim=-1).values.sum(dim=-1)
    kept_groups = torch.topk(group_scores, topk_groups, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids


def local_experts(num_experts: int, tp: TPGroup) -> range:
    """The experts this rank holds: all of them, or under expert parallelism its contiguous share
    [rank * E/N, (rank + 1) * E/N) (ValueError naming the numbers when N does not divide E)."""
    if not tp.expert_parallel or tp.size == 1:
        return range(num_experts)
    share = experts_per_rank(num_experts, tp.size)
    return range(tp.rank * share, (tp.rank + 1) * share)


def experts_per_rank(num_experts: int, tp_size: int) -> int:
    """How many experts each of `tp_size` ranks holds under expert parallelism (ValueError naming the
    numbers when they do not divide)."""
    if num_experts % tp_size:
        raise ValueError(f"expert parallelism: tensor_parallel_size {tp_size} does not divide the model's "
                         f"{num_experts} experts")
    return num_experts // tp_size


def combine(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routing-weighted sum of each token's choices: per_slot [T, top_k, hidden] (the experts'
    outputs), weights float32 [T, top_k] -> float32 [T, hidden].

    In float32, choices added in rank order, row by row: the same operations for a token in any batch,
    and the same at one rank and at its owner under expert parallelism."""
    out = per_slot[:, 0].float() * weights[:, :1]
    for j in range(1, per_slot.shape[1]):
        out += per_slot[:, j].float() * weights[:, j:j + 1]
    return out


def unfused_experts(moe: MoEConfig) -> Optional[str]:
    """Which experts the fused Triton MoE kernels (layers/fused_moe.py) cannot run, said for a log line and
    README's support table, or None when they can: GPT-OSS's (biased, clamped SwiGLU) and Llama 4's (routing
    weights scaling their inputs) run one by one on the Triton products instead."""
    if moe.swiglu_limit is not None:
        return "GPT-OSS's experts (biased projections, clamped SwiGLU)"
    if moe.scoring == "sigmoid_input":
        return "Llama 4's experts (routing weights scaling their inputs)"
    if moe.expert_activation == "relu2":
        return "Nemotron-H's experts (relu², no gate)"
    return None


class MoEBlock(nn.Module):
    """Sparse MLP: `gate` (Router), `experts` (this rank's gated MLPs of the expert width: all
    num_experts, or under expert parallelism the `local` range, `experts[i]` being expert
    `local.start + i`) and, when `shared_intermediate_size` > 0, `shared_experts`: one always-on gated MLP
    added to every token's output (DeepSeek's shared experts, fused), scaled per token by
    sigmoid(`shared_expert_gate`(x)) where the config has that gate (Qwen2-MoE's shared_expert_gate: a one-output
    Router, so never quantised and multiplied through the model's kernels like the router).

    `make_expert(width)` builds one expert MLP (the decoder's dense gated MLP class, GPT-OSS's biased one, or
    Nemotron-H's relu² MLP without a gate; each has `intermediate`, the step before its down projection; whole
    under expert parallelism, else split over the tensor-parallel ranks like a dense MLP), so experts hold their weights
    in the ordinary linear layers: they load, quantise (`quantize_to`, quantised checkpoints) and pick
    kernels exactly like the dense projections. On the fused path (`use_kernel`) their weights move into
    `fused` and `experts` is emptied.
    """

    def __init__(self, moe: MoEConfig, hidden_size: int, make_expert: Callable[[int], nn.Module],
                 tp: TPGroup) -> None:
        super().__init__()
        if not 0 < moe.top_k <= moe.num_experts:
            raise ValueError(f"top_k ({moe.top_k}) must be between 1 and num_experts ({moe.num_experts})")
        self.moe, self.tp = moe, tp
        self.local = local_experts(moe.num_experts, tp)
        self.expert_parallel = len(self.local) < moe.num_experts
        self.split_experts = tp.size > 1 and not tp.expert_parallel  # each expert's intermediate split
        if moe.scoring not in ("softmax", "sigmoid", "topk_softmax", "sigmoid_input"):
            raise ValueError(f"unsupported MoE scoring {moe.scoring!r}; supported: softmax, sigmoid, topk_softmax, "
                             "sigmoid_input")
        # Llama 4: the routing weights scale the experts' inputs; their outputs are added as they are
        self.weights_inputs = moe.scoring == "sigmoid_input"
        self.gate = Router(hidden_size, moe.num_experts, correction_bias=moe.scoring == "sigmoid",
                           bias=moe.router_bias)
        self.experts = nn.ModuleList(make_expert(moe.intermediate_size) for _ in self.local)
        self.shared_experts = make_expert(moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = Router(hidden_size, 1) if moe.shared_expert_gate else None
        self.fused: Any = None  # FusedExperts (layers/fused_moe.py) once `use_kernel` chose the fused path

    _unfused_logged = False  # GPT-OSS's (or Llama 4's) experts left unfused: said once a process

    def use_kernel(self, packed: bool, native: Any = None, batch_invariant: bool = True) -> None:
        """After loading: where the product kernels `native` are Triton's (`on_device`: CUDA's default,
        `--linear-kernel triton` anywhere), stack the experts' weights for the fused path
        (layers/fused_moe.py) and drop the experts' layers; else (the CPU, `--linear-kernel dense`) the
        experts run one by one.

        Invariant: this runs before the experts' own layers pick kernels (they still hold their loaded
        weights): `DecoderForCausalLM._use_linear_kernels` walks `modules()`, which yields a module before
        its children, and the children it then visits are the emptied `experts`."""
        if not getattr(native, "on_device", False) or not self.experts:
            return
        which = unfused_experts(self.moe)
        if which is not None:
            if not MoEBlock._unfused_logged:
                MoEBlock._unfused_logged = True
                logger.info("%s have no fused Triton kernel yet: they run one by one on the Triton products (a host "
                            "sync per MoE layer, so its steps run without CUDA graphs' gain there)", which)
            return
        from tokenmill.layers.fused_moe import FusedExperts, StackedWeight

        gate_up = StackedWeight.of([_loaded_weight(e.gate_up_proj) for e in self.experts])
        down = StackedWeight.of([_loaded_weight(e.down_proj) for e in self.experts])
        self.fused = FusedExperts(gate_up, down, self.local.start, batch_invariant)
        self.experts = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the same on every rank) -> [T, hidden]."""
        moe = self.moe
        weights, ids = self.route(self.gate(x))
        input_scales = None
        if self.weights_inputs:  # (never fused: use_kernel leaves these experts unfused)
            input_scales, weights = weights.reshape(-1), torch.ones(weights.shape, device=x.device)
        if self.expert_parallel:
            order, mine, counts = self.slot_order(ids)
            if self.fused is not None:
                grouped = self.fused_slot_outputs(x, ids)[mine]
            else:
                grouped = self.looped_outputs(x, mine, counts, input_scales)
            out = self.combined_across_ranks(x, weights, ids, order, mine, grouped)
        else:
            if self.fused is not None:
                per_slot = self.fused_slot_outputs(x, ids)
            else:
                order, mine, counts = self.slot_order(ids)
                grouped = self.looped_outputs(x, mine, counts, input_scales)
                per_slot = torch.empty_like(grouped)
                per_slot[order] = grouped  # invariant: `order` is a permutation, so every slot is written once
            sums = combine(per_slot.view(x.shape[0], moe.top_k, per_slot.shape[-1]), weights)
            out = self.finish_split_sums(sums, x.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:  # in x's dtype, as HF scales it
                shared = elementwise(torch.sigmoid, self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's routing (weights float32 [T, top_k], expert ids [T, top_k]): softmax top-k (`route`) or
        sigmoid grouped top-k (`route_grouped_sigmoid`), by the fused kernel on the fused path."""
        moe, bias = self.moe, self.gate.e_score_correction_bias
        if moe.scoring == "topk_softmax":  # (never fused: use_kernel leaves GPT-OSS's experts unfused)
            return route_topk_softmax(logits, moe.top_k)
        if moe.scoring == "sigmoid_input":  # (nor Llama 4's)
            return route_sigmoid_input(logits, moe.top_k)
        if self.fused is not None:
            from tokenmill.layers.fused_moe import route as fused_route

            return fused_route(logits, moe.top_k, moe.norm_topk_prob, moe.routed_scaling_factor, bias,
                               moe.num_groups, moe.topk_groups)
        if bias is not None:
            return route_grouped_sigmoid(logits, bias, moe.top_k, moe.num_groups, moe.topk_groups,
                                         moe.norm_topk_prob, moe.routed_scaling_factor)
        return route(logits, moe.top_k, moe.norm_topk_prob, moe.routed_scaling_factor)

    def slot_order(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(order, mine, counts): `order` every (token, choice) slot s = t * top_k + j sorted by expert
        (stable: token order within one); `mine` the run of `order` routed to this rank's experts; `counts`
        the slots of each expert (on the host: one device sync)."""
        slots = ids.reshape(-1)
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.moe.num_experts).tolist()
        # this rank's experts' slots are contiguous in `order`: [first, last)
        first = sum(counts[:self.local.start])
        last = first + sum(counts[self.local.start:self.local.stop])
        return order, order[first:last], counts

    def looped_outputs(self, x: torch.Tensor, mine: torch.Tensor, counts: list[int],
                       input_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The outputs of the slots `mine` (this rank's experts', sorted by expert) [len(mine), hidden out]
        in x's dtype, one product per expert hit and projection; `input_scales` (Llama 4: [T * top_k] in x's
        dtype, slot s's routing weight) scale each slot's input row first, as HF scales it."""
        rows = x[mine // self.moe.top_k]  # each local expert's rows contiguous, in token order
        if input_scales is not None:
            rows = rows * input_scales[mine, None]
        runs = [(index, counts[expert]) for index, expert in enumerate(self.local) if counts[expert]]
        hidden = []
        start = 0
        for index, count in runs:
            expert = self.experts[index]
            hidden.append(expert.intermediate(rows[start:start + count]))
            start += count
        if not runs:
            return rows.new_empty(0, self.experts[0].down_proj.out_features)
        whole = self.whole_intermediate(torch.cat(hidden))
        grouped = []
        start = 0
        for index, count in runs:
            grouped.append(self.experts[index].down_proj.local_forward(whole[start:start + count]))
            start += count
        return torch.cat(grouped)

    def fused_slot_outputs(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every slot's expert output [T * top_k, hidden out] in x's dtype by the fused kernels (slots of
        other ranks' experts left unwritten). No host sync."""
        slots = self.fused.plan(ids)
        return self.fused.down_product(self.whole_intermediate(self.fused.gate_up_act(x, slots)), slots)

    def whole_intermediate(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the slots' intermediate -> what its down projections take: the whole
        intermediate where the experts are split exactly (all-gathered, in rank order = feature order),
        else as it is."""
        if self.split_experts and self.tp.exact:
            return self.tp.all_gather_last_dim(hidden)
        return hidden

    def finish_split_sums(self, sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The combined float32 sums -> [T, hidden] in `dtype` on every rank: as they are at one rank; split
        exactly, each rank's output features rounded and all-gathered; split by partial sums, all-reduced
        in float32 and rounded once."""
        if not self.split_experts:
            return sums.to(dtype)
        if self.tp.exact:
            return self.tp.all_gather_last_dim(sums.to(dtype))
        return self.tp.all_reduce(sums).to(dtype)

    def combined_across_ranks(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                              order: torch.Tensor, mine: torch.Tensor, grouped: torch.Tensor) -> torch.Tensor:
        """Expert parallelism's combine (module docstring): this rank's slot outputs go to their tokens'
        owners by one all-to-all, each owner sums its tokens, and the sums are all-gathered. -> [T, hidden]."""
        tp, top_k = self.tp, self.moe.top_k
        num_tokens = x.shape[0]
        bounds = [r * num_tokens // tp.size for r in range(tp.size + 1)]  # rank r owns tokens [bounds[r], bounds[r+1])
        owner = torch.searchsorted(torch.tensor(bounds[1:], device=x.device), torch.arange(num_tokens, device=x.device),
                                   right=True)
        sent_to = owner[mine // top_k]
        send_counts = torch.bincount(sent_to, minlength=tp.size).tolist()
        outgoing = grouped[torch.argsort(sent_to, stable=True)]  # by owner, `order` kept within one
        # what this rank receives: its tokens' slots in `order`, which lists rank 0's experts first, then
        # rank 1's...: rank q's rows arrive in the order rank q sends them
        owned = order[owner[order // top_k] == tp.rank]
        from_rank = ids.reshape(-1)[owned] // len(self.local)
        recv_counts = torch.bincount(from_rank, minlength=tp.size).tolist()
        received = tp.all_to_all(outgoing, send_counts, recv_counts)
        first, end = bounds[tp.rank], bounds[tp.rank + 1]
        per_slot = torch.empty((end - first) * top_k, x.shape[-1], dtype=grouped.dtype, device=x.device)
        # invariant: each slot's expert lives on exactly one rank, which sent its output here once
        per_slot[owned - first * top_k] = received
        sums = combine(per_slot.view(end - first, top_k, x.shape[-1]), weights[first:end]).to(x.dtype)
        return tp.all_gather_rows(sums, [bounds[r + 1] - bounds[r] for r in range(tp.size)])

    def describe(self) -> Optional[str]:
        """'experts 4-7 of 8' under expert parallelism, else None."""
        if not self.expert_parallel:
            return None
        return f"experts {self.local.start}-{self.local.stop - 1} of {self.moe.num_experts}"


def _loaded_weight(layer: nn.Module) -> Any:
    """A projection's loaded weight, before it picks a kernel: its QuantizedWeight or float tensor (an
    int8 W8A8 weight as the packed int8 weight the fused experts take)."""
    if isinstance(layer.quantized, W8A8Weight) and layer.quantized.values is INT8:
        return layer.quantized.to_packed_int8()
    if layer.quantized is not None:
        return layer.quantized
    if layer.weight is None:
        raise ValueError("an expert's weight was already handed to its kernel; stack the experts before "
                         "their layers pick kernels")
    return layer.weight.data


# Mixtral's expert projections: w1 = gate, w3 = up, w2 = down
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_TENSOR = re.compile(r"\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.")


def expert_checkpoint_names(weights: Iterable[tuple[str, Any]], moe: MoEConfig, hidden_size: int,
                            local: Optional[range] = None) -> Iterator[tuple[str, Any]]:
    """HF checkpoint tensors with the MoE names made uniform: Mixtral's `block_sparse_moe.` becomes `mlp.`,
    Qwen2-MoE's `mlp.shared_expert.` becomes DeepSeek's `mlp.shared_experts.`,
    and its `experts.N.w1/w3/w2` become `experts.N.gate_proj/up_proj/down_proj` (the Qwen3-MoE / OLMoE
    names, which the decoder's loader fuses into each expert's gate_up_proj). An expert tensor the config
    has no place for (an expert index past num_experts, another width) raises ValueError naming both.

    `local` (expert parallelism: this rank's experts, see `local_experts`): other experts' tensors are
    dropped (after the checks above) and N becomes the index in `MoEBlock.experts`, N - local.start."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")  # Qwen2-MoE's one shared expert
        match = _EXPERT_TENSOR.search(name)
        if match is not None:
            index, projection = int(match.group(1)), match.group(2)
            if index >= moe.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} belongs to expert {index}, but the config has "
                                 f"num_experts={moe.num_experts} (experts 0-{moe.num_experts - 1})")
            projection = _MIXTRAL_PROJECTIONS.get(projection, projection)
            width = moe.intermediate_size
            expected = (hidden_size, width) if projection == "down_proj" else (width, hidden_size)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but the config's "
                                 f"experts have {expected} (expert width {width}, hidden_size {hidden_size})")
            if local is not None:
                if index not in local:
                    continue  # another rank's expert
                index -= local.start
            name = f"{name[:match.start()]}.mlp.experts.{index}.{projection}.{name[match.end():]}"
        yield name, tensor
