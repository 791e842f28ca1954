"""The batched LoRA product: every adapter's delta added to the base projections in one step.

Each adapted projection holds, per loaded adapter, A stacked over the projections its fused layer
joins ([q; k; v] for qkv_proj, [gate; up] for gate_up_proj) and B as the block-diagonal matrix that maps
each part's rank back to its slice of the output, the scaling folded into B. The runner tells the model
which adapter each row of the step has (`LoRAState`); every projection then adds all the step's deltas
with two products over the step's adapters stacked (S-LoRA/Punica's shrink and expand), whatever the
number of requests or adapters. Both products run on the engine's batch-invariant kernels, so a row's
delta does not depend on what else shares the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from tokenmill.layers.linear_kernels import LinearKernel, make_kernel
from tokenmill.lora.adapter_config import AdapterConfig
from tokenmill.lora.weights import AdapterTensors, projection_shapes, read_adapter


@dataclass
class LoRAState:
    """The step's adapters: `active` (their ids, ascending; empty when no request of the step has one) and
    `row_slot` (each row's index into `active`, -1 for a base-model row)."""

    active: tuple[int, ...] = ()
    row_slot: Optional[torch.Tensor] = None


_STACKS_KEPT = 4  # adapter sets whose stacked matrices a projection keeps (the step's set changes rarely)


class LoRADeltas:
    """The adapters' deltas for one projection, fused over the checkpoint projections `parts` (name,
    first output feature, output features).

    A step's adapters are stacked: A_all = [A_1; A_2; ...] and B_all = [B_1 B_2 ...], so the whole step
    takes two products, whatever its number of adapters. Each row keeps only its own adapter's columns of
    x A_all^T (the rest are zeroed) before B_all. Invariant: the native products sum each output in
    input order from zero, so the zeroed columns add exact zeros and a row's delta is the same bits as
    its own adapter's product alone, in any set of adapters (kernels/dense_kernels.c).
    """

    def __init__(self, parts: list[tuple[str, int, int]], in_features: int, state: LoRAState,
                 dtype: torch.dtype, native: Any, batch_invariant: bool) -> None:
        self.parts, self.in_features, self.state = parts, in_features, state
        self.dtype, self.native, self.batch_invariant = dtype, native, batch_invariant
        self.out_features = sum(size for _, _, size in parts)
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (A [cols, in], B [out, cols])
        self._stacks: dict[tuple[int, ...], Optional[tuple[LinearKernel, LinearKernel, torch.Tensor]]] = {}

    def add(self, adapter_id: int, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Hold adapter `adapter_id`'s A and B of the parts it targets (`tensors` by part name)."""
        present = [(name, offset, size) for name, offset, size in self.parts if name in tensors]
        if not present:
            return
        rank = tensors[present[0][0]][0].shape[0]
        a = torch.cat([tensors[name][0] for name, _, _ in present]).to(self.dtype)
        b = torch.zeros(self.out_features, rank * len(present), dtype=torch.float32)
        for index, (name, offset, size) in enumerate(present):
            b[offset:offset + size, index * rank:(index + 1) * rank] = tensors[name][1].float() * scaling
        self.adapters[adapter_id] = (a.contiguous(), b.to(self.dtype))
        self._stacks.clear()

    def remove(self, adapter_id: int) -> None:
        """Drop the adapter's matrices."""
        if self.adapters.pop(adapter_id, None) is not None:
            self._stacks.clear()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus each row's adapter delta (base rows get exact zeros)."""
        stack = self._stack(self.state.active)
        if stack is None:
            return y
        a, b, owner = stack
        mine = self.state.row_slot.unsqueeze(1) == owner.unsqueeze(0)
        return y.add_(b(a(x) * mine).to(y.dtype))

    def _stack(self, active: tuple[int, ...]) -> Optional[tuple[LinearKernel, LinearKernel, torch.Tensor]]:
        """The stacked kernels of the adapters `active` (None when none of them adapts this projection), and
        the slot in `active` of each stacked column."""
        if active in self._stacks:
            return self._stacks[active]
        mats = [(slot, *self.adapters[i]) for slot, i in enumerate(active) if i in self.adapters]
        stack = None
        if mats:
            owner = torch.cat([torch.full((a.shape[0],), slot, dtype=torch.long) for slot, a, _ in mats])
            a_all = torch.cat([a for _, a, _ in mats]).contiguous()
            b_all = torch.cat([b for _, _, b in mats], dim=1).contiguous()
            stack = (make_kernel(a_all, None, False, self.native, self.batch_invariant),
                     make_kernel(b_all, None, False, self.native, self.batch_invariant), owner.to(a_all.device))
        if len(self._stacks) >= _STACKS_KEPT:
            self._stacks.pop(next(iter(self._stacks)))
        self._stacks[active] = stack
        return stack


def _targets(model: nn.Module) -> list[tuple[int, nn.Module, list[tuple[str, int, int]]]]:
    """(layer index, projection, its checkpoint parts) of every projection an adapter may target."""
    if model.arch.architecture == "Llama4ForCausalLM":  # an adapter's q/k deltas would need the same reordering
        raise ValueError("LoRA adapters on Llama 4 are not supported: its q and k rows are reordered at load "
                         "(models/loader/llama4_tensors.py)")
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
        self.shapes = projection_shapes(model.arch)  # the engine's registry checked adapters against these
        self.deltas: list[tuple[int, LoRADeltas]] = []
        for index, projection, parts in _targets(model):
            deltas = LoRADeltas(parts, projection.in_features, self.state, dtype, native, batch_invariant)
            projection.lora = deltas
            self.deltas.append((index, deltas))
        self.loaded: set[int] = set()

    @property
    def active(self) -> bool:
        """Whether this step has rows with an adapter."""
        return bool(self.state.active)

    def load(self, adapter_id: int, folder: str) -> None:
        """Load the adapter in `folder` as `adapter_id` (a no-op if it is loaded)."""
        if adapter_id in self.loaded:
            return
        config = AdapterConfig.read(folder, self.max_rank)
        tensors: Optional[AdapterTensors] = read_adapter(folder, config, self.shapes, self.num_layers)
        for index, deltas in self.deltas:
            mine = {name: tensors[(index, name)] for name, _, _ in deltas.parts if (index, name) in tensors}
            deltas.add(adapter_id, mine, config.scaling)
        self.loaded.add(adapter_id)

    def unload(self, adapter_id: int) -> None:
        """Free the adapter's matrices."""
        for _, deltas in self.deltas:
            deltas.remove(adapter_id)
        self.loaded.discard(adapter_id)

    def set_step(self, adapter_rows: dict[int, list[int]], num_rows: int, device: torch.device,
                 to_device: Optional[Callable[[list[int]], torch.Tensor]] = None) -> None:
        """This step's rows of each adapter, of its `num_rows` rows (none: the base model only); `to_device`
        puts the rows' int64 slots on `device` (the runner's copies that never wait for the device)."""
        self.state.active = tuple(sorted(adapter_rows))
        if not adapter_rows:
            self.state.row_slot = None
            return
        slots = [-1] * num_rows
        for slot, adapter_id in enumerate(self.state.active):
            for row in adapter_rows[adapter_id]:
                slots[row] = slot
        self.state.row_slot = (to_device(slots) if to_device is not None
                               else torch.tensor(slots, dtype=torch.long, device=device))
