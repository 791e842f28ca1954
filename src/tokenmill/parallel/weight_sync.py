"""The process group an RL trainer streams new weights over (SGLang's `/init_weights_update_group` and
`/update_weights_from_distributed`, which TRL, verl and OpenRLHF speak): the trainer is rank 0 and hosts the
rendezvous store at `init_method`; the engine joins as rank `rank_offset`. Rank 0 broadcasts each tensor; the
engine receives them into fresh tensors (a staging copy: nothing served changes until every tensor has come).

The group is made the way those trainers make theirs (SGLang's and OpenRLHF's `init_custom_process_group`): a
process group of its own beside, not inside, torch.distributed's default group, so a process already in one (a
trainer's ranks) can join it, and its keys in the store are the trainers' own. gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                 "int8", "uint8", "float8_e4m3fn")}


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta) -> "torch.distributed.ProcessGroup":
    """A process group of `world_size` ranks that rendezvous at `init_method` (tcp://host:port, rank 0 serving the
    store), named `group_name`, outside the default group: what trainers call on their side (rank 0) too."""
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(init_method, store)  # (the trainers' prefix: their ranks and ours write the same keys)
    group, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                         timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class WeightSyncGroup:
    """This engine's membership of a trainer's weight-update group (rank `rank` of `world_size`, rank 0 the
    trainer), and the tensors received over it."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 backend: str, device: torch.device, timeout_s: float):
        if not 0 < rank < world_size:
            raise ValueError(f"rank_offset {rank} must lie in 1..world_size-1 ({world_size - 1}): rank 0 is the "
                             "trainer")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        if (backend == "nccl") != (device.type == "cuda"):
            raise ValueError(f"backend {backend}: the engine runs on {device.type} (gloo on CPU, nccl on CUDA)")
        self.name, self.rank, self.world_size, self.device = group_name, rank, world_size, device
        self.group = init_custom_process_group(backend, f"tcp://{master_address}:{master_port}", world_size, rank,
                                               group_name, datetime.timedelta(seconds=timeout_s))
        logger.info("joined weight-update group %r as rank %d of %d (%s)", group_name, rank, world_size, backend)

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
                ) -> dict[str, torch.Tensor]:
        """The tensors rank 0 broadcasts, in order, one per name (ValueError for lists of different lengths or an
        unknown dtype, before anything is received); RuntimeError when the transfer breaks (the trainer died)."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must be as long as each other: {len(names)}, {len(dtypes)}, "
                             f"{len(shapes)}")
        unknown = sorted({d for d in dtypes if d.removeprefix("torch.") not in DTYPES})
        if unknown:
            raise ValueError(f"unknown dtypes {unknown}: known are {', '.join(DTYPES)}")
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(tuple(shape), dtype=DTYPES[dtype.removeprefix("torch.")], device=self.device)
            torch.distributed.broadcast(tensor, src=0, group=self.group)
            received[name] = tensor
        return received

    def close(self) -> None:
        """Leave the group (its store and connections)."""
        torch.distributed.destroy_process_group(self.group)


def open_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: Optional[str], device: torch.device, timeout_s: float) -> WeightSyncGroup:
    """`WeightSyncGroup` with the backend defaulting to the device's (gloo on CPU, nccl on CUDA)."""
    return WeightSyncGroup(master_address, master_port, rank, world_size, group_name,
                           backend or ("nccl" if device.type == "cuda" else "gloo"), device, timeout_s)
