"""A step's flat inputs, built by phase (as nano-vllm's prepare_prefill / prepare_decode): token ids,
positions, and per KV cache group the chunks, the slots their new tokens write and the step's block tables.

A decode step (every request computes one token, none verifies proposals) takes a vectorised path over
the whole batch: one gather from the step's block tables (`InputBatch`; a lookup per request for items
built elsewhere), then array arithmetic, into buffers kept between steps.
Any other step (prefill chunks, mixed, speculative verification) takes the per-chunk path. Both give the
same values for the same batch; only the work differs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tokenmill.attention.base import SequenceChunk
from tokenmill.worker.input_batch import block_tables_of
from tokenmill.worker.request_state import BatchItem


def is_decode_step(batch: list[BatchItem]) -> bool:
    """Whether every item computes exactly one token and verifies no proposals."""
    return all(len(item.token_ids) == 1 and not item.spec_token_ids for item in batch)


class StepInputs:
    """Builds a step's inputs; its decode buffers grow to the largest batch seen and are reused.

    Invariant: the arrays a call returns are fresh (callers may keep them past the next call); only the
    scratch space behind them is reused."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._starts = np.empty(0, dtype=np.int64)
        self._blocks = np.empty(0, dtype=np.int64)

    def ids_and_positions(self, batch: list[BatchItem], decode: bool) -> tuple[list[int], np.ndarray]:
        """The batch's token ids, flat, and their positions (int64)."""
        if decode:
            return [item.token_ids[0] for item in batch], self._decode_starts(batch).copy()
        ids: list[int] = []
        for item in batch:
            ids.extend(item.token_ids)
        positions = np.concatenate([np.arange(item.start, item.start + item.num_tokens) for item in batch])
        return ids, positions

    def group_chunks(self, batch: list[BatchItem], group: int, decode: bool
                     ) -> tuple[list[SequenceChunk], torch.Tensor, Optional[np.ndarray]]:
        """The batch's chunks over group `group`'s block tables, the (host) slots their new tokens write, and
        the step's [B, W] int32 tables of the group when the batch came from the input batch (else None)."""
        tables = block_tables_of(batch, group)
        if decode:
            return (*self._decode_chunks(batch, group, tables), tables)
        return (*self._prefill_chunks(batch, group), tables)

    def _decode_starts(self, batch: list[BatchItem]) -> np.ndarray:
        n = len(batch)
        if self._starts.size < n:
            self._starts = np.empty(max(n, 2 * self._starts.size), dtype=np.int64)
            self._blocks = np.empty_like(self._starts)
        starts = self._starts[:n]
        starts[:] = [item.start for item in batch]
        return starts

    def _decode_chunks(self, batch: list[BatchItem], group: int, tables: Optional[np.ndarray]
                       ) -> tuple[list[SequenceChunk], torch.Tensor]:
        bs = self.block_size
        starts = self._decode_starts(batch)
        blocks = self._blocks[:len(batch)]
        if tables is not None:
            blocks[:] = tables[np.arange(len(batch)), starts // bs]
        else:
            blocks[:] = [item.block_ids[group][item.start // bs] for item in batch]
        chunks = [SequenceChunk(index, 1, item.start + 1, item.block_ids[group], False)
                  for index, item in enumerate(batch)]
        return chunks, torch.from_numpy(blocks * bs + starts % bs)

    def _prefill_chunks(self, batch: list[BatchItem], group: int) -> tuple[list[SequenceChunk], torch.Tensor]:
        """Per chunk, over the blocks it touches (no per-token Python work)."""
        chunks, slots = [], []
        query_start, bs = 0, self.block_size
        for item in batch:
            start, end = item.start, item.start + item.num_tokens
            table = item.block_ids[group]
            chunks.append(SequenceChunk(query_start, item.num_tokens, end, table, bool(item.spec_token_ids)))
            first_block = start // bs
            blocks = np.asarray(table[first_block:(end - 1) // bs + 1], dtype=np.int64)
            positions = np.arange(start, end)
            slots.append(blocks[positions // bs - first_block] * bs + positions % bs)
            query_start += item.num_tokens
        return chunks, torch.from_numpy(np.concatenate(slots))
