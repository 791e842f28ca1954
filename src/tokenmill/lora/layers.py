"""The batched LoRA product: every adapter's delta added to the base projections in one step.

Each adapted projection holds, per loaded adapter, A stacked over the projections its fused layer
joins ([q; k; v] for qkv_proj, [gate; up] for gate_up_proj) and B as the block-diagonal matrix that maps
each part's rank back to its slice of the output, the scaling folded into B. A step groups its tokens by
adapter (`LoRAState.groups`, set by the runner); the layer adds B(A(x)) to each group's rows, one
product per adapter in the step, whatever the number of requests (S-LoRA/Punica's grouping). Both
products run on the engine's batch-invariant kernels, so a row's delta does not depend on its group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from tokenmill.layers.linear_kernels import LinearKernel, make_kernel
from tokenmill.lora.adapter_config import AdapterConfig
from tokenmill.lora.weights import AdapterTensors, read_adapter


@dataclass
class LoRAState:
    """The step's rows per adapter: (adapter id, row indices of the flattened batch); empty when no
    request of the step has an adapter."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LoRADeltas:
    """The adapters' deltas for one projection, fused over the checkpoint projections `parts` (name,
    first output feature, output features)."""

    def __init__(self, parts: list[tuple[str, int, int]], in_features: int, state: LoRAState) -> None:
        self.parts, self.in_features, self.state = parts, in_features, state
        self.out_features = sum(size for _, _, size in parts)
        self.adapters: dict[int, tuple[LinearKernel, LinearKernel]] = {}

    def add(self, adapter_id: int, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
            dtype: torch.dtype, native: Any, batch_invariant: bool) -> None:
        """Hold adapter `adapter_id`'s A and B of the parts it targets (`tensors` by part name)."""
        present = [(name, offset, size) for name, offset, size in self.parts if name in tensors]
        if not present:
            return
        rank = tensors[present[0][0]][0].shape[0]
        a = torch.cat([tensors[name][0] for name, _, _ in present]).to(dtype)
        b = torch.zeros(self.out_features, rank * len(present), dtype=torch.float32)
        for index, (name, offset, size) in enumerate(present):
            b[offset:offset + size, index * rank:(index + 1) * rank] = tensors[name][1].float() * scaling
        self.adapters[adapter_id] = (make_kernel(a.contiguous(), None, False, native, batch_invariant),
                                     make_kernel(b.to(dtype).contiguous(), None, False, native, batch_invariant))

    def remove(self, adapter_id: int) -> None:
        """Drop the adapter's matrices."""
        self.adapters.pop(adapter_id, None)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus each of the step's adapters' delta on its rows."""
        for adapter_id, rows in self.state.groups:
            kernels = self.adapters.get(adapter_id)
            if kernels is not None:
                a, b = kernels
                y.index_add_(0, rows, b(a(x.index_select(0, rows))).to(y.dtype))
        return y


def _targets(model: nn.Module) -> list[tuple[int, nn.Module, list[tuple[str, int, int]]]]:
    """(layer index, projection, its checkpoint parts) of every projection an adapter may target."""
    found = []
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "qkv_proj") or not hasattr(mlp, "gate_up_proj"):
            raise ValueError(f"LoRA adapters run on dense attention and MLP layers; {model.arch.architecture} "
                             "has latent attention or mixtures of experts")
        qkv = attn.qkv_proj
        found.append((index, qkv, [("q_proj", 0, qkv.q_size), ("k_proj", qkv.q_size, qkv.kv_size),
                                   ("v_proj", qkv.q_size + qkv.kv_size, qkv.kv_size)]))
        found.append((index, attn.o_proj, [("o_proj", 0, attn.o_proj.out_features)]))
        width = mlp.gate_up_proj.local_sizes[0]
        found.append((index, mlp.gate_up_proj, [("gate_proj", 0, width), ("up_proj", width, width)]))
        found.append((index, mlp.down_proj, [("down_proj", 0, mlp.down_proj.out_features)]))
    return found


class ModelLoRA:
    """The LoRA deltas of every adaptable projection of a decoder, and the adapters loaded into them."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, native: Any, batch_invariant: bool,
                 max_rank: int) -> None:
        if model.tp.size > 1 or model.stage.size > 1:
            raise ValueError("LoRA adapters run at tensor and pipeline parallel size 1")
        self.state = LoRAState()
        self.dtype, self.native, self.batch_invariant = dtype, native, batch_invariant
        self.max_rank = max_rank
        self.num_layers = len(model.layers)
        self.deltas: list[tuple[int, LoRADeltas]] = []
        self.shapes: dict[str, tuple[int, int]] = {}
        for index, projection, parts in _targets(model):
            deltas = LoRADeltas(parts, projection.in_features, self.state)
            projection.lora = deltas
            self.deltas.append((index, deltas))
            for name, _, size in parts:
                self.shapes[name] = (size, projection.in_features)
        self.loaded: set[int] = set()

    @property
    def active(self) -> bool:
        """Whether this step has rows with an adapter."""
        return bool(self.state.groups)

    def check(self, folder: str) -> AdapterConfig:
        """Read the adapter's config and tensor shapes (not its values); ValueError if it cannot run here."""
        config = AdapterConfig.read(folder, self.max_rank)
        read_adapter(folder, config, self.shapes, self.num_layers, shapes_only=True)
        return config

    def load(self, adapter_id: int, folder: str) -> None:
        """Load the adapter in `folder` as `adapter_id` (a no-op if it is loaded)."""
        if adapter_id in self.loaded:
            return
        config = AdapterConfig.read(folder, self.max_rank)
        tensors: Optional[AdapterTensors] = read_adapter(folder, config, self.shapes, self.num_layers)
        for index, deltas in self.deltas:
            mine = {name: tensors[(index, name)] for name, _, _ in deltas.parts if (index, name) in tensors}
            deltas.add(adapter_id, mine, config.scaling, self.dtype, self.native, self.batch_invariant)
        self.loaded.add(adapter_id)

    def unload(self, adapter_id: int) -> None:
        """Free the adapter's matrices."""
        for _, deltas in self.deltas:
            deltas.remove(adapter_id)
        self.loaded.discard(adapter_id)

    def set_step(self, adapter_rows: dict[int, list[int]], device: torch.device) -> None:
        """This step's rows of each adapter (none: the base model only)."""
        self.state.groups = [(adapter_id, torch.tensor(rows, dtype=torch.long, device=device))
                             for adapter_id, rows in adapter_rows.items()]
