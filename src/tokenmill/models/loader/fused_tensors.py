"""Checkpoint tensors that hold several projections at once (Phi-3's `qkv_proj` and `gate_up_proj`), split at
load into the q/k/v and gate/up tensors every other checkpoint has, so the decoder loads them as it loads those
(each rank taking its own heads and rows of each part)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from tokenmill.models.arch import ArchConfig


def split_fused_projections(weights: Iterable[tuple[str, Any]], arch: ArchConfig) -> Iterator[tuple[str, Any]]:
    """`weights` with each `...self_attn.qkv_proj.{weight,bias}` split by rows into q_proj, k_proj and v_proj
    (num_attention_heads, then num_key_value_heads twice, heads of head_dim rows) and each
    `...mlp.gate_up_proj.weight` into gate_proj then up_proj (intermediate_size rows each); other tensors pass.
    ValueError for a fused tensor of another size or one kept quantised (its packed rows are not split)."""
    q_rows = arch.num_attention_heads * arch.head_dim
    kv_rows = arch.num_key_value_heads * arch.head_dim
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            parts = (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows))
            yield from _split(name, tensor, "qkv_proj", parts)
        elif ".mlp.gate_up_proj." in name:
            parts = (("gate_proj", arch.intermediate_size), ("up_proj", arch.intermediate_size))
            yield from _split(name, tensor, "gate_up_proj", parts)
        else:
            yield name, tensor


def _split(name: str, tensor: Any, fused: str, parts: tuple[tuple[str, int], ...]) -> Iterator[tuple[str, Any]]:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"checkpoint tensor {name!r}: a fused {fused} kept quantised is not supported")
    rows = sum(size for _, size in parts)
    if tensor.shape[0] != rows:
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the model's fused {fused} has "
                         f"{rows} ({' + '.join(str(size) for _, size in parts)})")
    start = 0
    for part, size in parts:
        yield name.replace(fused, part), tensor.narrow(0, start, size)
        start += size
