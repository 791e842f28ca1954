"""The runner's persistent input batch: every live request's tokens and block tables in preallocated numpy
arrays, one row per request, kept in step with the scheduler by the step contract's diffs (no torch).

A runner (in this process or in a worker process) sees each request once in full (`NewRequestData`) and
afterwards only what changed (`CachedRequestData`). `InputBatch.apply` writes those diffs into the rows
and turns the step's chunks into `BatchItem`s: a chunk's ids are a slice of its row, and the step's block
tables are one gather of the table arrays by the step's rows (`StepBatch.block_tables`), with no list
rebuilt per request (vLLM's InputBatch / BlockTable, gpu_input_batch.py and block_table.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_state import PLACEHOLDER, BatchItem


class StepBatch(list):
    """A step's batch items (a list of `BatchItem`, in batch order) with their block tables gathered from the
    input batch: `block_tables[g]` is [len(items), W] int32, row i item i's table in KV cache group g
    (0 past its blocks). A copy taken at `apply`: later steps never change it."""

    def __init__(self, items: Sequence[BatchItem], block_tables: list[np.ndarray]) -> None:
        super().__init__(items)
        self.block_tables = block_tables


class InputBatch:
    """Every live request's row, updated from the step contract's diffs by `apply`.

    Invariants, after every call:
      - rows 0 .. num_rows-1 are the live requests, dense (a leaving request's hole is filled by the last
        row); `request_ids[r]` is row r's request and `row_of[request_ids[r]] == r`.
      - `token_ids[r, :num_tokens[r]]` are its prompt (the first `num_prompt[r]`) then its output tokens, as
        the scheduler last told the runner; what lies past `num_tokens[r]` is stale.
      - in KV cache group g, `block_tables[g][r, :num_blocks[g][r]]` is its block table, and every entry
        past it is 0.
    The arrays grow (rows and columns, doubling) when a request does not fit; `max_num_seqs` and
    `max_model_len` only size them at first.
    """

    def __init__(self, block_size: int, num_groups: int = 1, max_num_seqs: int = 16, max_model_len: int = 2048) -> None:
        rows, columns = max(max_num_seqs, 1), max(max_model_len, 1)
        self.token_ids = np.zeros((rows, columns), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt = np.zeros(rows, dtype=np.int64)
        self.block_tables: list[np.ndarray] = []
        self.num_blocks: list[np.ndarray] = []
        self._blocks_wide = -(-columns // block_size)
        self._fit_groups(num_groups)
        self.request_ids: list[str] = []
        self.sampling_params: list[SamplingParams] = []
        self.images: list[tuple[ImageFeature, ...]] = []
        self.row_of: dict[str, int] = {}

    @property
    def num_rows(self) -> int:
        """Live requests (rows in use)."""
        return len(self.request_ids)

    def apply(self, schedule: SchedulerOutput) -> StepBatch:
        """Bring the rows up to date with `schedule` (in the contract's order: finished, new, changed) and
        return its chunks as batch items, in batch order, with the step's block tables."""
        for request_id in schedule.finished_request_ids:
            self.remove(request_id)
        for new in schedule.new_requests:
            self.add(new.request_id, new.prompt_token_ids, new.output_token_ids, new.sampling_params,
                     new.block_ids, new.images)
        for diff in schedule.cached_requests:
            row = self.row_of.get(diff.request_id)
            if row is None:
                raise RuntimeError(f"step contract broken: request {diff.request_id!r} changed but the runner "
                                   f"never saw it")
            self.append_tokens(row, diff.new_token_ids)
            for group, (start, new_blocks) in enumerate(zip(diff.block_ids_start, diff.new_block_ids)):
                self.set_blocks(row, group, start, new_blocks)
        rows = np.fromiter((self.row_of[chunk.request_id] for chunk in schedule.scheduled), dtype=np.int64,
                           count=len(schedule.scheduled))
        tables = [table[rows] for table in self.block_tables]
        counts = list(zip(*(num[rows].tolist() for num in self.num_blocks))) or [()] * len(rows)
        items = []
        for i, (chunk, row, known, prompt) in enumerate(zip(schedule.scheduled, rows.tolist(),
                                                            self.num_tokens[rows].tolist(),
                                                            self.num_prompt[rows].tolist())):
            spec = chunk.spec_token_ids
            real_end = chunk.start + chunk.num_tokens - len(spec)
            # Invariant (core/scheduler.py): a chunk past the known tokens is one token, the placeholder
            placeholder = real_end > known
            if placeholder and (real_end != known + 1 or chunk.num_tokens != 1):
                raise RuntimeError(f"step contract broken: request {chunk.request_id!r} computes [{chunk.start}, "
                                   f"{real_end}) but the runner knows {known} tokens")
            token_ids = [PLACEHOLDER] if placeholder else self.token_ids[row, chunk.start:real_end].tolist() + spec
            history = self.token_ids[row]
            items.append(BatchItem(chunk.request_id, token_ids, chunk.start,
                                   [table[i, :count] for table, count in zip(tables, counts[i])], chunk.sample,
                                   self.sampling_params[row], history[:prompt], history[prompt:known], spec,
                                   self.images[row], placeholder))
        return StepBatch(items, tables)

    def add(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
            sampling_params: SamplingParams, block_ids: Sequence[Sequence[int]],
            images: tuple[ImageFeature, ...] = ()) -> int:
        """Put a request the runner has not seen (or sees again in full) in a row; returns the row."""
        row = self.row_of.get(request_id)
        if row is None:
            row = self.num_rows
            self._fit_rows(row + 1)
            self.request_ids.append(request_id)
            self.sampling_params.append(sampling_params)
            self.images.append(images)
            self.row_of[request_id] = row
        else:
            self.sampling_params[row], self.images[row] = sampling_params, images
        self._fit_groups(len(block_ids))
        self.num_tokens[row] = 0
        self.num_prompt[row] = len(prompt_token_ids)
        self.append_tokens(row, prompt_token_ids)
        self.append_tokens(row, output_token_ids)
        for group, table in enumerate(block_ids):
            self.set_blocks(row, group, 0, table)
        return row

    def append_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        """Add `token_ids` after row `row`'s known tokens."""
        count = len(token_ids)
        if not count:
            return
        start = int(self.num_tokens[row])
        self._fit_columns(start + count)
        self.token_ids[row, start:start + count] = token_ids
        self.num_tokens[row] = start + count

    def set_blocks(self, row: int, group: int, start: int, block_ids: Sequence[int]) -> None:
        """Row `row`'s table in group `group`: its first `start` blocks kept, then `block_ids`."""
        table, num = self.block_tables[group], self.num_blocks[group]
        end = start + len(block_ids)
        if end > table.shape[1]:
            self._fit_blocks(end)
            table = self.block_tables[group]
        old = int(num[row])
        if old > end:
            table[row, end:old] = 0
        table[row, start:end] = block_ids
        num[row] = end

    def remove(self, request_id: str) -> None:
        """Free a request's row (nothing when it has none): the last row moves into the hole."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        last = self.num_rows - 1
        if row != last:
            moved = self.request_ids[last]
            length = int(self.num_tokens[last])
            self.token_ids[row, :length] = self.token_ids[last, :length]
            for array in (self.num_tokens, self.num_prompt, *self.num_blocks):
                array[row] = array[last]
            for table in self.block_tables:
                table[row] = table[last]
            self.request_ids[row] = moved
            self.sampling_params[row] = self.sampling_params[last]
            self.images[row] = self.images[last]
            self.row_of[moved] = row
        for table, num in zip(self.block_tables, self.num_blocks):
            table[last, :num[last]] = 0
            num[last] = 0
        self.num_tokens[last] = self.num_prompt[last] = 0
        self.request_ids.pop()
        self.sampling_params.pop()
        self.images.pop()

    def _fit_groups(self, groups: int) -> None:
        rows = self.token_ids.shape[0]
        while len(self.block_tables) < groups:
            wide = self.block_tables[0].shape[1] if self.block_tables else self._blocks_wide
            self.block_tables.append(np.zeros((rows, wide), dtype=np.int32))
            self.num_blocks.append(np.zeros(rows, dtype=np.int64))

    def _fit_rows(self, rows: int) -> None:
        have = self.token_ids.shape[0]
        if rows <= have:
            return
        grown = max(rows, 2 * have)
        self.token_ids = _grown(self.token_ids, (grown, self.token_ids.shape[1]))
        self.num_tokens = _grown(self.num_tokens, (grown,))
        self.num_prompt = _grown(self.num_prompt, (grown,))
        self.block_tables = [_grown(table, (grown, table.shape[1])) for table in self.block_tables]
        self.num_blocks = [_grown(num, (grown,)) for num in self.num_blocks]

    def _fit_columns(self, columns: int) -> None:
        have = self.token_ids.shape[1]
        if columns > have:
            self.token_ids = _grown(self.token_ids, (self.token_ids.shape[0], max(columns, 2 * have)))

    def _fit_blocks(self, blocks: int) -> None:
        have = self.block_tables[0].shape[1]
        if blocks > have:
            self.block_tables = [_grown(table, (table.shape[0], max(blocks, 2 * have))) for table in self.block_tables]


def _grown(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`array` copied into the corner of a zeroed array of `shape`."""
    out = np.zeros(shape, dtype=array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


def block_tables_of(batch: Sequence[BatchItem], group: int) -> Optional[np.ndarray]:
    """The step's [B, W] int32 block tables of group `group` when `batch` came from `InputBatch.apply`, else
    None (items built elsewhere, the draft model's or a probe's, carry their tables as lists)."""
    return batch.block_tables[group] if isinstance(batch, StepBatch) else None
