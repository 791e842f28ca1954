"""The worker halves of the KV connectors (core/kv_connector.py): each does its connector's copies on the
runner's KV pages, phase by phase."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from tokenmill.core.kv_connector import SWAP, TIER, TRANSFER, KVCopies
from tokenmill.worker.kv_tier_store import KVTierStore
from tokenmill.worker.kv_transfer_io import export_blocks, import_blocks

_METHODS = {"out": "copy_out", "into": "copy_in", "after": "copy_after"}  # by phase


class KVConnectorWorker:
    """A connector's worker half: what its entries of each phase mean, done on the KV pages."""

    def copy_out(self, pages: list[torch.Tensor], entries: list[Any]) -> None:
        """Phase `out`: pool -> store, before the step writes any block."""
        raise NotImplementedError(f"{type(self).__name__} copies nothing out of the pool before a step")

    def copy_in(self, pages: list[torch.Tensor], entries: list[Any]) -> None:
        """Phase `into`: store -> pool, before the forward pass."""
        raise NotImplementedError(f"{type(self).__name__} copies nothing into the pool")

    def copy_after(self, pages: list[torch.Tensor], entries: list[Any]) -> None:
        """Phase `after`: pool -> store, blocks the forward pass computed."""
        raise NotImplementedError(f"{type(self).__name__} copies nothing after a step")


class SlotStoreWorker(KVConnectorWorker):
    """The second tier's and swap's worker half: (block, slot) saves out, (slot, block) loads in, on a
    `KVTierStore` (memory-mapped file or pinned host memory)."""

    def __init__(self, store: KVTierStore) -> None:
        self.store = store

    def copy_out(self, pages: list[torch.Tensor], entries: list[tuple[int, int]]) -> None:
        self.store.save(pages, entries)

    def copy_in(self, pages: list[torch.Tensor], entries: list[tuple[int, int]]) -> None:
        self.store.load(pages, entries)


class TransferWorker(KVConnectorWorker):
    """Prefill/decode transfer's worker half: imports (file, pool blocks, the file's block of each) read
    in, exports (file, pool blocks) written after the forward pass (worker/kv_transfer_io.py)."""

    def copy_in(self, pages: list[torch.Tensor], entries: list[tuple[str, list[int], list[int]]]) -> None:
        for path, blocks, file_blocks in entries:
            import_blocks(pages, path, file_blocks, blocks)

    def copy_after(self, pages: list[torch.Tensor], entries: list[tuple[str, list[int]]]) -> None:
        for path, blocks in entries:
            export_blocks(pages, blocks, path)


def worker_connectors(tier: Optional[KVTierStore], swap: Optional[KVTierStore]) -> dict[str, KVConnectorWorker]:
    """The worker halves a runner has, by connector name."""
    connectors: dict[str, KVConnectorWorker] = {TRANSFER: TransferWorker()}
    if tier is not None:
        connectors[TIER] = SlotStoreWorker(tier)
    if swap is not None:
        connectors[SWAP] = SlotStoreWorker(swap)
    return connectors


def run_phase(connectors: dict[str, KVConnectorWorker], pages: list[torch.Tensor], copies: Sequence[KVCopies],
              phase: str) -> None:
    """Do one phase of a step's copies, connector by connector in the step's order."""
    for step_copies in copies:
        entries = getattr(step_copies, phase)
        if not entries:
            continue
        worker = connectors.get(step_copies.connector)
        if worker is None:
            raise RuntimeError(f"{step_copies.connector} copies were scheduled, but this runner has no "
                               f"{step_copies.connector} store")
        getattr(worker, _METHODS[phase])(pages, entries)
