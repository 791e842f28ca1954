"""GPT-OSS's experts: biased gate, up and down projections and the clamped SwiGLU between them, and the
translation of its checkpoint's stacked expert tensors into one such MLP per expert.

The checkpoint stores each layer's experts stacked and transposed relative to nn.Linear:
`mlp.experts.gate_up_proj` [E, hidden, 2 * inter] with the gate and up features interleaved (column 2i is gate
feature i, column 2i + 1 up feature i, as transformers' GptOssExperts slices them), `gate_up_proj_bias`
[E, 2 * inter], `down_proj` [E, inter, hidden], `down_proj_bias` [E, hidden]; the router is `mlp.router`
(weight and bias). `gpt_oss_expert_tensors` gives them the per-expert names of the decoder's experts
(`mlp.experts.N.gate_proj.weight` [inter, hidden]..., the router `mlp.gate.`), which load like every
other MoE family's, de-interleaved so that an expert's fused gate_up_proj is [gate | up] as everywhere else.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from tokenmill.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenmill.parallel.group import TPGroup


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's activation on a fused [gate | up] input: gate clamped above at `limit`, up to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate), in x's dtype as transformers computes it."""

    def __init__(self, limit: float, alpha: float) -> None:
        super().__init__()
        self.limit, self.alpha = limit, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * inter] -> [T, inter]; element-wise, so a row's result never depends on the other rows."""
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class BiasedExpertMLP(nn.Module):
    """One GPT-OSS expert: down(clamped_swiglu(gate_up(x))), every projection with a bias. Its layers are the
    decoder's ordinary linear layers, so it loads, splits across ranks and picks kernels like a GatedMLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, alpha: float, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=True, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=True, tp=tp)
        self.act = ClampedSwiGLU(limit, alpha)

    def intermediate(self, x: torch.Tensor) -> torch.Tensor:
        """clamped_swiglu(gate_up(x)), what the down projection takes (MoEBlock runs an expert in these two steps)."""
        return self.act(self.gate_up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.intermediate(x))


_STACKED_SUFFIXES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def gpt_oss_expert_tensors(weights: Iterable[tuple[str, Any]], num_experts: int, hidden_size: int,
                           intermediate_size: int, local: Optional[range] = None) -> Iterator[tuple[str, Any]]:
    """GPT-OSS checkpoint tensors with its stacked experts split into per-expert tensors (module docstring) and
    its router renamed `mlp.gate`; other tensors pass as they are. A stacked tensor of another shape than the
    config's raises ValueError naming both. `local` (expert parallelism): only those experts, renumbered from 0."""
    experts = local if local is not None else range(num_experts)
    expected = {"gate_up_proj": (num_experts, hidden_size, 2 * intermediate_size),
                "gate_up_proj_bias": (num_experts, 2 * intermediate_size),
                "down_proj": (num_experts, intermediate_size, hidden_size),
                "down_proj_bias": (num_experts, hidden_size)}
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        prefix, _, suffix = name.rpartition(".mlp.experts.")
        if not prefix or suffix not in _STACKED_SUFFIXES:
            yield name, tensor
            continue
        if tuple(tensor.shape) != expected[suffix]:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but the config's experts "
                             f"need {expected[suffix]} (num_local_experts {num_experts}, hidden_size {hidden_size}, "
                             f"intermediate_size {intermediate_size})")
        for index, expert in enumerate(experts):
            at = f"{prefix}.mlp.experts.{index}"
            part = tensor[expert]
            if suffix == "gate_up_proj":  # [hidden, 2 * inter], interleaved columns -> nn.Linear rows
                yield f"{at}.gate_proj.weight", part[:, 0::2].t().contiguous()
                yield f"{at}.up_proj.weight", part[:, 1::2].t().contiguous()
            elif suffix == "gate_up_proj_bias":
                yield f"{at}.gate_proj.bias", part[0::2].contiguous()
                yield f"{at}.up_proj.bias", part[1::2].contiguous()
            elif suffix == "down_proj":  # [inter, hidden] -> [hidden, inter]
                yield f"{at}.down_proj.weight", part.t().contiguous()
            else:
                yield f"{at}.down_proj.bias", part.contiguous()
