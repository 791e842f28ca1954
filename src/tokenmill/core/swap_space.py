"""Preemption by swapping: a preempted request's KV blocks wait in host-memory slots and come back when it
resumes, instead of being computed again (no torch).

The scheduler picks, per preempted request, the cheaper way back (`PreemptionCosts`): copying its blocks
out and in again, or recomputing its tokens. Copies are queued here while scheduling and carried out by
the runner around the step's forward pass, as the second tier's are: swap-outs (block -> slot) before
anything writes the freed blocks, swap-ins (slot -> block) before the forward pass reads them.

A request's blocks are those of every KV cache group's table: full attention's K/V, and a recurrent layer's state
pages (Mamba2's, or a hybrid's states kept in attention blocks), copied alike, so a swapped request goes on from its
exact state. Groups that give blocks back before a request ends (sliding windows, chunked local attention) are not
swapped (config_checks.swaps_preempted).

Invariant: a slot freed by a swap-in is reused only after `end_step` (the runner has read it), so no
swap-out of a later scheduling pass can overwrite it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.core.kv_connector import SWAP, KVConnectorScheduler

if TYPE_CHECKING:
    from tokenmill.core.kv_cache_manager import KVCacheManager

# Rough rates for the cost comparison (bytes copied per second; model FLOPs per second). On a CPU the
# copy is a memcpy and recomputing runs at a few tens of GFLOP/s: swapping always wins. On a GPU the
# copy crosses PCIe and recomputing runs at tens of TFLOP/s: small models recompute.
_RATES = {"cpu": (5e9, 5e10), "cuda": (1.6e10, 5e13)}


@dataclass(frozen=True)
class PreemptionCosts:
    """What bringing back a preempted request of n computed tokens costs, estimated: swapping copies its
    KV out and in (2 (n `kv_bytes_per_token` + `state_bytes`): a recurrent layer's state is one size whatever n);
    recomputing runs its n tokens again (2 x `active_params` FLOPs per token, and attention's 2 x
    `attention_width` x n per token)."""

    kv_bytes_per_token: float
    active_params: float
    attention_width: float  # layers x heads x head dim (one query-key product and one value sum per key)
    copy_bytes_per_second: float
    flops_per_second: float
    state_bytes: float = 0.0  # a request's recurrent states, in pool blocks (0: attention only)

    @classmethod
    def for_model(cls, arch: Any, kv_bytes_per_token: float, device_type: str,
                  state_bytes: float = 0.0) -> "PreemptionCosts":
        """The estimate for a model's ArchConfig on `device_type` (cpu or cuda)."""
        hidden, layers = arch.hidden_size, arch.num_hidden_layers
        attention = (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim * hidden
        width = arch.intermediate_size if arch.moe is None else arch.moe.top_k * arch.moe.intermediate_size
        copy_rate, flop_rate = _RATES.get(device_type, _RATES["cpu"])
        return cls(kv_bytes_per_token, layers * (attention + 3 * hidden * width),
                   layers * arch.num_attention_heads * arch.head_dim, copy_rate, flop_rate, state_bytes)

    def swap_is_cheaper(self, num_tokens: int) -> bool:
        """Whether copying `num_tokens` tokens' KV out and back costs less time than recomputing them."""
        copy_seconds = 2 * (num_tokens * self.kv_bytes_per_token + self.state_bytes) / self.copy_bytes_per_second
        flops = num_tokens * 2 * self.active_params + 2 * self.attention_width * num_tokens * num_tokens
        return copy_seconds < flops / self.flops_per_second


class SwapSpace(KVConnectorScheduler):
    """`num_slots` block-sized host slots (the runner's swap store), and which preempted request holds which:
    swap preemption's scheduler half (swap-outs in phase `out`, swap-ins in phase `into`)."""

    name = SWAP

    def __init__(self, num_slots: int) -> None:
        super().__init__()  # pending: (block, slot) swap-outs out, (slot, block) swap-ins in
        self.num_slots = num_slots
        # Free slots: those handed back (reused last-in first-out), then [_unused_from, num_slots), never handed
        # out. A list of every slot would cost a tiny model's engine a million entries (4 GiB of 4 KiB slots).
        self._returned: list[int] = []
        self._unused_from = 0
        self._held: dict[str, list[list[int]]] = {}  # request id -> each group's blocks' slots, in table order
        self._freed_this_step: list[int] = []
        self.num_swapped_out = 0  # requests swapped out since start
        self.num_swapped_in_tokens = 0  # tokens that came back by copy instead of recompute

    @property
    def num_free_slots(self) -> int:
        """Slots no request holds."""
        return len(self._returned) + self.num_slots - self._unused_from

    def holds(self, request_id: str) -> bool:
        """Whether the request's blocks wait in this space."""
        return request_id in self._held

    def swap_out(self, kv: "KVCacheManager", request_id: str) -> bool:
        """Queue the copy of the request's blocks (every group's table) to free slots and free its pool blocks;
        False (and nothing done) when the space lacks the slots or the request has no blocks.

        Invariant (the KV manager's, kv_group_specs.RecurrentStateSpec): a state page is held by exactly one
        request, so the bytes copied out are this request's state alone; the copy runs in phase `out`, before the
        forward pass of the step that may hand the freed page to another request (whose first chunk starts from a
        zero state and then overwrites it)."""
        assert all(spec.keeps_every_block for spec in kv.specs), "swapping is refused for windowed KV cache groups"
        tables = kv.block_tables(request_id)
        num_blocks = sum(len(table) for table in tables)
        if not num_blocks or num_blocks > self.num_free_slots:
            return False
        held = []
        for table in tables:
            slots = [self._take_slot() for _ in table]
            self.pending.out.extend(zip(table, slots))
            held.append(slots)
        self._held[request_id] = held
        kv.free(request_id)
        self.num_swapped_out += 1
        return True

    def swap_in(self, kv: "KVCacheManager", request_id: str, num_tokens: int) -> None:
        """Queue the copy of the request's slots into the first blocks of each group's table, which
        `kv.allocate_slots` has just made for its `num_tokens` tokens (a state group's: its new state page)."""
        for slots, table in zip(self._held.pop(request_id), kv.block_tables(request_id)):
            self.pending.into.extend(zip(slots, table))
            self._freed_this_step.extend(slots)
        self.num_swapped_in_tokens += num_tokens

    def drop(self, request_id: str) -> None:
        """A swapped request ended while waiting: its slots are free (after this step)."""
        for slots in self._held.pop(request_id, ()):
            self._freed_this_step.extend(slots)

    def end_step(self) -> None:
        """The runner has done the step's copies: the slots swapped in or dropped may be reused."""
        self._returned.extend(reversed(self._freed_this_step))
        self._freed_this_step = []

    def _take_slot(self) -> int:
        if self._returned:
            return self._returned.pop()
        self._unused_from += 1
        return self._unused_from - 1
