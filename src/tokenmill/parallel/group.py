"""The groups a model's layers talk through: tensor-parallel collectives and pipeline stages.

`TPGroup.single()` and `PipelineStage()` are the one-rank defaults (no torch.distributed at all); a worker
of a parallel run builds its own with `init_parallel` over torch.distributed (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group. Collectives are no-ops when size == 1.

    Invariant: every rank calls the same collectives in the same order (each layer's forward does),
    so a rank never waits on a collective another rank skips.
    """

    rank: int = 0
    size: int = 1
    exact: bool = True  # row-parallel projections gather whole rows instead of summing partial products
    group: Optional[object] = None  # the torch.distributed process group; None = the default group
    root: int = 0  # the global rank of the group's rank 0 (where logits are gathered)
    expert_parallel: bool = False  # MoE layers shard whole experts over the ranks (layers/moe.py)

    @staticmethod
    def single() -> "TPGroup":
        """The group of one rank."""
        return TPGroup()

    @property
    def is_driver(self) -> bool:
        """Whether this rank samples (rank 0)."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks; every rank gets the same sum, added in rank order whatever x's size.

        A ring all-reduce adds each element in an order that depends on which chunk of the buffer it
        falls in, so with three or more ranks a row's sum would depend on how many rows share the step.
        Two operands commute exactly; beyond two the ranks' parts are gathered and added in rank order.
        """
        if self.size == 1:
            return x
        if self.size == 2:
            torch.distributed.all_reduce(x, group=self.group)
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Send x's rows in rank order, the first send_counts[0] to rank 0 and so on; return the rows
        received, recv_counts[q] from rank q, in rank order (each rank's `recv_counts` must be what the
        others send it)."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows (counts[q] of them from rank q, this rank's being x), concatenated in rank
        order, on every rank."""
        if self.size == 1:
            return x
        padded = x.new_zeros((max(counts),) + tuple(x.shape[1:]))  # all_gather takes equal shapes
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        torch.distributed.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, in rank order, on every rank."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def gather_last_dim(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Concatenate every rank's x along the last dimension, in rank order, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        torch.distributed.gather(x, parts, dst=self.root, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def shard(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, features, vocabulary); ValueError naming the numbers when
        the size does not divide it."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the model's {what} ({total})")
        return total // self.size


def rank_device(device: Union[str, torch.device], rank: int, ranks_per_node: int) -> torch.device:
    """The device global `rank` runs on: on CUDA its own GPU, that of its local rank (rank % ranks_per_node)
    counted from the index `device` names (0 if none), so a host's ranks use one GPU each; else `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank % ranks_per_node)


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend for ranks on `device`: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device, exact: bool = True,
                         timeout_seconds: float = 120.0, expert_parallel: bool = False) -> TPGroup:
    """Join the run's rendezvous (torch.distributed, `init_method` e.g. tcp://host:port) as `rank`; a rank
    that cannot reach it within `timeout_seconds` raises RuntimeError saying so, never hangs. A CUDA
    `device` must name the rank's GPU (`rank_device`), which becomes the process's current device."""
    import torch.distributed as dist

    backend = distributed_backend(device)
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"rank {rank} needs its own GPU (rank_device), got {device}")
        torch.cuda.set_device(device)  # before NCCL starts: its communicator binds the current device
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_seconds))
    except Exception as exc:
        raise RuntimeError(f"rank {rank} of {world_size} could not join the rendezvous at {init_method} "
                           f"within {timeout_seconds:.0f} s: {type(exc).__name__}: {exc}") from exc
    return TPGroup(rank, world_size, exact, expert_parallel=expert_parallel)


@dataclass(frozen=True)
class PipelineStage:
    """This rank's pipeline stage: layers [first_layer, end_layer) of the model, the embedding on the first
    stage, the final norm and head on the last. Activations (hidden, residual) go from each stage to the
    same tensor-parallel rank of the next one.

    Invariant: every rank of a stage runs the same steps in the same order, so each send meets its recv.
    """

    index: int = 0
    size: int = 1
    first_layer: int = 0
    end_layer: int = -1  # -1: to the last layer (one stage)
    prev_rank: Optional[int] = None  # the global rank activations come from (None on the first stage)
    next_rank: Optional[int] = None  # the global rank activations go to (None on the last stage)

    @property
    def is_first(self) -> bool:
        """Whether this stage embeds the tokens."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage runs the final norm and the LM head (and its driver rank samples)."""
        return self.index == self.size - 1

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Pass this stage's output to the next stage."""
        torch.distributed.send(torch.stack((hidden, residual)).contiguous(), self.next_rank)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual) for a step of `num_tokens` tokens."""
        both = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        torch.distributed.recv(both, self.prev_rank)
        return both[0], both[1]


def stage_layers(num_layers: int, num_stages: int, index: int) -> tuple[int, int]:
    """Layers [first, end) of stage `index`: contiguous, the first `num_layers % num_stages` stages one more."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    first = index * base + min(index, extra)
    return first, first + base + (1 if index < extra else 0)


def init_parallel(rank: int, tp_size: int, pp_size: int, num_layers: int, init_method: str,
                  device: torch.device, exact: bool = True, timeout_seconds: float = 120.0,
                  expert_parallel: bool = False) -> tuple[TPGroup, PipelineStage]:
    """Join the run's rendezvous as global `rank` of tp_size x pp_size (rank = stage * tp_size + tp rank) and
    build this rank's tensor-parallel group (which also shards the experts with `expert_parallel`) and
    pipeline stage."""
    import torch.distributed as dist

    world = tp_size * pp_size
    init_tensor_parallel(rank, world, init_method, device, exact, timeout_seconds)
    stage_index, tp_rank = divmod(rank, tp_size)
    group = None
    if pp_size > 1 and tp_size > 1:  # one group per stage; every rank creates every group, in order
        for s in range(pp_size):
            created = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
            if s == stage_index:
                group = created
    tp = TPGroup(tp_rank, tp_size, exact, group, root=stage_index * tp_size, expert_parallel=expert_parallel)
    first, end = stage_layers(num_layers, pp_size, stage_index)
    stage = PipelineStage(stage_index, pp_size, first, end,
                          rank - tp_size if stage_index > 0 else None,
                          rank + tp_size if stage_index < pp_size - 1 else None)
    return tp, stage
