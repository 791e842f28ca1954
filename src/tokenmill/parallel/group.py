"""The tensor-parallel group a model's layers talk through: all-reduce and gather, or nothing at size 1.

`TPGroup.single()` is the one-rank group (no torch.distributed at all); a worker of a parallel run builds
its group with `init_tensor_parallel` over torch.distributed (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

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
        torch.distributed.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def shard(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, features, vocabulary); ValueError naming the numbers when
        the size does not divide it."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the model's {what} ({total})")
        return total // self.size


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device, exact: bool = True,
                         timeout_seconds: float = 120.0) -> TPGroup:
    """Join the run's rendezvous (torch.distributed, `init_method` e.g. tcp://host:port) as `rank`; a rank
    that cannot reach it within `timeout_seconds` raises RuntimeError saying so, never hangs."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_seconds))
    except Exception as exc:
        raise RuntimeError(f"rank {rank} of {world_size} could not join the rendezvous at {init_method} "
                           f"within {timeout_seconds:.0f} s: {type(exc).__name__}: {exc}") from exc
    return TPGroup(rank, world_size, exact)
