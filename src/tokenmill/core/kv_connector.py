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

The KV manager also tells the connectors it was built with (`KVCacheManager.connectors`) what happens in
the pool: blocks that became findable (`blocks_stored`) and blocks evicted (`block_evicted`); and its
prefix matching asks them for blocks the pool lacks (`holds`, then `claim` and `load`: vLLM's
`get_num_new_matched_tokens` and `start_load_kv`, block by block). The second tier and KV events listen
this way; the events connector moves no data at all.

To add a way of moving KV: one `KVConnectorScheduler` subclass here in core/, one worker half, and a line
in each registry (`Scheduler.connectors`, `worker.kv_connectors.worker_connectors`); a connector that
listens to the pool or supplies prefix hits is also given to the KV manager (`KVCacheManager.__init__`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from tokenmill.core.block_hash import KeySalt
    from tokenmill.core.block_keys import BlockKey

TRANSFER = "transfer"  # prefill/decode disaggregation: prompt blocks from and to files (core/kv_transfer_connector.py)
TIER = "tier"  # the second tier: evicted prefix-cache blocks and their hits (core/secondary_tier.py)
SWAP = "swap"  # swap preemption: a preempted request's blocks, out and back (core/swap_space.py)
EVENTS = "events"  # KV-cache events for prefix-aware routers: no copies (core/kv_events.py)


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

    # ------------------------------------------------------------------ the pool's news, and external hits
    def blocks_stored(self, group: int, keys: Sequence[BlockKey], indices: Sequence[int],
                      salt: Optional[KeySalt]) -> None:
        """Group `group`'s blocks of content keys[i], for i in `indices` (ascending positions of one
        request's chain `keys`), became findable in the pool."""

    def block_evicted(self, block: int, key: tuple[int, BlockKey]) -> None:
        """The pool evicted `block`, whose content was `key` (group, content key): it is reused next."""

    def holds(self, key: tuple[int, BlockKey]) -> bool:
        """Whether this connector can load the block of `key` (group, content key) that the pool lacks."""
        return False

    def claim(self, key: tuple[int, BlockKey]) -> Any:
        """Take the block of `key` (which `holds`) for a hit, so that nothing this step pushes it out;
        `load` then copies it into the pool."""
        raise NotImplementedError(f"the {self.name} connector supplies no prefix hits")

    def load(self, claimed: Any, block: int) -> None:
        """Copy a block `claim` returned into the pool's `block` before the step's forward pass."""
        raise NotImplementedError(f"the {self.name} connector supplies no prefix hits")


def overrides(connector: KVConnectorScheduler, method: str) -> bool:
    """Whether `connector` does something on `method` (a hook of the base class it replaces)."""
    return getattr(type(connector), method) is not getattr(KVConnectorScheduler, method)
