"""Loading a module whose parameters are named as the checkpoint names its tensors (a vision tower, an encoder)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], architecture: str,
                       checkpoint_prefix: str, unused: Callable[[str], bool] = lambda name: False) -> None:
    """Copy tensors named as `module`'s parameters into them; ValueError when a tensor has no place (and is not
    `unused`), its shape differs, or a parameter is left unset. Errors name tensors as the checkpoint does
    (`checkpoint_prefix` + name)."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        if unused(name):
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor '{checkpoint_prefix}{name}' has no place in {architecture}")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"weight shape mismatch for '{checkpoint_prefix}{name}': checkpoint "
                             f"{tuple(tensor.shape)}, model expects {tuple(param.shape)}")
        param.data.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
