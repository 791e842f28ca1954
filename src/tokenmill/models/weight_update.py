"""A loaded model's weights replaced in place by another checkpoint's of the same model (an RL trainer's new
weights): the checkpoint is loaded into a second model built exactly as the first (its products' packed and
quantised weights made the same way), every tensor the two hold is paired and checked, and only then copied over.

In place, so every pointer into the weights stays valid: the one-call fused step's structures, CUDA graphs, an
EAGLE-3 head's reference to the target's embedding. Atomic: a checkpoint of another shape or format fails the
check before anything is copied, and the old weights go on serving. The price is the staging model: a second copy
of the weights in memory until the copy is done.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from tokenmill.models.arch import ArchConfig
from tokenmill.models.loader import ModelSource


def held_tensors(owner: Any, depth: int = 2) -> list[torch.Tensor]:
    """The non-empty tensors `owner` holds, in a fixed order: a module's own parameters and buffers, its tensor
    attributes, and those of the plain objects it keeps (its products' kernels), `depth` levels down; not its
    submodules'."""
    if owner is None:
        return []
    found = []
    values = dict(vars(owner))
    if isinstance(owner, torch.nn.Module):
        values.update(owner._parameters)
        values.update(owner._buffers)
    for value in values.values():
        if isinstance(value, torch.Tensor):
            if value.numel():
                found.append(value)
        elif depth and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
            found.extend(held_tensors(value, depth - 1))
    return found


def check_same_model(serving: ArchConfig, update: ArchConfig, where: str) -> None:
    """ValueError naming the settings in which the checkpoint at `where` differs from the model being served."""
    differ = [f.name for f in dataclasses.fields(serving) if getattr(serving, f.name) != getattr(update, f.name)]
    if differ:
        shown = ", ".join(f"{name} {getattr(update, name)!r} (serving {getattr(serving, name)!r})" for name in differ[:4])
        raise ValueError(f"the weights at {where!r} are not of the model being served: {shown}")


def copy_weights_in_place(model: torch.nn.Module, staged: torch.nn.Module) -> int:
    """Copy every tensor `staged` (a model built as `model` was, from the new checkpoint) holds into `model`'s,
    after checking that they pair up module by module in number, shape, dtype and layout (ValueError naming the
    first that does not, nothing copied). Returns the bytes copied."""
    pairs = []
    for (name, module), (staged_name, staged_module) in zip(model.named_modules(), staged.named_modules(),
                                                            strict=True):
        old, new = held_tensors(module), held_tensors(staged_module)
        if name != staged_name or len(old) != len(new) or any(
                (a.shape, a.dtype, a.layout) != (b.shape, b.dtype, b.layout) for a, b in zip(old, new)):
            shapes = lambda tensors: [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]  # noqa: E731
            raise ValueError(f"the new weights of {name or 'the model'} are packed differently: {shapes(new)} "
                             f"against {shapes(old)} (another quantisation, or another format)")
        pairs.extend(zip(old, new))
    with torch.no_grad():
        for old, new in pairs:
            old.copy_(new)
    return sum(old.numel() * old.element_size() for old, _ in pairs)


def overlaid_source(source: ModelSource, tensors: dict[str, torch.Tensor]) -> ModelSource:
    """`source` whose weight stream yields `tensors` in place of the checkpoint's tensors of the same names (a
    trainer's update). ValueError, as the stream reaches them, for a name the checkpoint lacks, a shape it does not
    have, or a tensor the checkpoint stores quantised (re-quantising a trainer's float tensor into a GGUF or packed
    checkpoint's own encoding is not done: serve float weights, or quantise at load with --quantization)."""

    def stream(keep_quantized: bool) -> Iterator[tuple[str, Any]]:
        unseen = set(tensors)
        for name, stored in source.weight_stream(keep_quantized):
            new = tensors.get(name)
            if new is None:
                yield name, stored
                continue
            if not isinstance(stored, torch.Tensor):
                raise ValueError(f"{name!r} is stored quantised ({type(stored).__name__}) in the served checkpoint: "
                                 "a float tensor cannot replace it (serve float weights, or quantise at load with "
                                 "--quantization)")
            if new.shape != stored.shape:
                raise ValueError(f"weight shape mismatch for {name!r}: sent {tuple(new.shape)}, the checkpoint's is "
                                 f"{tuple(stored.shape)}")
            unseen.discard(name)
            yield name, new
        if unseen:
            raise ValueError(f"{len(unseen)} tensors sent have no place in the checkpoint, e.g. {sorted(unseen)[:3]}")

    return dataclasses.replace(source, weight_stream=stream)
