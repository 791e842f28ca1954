"""Llama 4's checkpoint tensors under the names and layouts the decoder loads (transformers' Llama4ForCausalLM):

- its MLP is `feed_forward.` (the decoder's `mlp.`), its router `feed_forward.router.` (`mlp.gate.`), its shared
  expert `feed_forward.shared_expert.` (`mlp.shared_experts.`);
- its routed experts are stacked: `experts.gate_up_proj` [E, hidden, 2 * inter] (gate columns, then up columns) and
  `experts.down_proj` [E, inter, hidden], split here into each expert's nn.Linear-shaped gate/up/down tensors;
- its RoPE turns adjacent pairs of a head's dims (transformers' complex-number form, `apply_rotary_emb`), where
  tokenmill's rotates dim i with dim i + head_dim / 2: each head's q and k rows are reordered from
  (0, 1, 2, 3, ...) to (0, 2, 4, ..., 1, 3, 5, ...), which turns the one form into the other. Invariant: q and k
  of every layer get the same reordering, so a NoPE layer's q . k is unchanged, and Llama 4's q/k L2 norm (a mean
  over the head's dims) commutes with it.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from tokenmill.models.arch import ArchConfig


def llama4_checkpoint_tensors(weights: Iterable[tuple[str, Any]], arch: ArchConfig) -> Iterator[tuple[str, Any]]:
    """`weights` (a Llama4ForCausalLM checkpoint's) renamed and reshaped as the module docstring says; other tensors
    pass as they are. ValueError naming the tensor for stacked experts of another shape than the config's, and for
    a q/k projection or stacked experts kept quantised (their rows cannot be reordered or split packed)."""
    moe = arch.moe
    for name, tensor in weights:
        name = name.replace(".feed_forward.router.", ".mlp.gate.")
        name = name.replace(".feed_forward.shared_expert.", ".mlp.shared_experts.")
        name = name.replace(".feed_forward.", ".mlp.")
        prefix, _, suffix = name.rpartition(".mlp.experts.")
        if prefix and suffix in ("gate_up_proj", "down_proj") and moe is not None:
            yield from _split_experts(name, tensor, prefix, suffix, moe.num_experts, arch.hidden_size,
                                      moe.intermediate_size)
        elif ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            yield name, _pairs_to_halves(name, tensor, arch.head_dim)
        else:
            yield name, tensor


def _split_experts(name: str, tensor: Any, prefix: str, suffix: str, num_experts: int, hidden: int,
                   inter: int) -> Iterator[tuple[str, Any]]:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"checkpoint tensor {name!r}: stacked experts kept quantised are not supported")
    expected = (num_experts, hidden, 2 * inter) if suffix == "gate_up_proj" else (num_experts, inter, hidden)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but the config's experts need "
                         f"{expected} (num_local_experts {num_experts}, hidden_size {hidden}, intermediate_size "
                         f"{inter})")
    for expert in range(num_experts):
        at, part = f"{prefix}.mlp.experts.{expert}", tensor[expert]
        if suffix == "gate_up_proj":  # [hidden, 2 * inter]: gate's columns, then up's -> nn.Linear rows
            yield f"{at}.gate_proj.weight", part[:, :inter].t().contiguous()
            yield f"{at}.up_proj.weight", part[:, inter:].t().contiguous()
        else:  # [inter, hidden] -> [hidden, inter]
            yield f"{at}.down_proj.weight", part.t().contiguous()


def _pairs_to_halves(name: str, tensor: Any, head_dim: int) -> torch.Tensor:
    """A q or k projection's weight [heads * head_dim, hidden] (or bias [heads * head_dim]) with each head's rows
    reordered from adjacent RoPE pairs to halves (module docstring)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"checkpoint tensor {name!r}: a Llama 4 q/k projection kept quantised is not supported "
                         "(its rows are reordered for tokenmill's RoPE layout)")
    rows = tensor.shape[0]
    if rows % head_dim or head_dim % 2:
        raise ValueError(f"checkpoint tensor {name!r} has {rows} rows, not whole heads of head_dim {head_dim}")
    heads = tensor.view(rows // head_dim, head_dim // 2, 2, *tensor.shape[1:])
    return heads.transpose(1, 2).reshape(tensor.shape).contiguous()
