"""Prefill/decode transfer's scheduler half: prompt blocks read from a file into the prefix cache, and a
finished prompt's blocks written to one (no torch; the files are engine/kv_transfer.py's).

Imports run in phase `into` (before the forward pass), exports in phase `after` (core/kv_connector.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

from tokenmill.core.kv_connector import TRANSFER, KVConnectorScheduler

if TYPE_CHECKING:
    from tokenmill.core.block_hash import KeySalt
    from tokenmill.core.block_keys import BlockKey
    from tokenmill.core.block_pool import BlockPool
    from tokenmill.core.sched_output import ScheduledChunk
    from tokenmill.request import Request


class TransferKV(Protocol):
    """What `TransferConnector` uses of the KV cache manager (core/kv_cache_manager.py) it belongs to."""

    block_size: int
    watermark_blocks: int
    pool: BlockPool

    @property
    def num_groups(self) -> int: ...

    def held_elsewhere(self, key: tuple[int, BlockKey]) -> bool: ...

    def record_adopted(self, request_id: str, keys: Sequence[BlockKey], indices: Sequence[int],
                       salt: Optional[KeySalt]) -> None: ...

    def block_tables(self, request_id: str) -> list[list[int]]: ...


class TransferConnector(KVConnectorScheduler):
    """Adopts transferred blocks into one KV manager's prefix cache and queues exports of its blocks."""

    name = TRANSFER

    def __init__(self, kv: TransferKV) -> None:
        # pending: imports in (file, pool blocks, the file's block of each), exports after (file, pool blocks)
        super().__init__()
        self.kv = kv
        self._pins: list[int] = []

    def adopt(self, request_id: str, keys: Sequence[BlockKey], path: str, salt: Optional[KeySalt] = None) -> int:
        """Make the leading full blocks of content `keys` (a transferred prompt's, in order) findable in
        group 0, their K/V to be read from `path` (block i of the file holding keys[i]) before the next
        step's forward pass. Returns how many leading blocks are now cached (already cached ones count,
        and adopting stops at the first block the pool cannot spare without the watermark).

        Invariant: an adopted block stays pinned (held) until `step_built`, called once the step that
        carries its import has been built, so no allocation of that step can take it (and no second-tier
        save can copy it) before the runner has written it. The import runs in phase `into`, after that
        step's second-tier saves (phase `out`), which may read blocks evicted by this adoption."""
        kv = self.kv
        assert kv.num_groups == 1, "transfers are refused for models with several KV cache groups"
        blocks, file_indices = [], []
        count = 0
        for index, key in enumerate(keys):
            if kv.pool.lookup((0, key)) is None and not kv.held_elsewhere((0, key)):
                if kv.pool.num_free_blocks <= kv.watermark_blocks:
                    break
                (block,) = kv.pool.allocate(1)
                kv.pool.register(block, (0, key))
                self._pins.append(block)
                blocks.append(block)
                file_indices.append(index)
            count = index + 1
        if blocks:
            self.pending.into.append((path, blocks, file_indices))
            kv.record_adopted(request_id, keys, file_indices, salt)
        return count

    def plan_exports(self, scheduled: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> None:
        """Have the runner write, after this step's forward pass, the prompt blocks of every request that
        asked for a transfer and whose prompt this step completes (the full blocks before its last token:
        what a prefix hit on the decode side can use)."""
        for chunk in scheduled:
            request = requests[chunk.request_id]
            if (request.kv_export_path is not None and request.kv_exported_blocks is None
                    and chunk.start + chunk.num_tokens >= request.num_prompt_tokens):
                request.kv_exported_blocks = (request.num_prompt_tokens - 1) // self.kv.block_size
                if request.kv_exported_blocks:
                    self.export(request.request_id, request.kv_exported_blocks, request.kv_export_path)

    def export(self, request_id: str, num_blocks: int, path: str) -> None:
        """Write the request's first `num_blocks` blocks (group 0) to `path` after the next forward pass."""
        self.pending.after.append((path, list(self.kv.block_tables(request_id)[0][:num_blocks])))

    def step_built(self) -> None:
        """The step carrying the adopted blocks' imports is built: they may be evicted from now on."""
        pins, self._pins = self._pins, []
        self.kv.pool.release(pins)
