"""One seam for KV data movement: connectors copy KV blocks between the pool and somewhere else (no torch).

Every way of moving KV (the second tier, swap preemption, prefill/decode transfer) is a connector with two
halves, as vLLM's `KVConnectorBase_V1`:
- a scheduler half (a `KVConnectorScheduler` here): while the scheduler plans a step it queues the
  step's copies, hands them over as one `KVCopies` in the `SchedulerOutput`, and hears when the step is
  built and when the runner has done it;
- a worker half (`worker/kv_connectors.py`): it does the copies on the runner's KV pages.

A step's copies run in three phases, and within each phase connector by connector in the scheduler's
order (`Scheduler.connectors`):
1. `out`, pool -> store, before the step writes any block: an evicted or preempted block's contents
   leave before the block is reused (a load or the forward pass may write it);
2. `into`, store -> pool, before the forward pass reads them;
3. `after`, pool -> store, after the forward pass: blocks the step computed.
Each connector's entries are its own (slots, files); only its worker half reads them.
To add a way of moving KV: one `KVConnectorScheduler` subclass here in core/, one worker half, and a line
in each registry (`Scheduler.connectors`, `worker.kv_connectors.worker_connectors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRANSFER = "transfer"  # prefill/decode disaggregation: prompt blocks from and to files (core/kv_transfer_connector.py)
TIER = "tier"  # the second tier: evicted prefix-cache blocks and their hits (core/secondary_tier.py)
SWAP = "swap"  # swap preemption: a preempted request's blocks, out and back (core/swap_space.py)


@dataclass(slots=True)
class KVCopies:
    """One connector's block copies in one step, by phase (see the module's docstring)."""

    connector: str
    out: list[Any] = field(default_factory=list)
    into: list[Any] = field(default_factory=list)
    after: list[Any] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out or self.into or self.after)


class KVConnectorScheduler:
    """The scheduler half of a connector. Subclasses queue copies in `pending` as the scheduler calls
    them, and `take_copies` hands over what was queued since the last call."""

    name: str

    def __init__(self) -> None:
        self.pending = KVCopies(self.name)

    def take_copies(self) -> KVCopies:
        """The copies queued since the last call (then none are queued)."""
        copies, self.pending = self.pending, KVCopies(self.name)
        return copies

    def step_built(self) -> None:
        """The step that carries the copies just taken is built: nothing more of it will be allocated."""

    def end_step(self) -> None:
        """The runner has done the step's copies."""
