"""A step's inputs (worker/step_inputs.py) from the input batch's gathered tables equal those from per-item lists."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import NewRequestData, ScheduledChunk, SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import InputBatch, StepBatch
from tokenmill.worker.request_state import BatchItem
from tokenmill.worker.step_inputs import StepInputs, is_decode_step

PARAMS = SamplingParams(max_tokens=8)


def as_lists(batch: StepBatch) -> list[BatchItem]:
    """The same items as a plain list, their tables as lists (what the draft model's items carry)."""
    return [BatchItem(item.request_id, item.token_ids, item.start, [list(map(int, t)) for t in item.block_ids],
                      item.sample, item.sampling_params, list(item.prompt_token_ids), list(item.output_token_ids),
                      item.spec_token_ids, item.images, item.placeholder) for item in batch]


def step_of(chunks: list[ScheduledChunk]) -> StepBatch:
    batch = InputBatch(block_size=4, num_groups=2, max_num_seqs=1, max_model_len=4)
    new = [NewRequestData(rid, list(range(10 + i, 10 + i + length)), [], PARAMS,
                          [[3 * i + b for b in range(-(-length // 4) + 1)],
                           [40 + 10 * i + b for b in range(-(-length // 4))]])
           for i, (rid, length) in enumerate((("a", 9), ("b", 3), ("c", 13)))]
    return batch.apply(SchedulerOutput(chunks, new_requests=new))


def check_same(batch: StepBatch) -> None:
    inputs = StepInputs(block_size=4)
    decode = is_decode_step(batch)
    for group in (0, 1):
        chunks, slots, tables = inputs.group_chunks(batch, group, decode)
        list_chunks, list_slots, no_tables = inputs.group_chunks(as_lists(batch), group, decode)
        assert no_tables is None and tables is batch.block_tables[group]
        assert torch.equal(slots, list_slots)
        assert [(c.query_start, c.query_len, c.context_len, list(c.block_ids)) for c in chunks] == \
            [(c.query_start, c.query_len, c.context_len, c.block_ids) for c in list_chunks]
    ids, positions = inputs.ids_and_positions(batch, decode)
    list_ids, list_positions = inputs.ids_and_positions(as_lists(batch), decode)
    assert ids == list_ids and np.array_equal(positions, list_positions)


def test_a_decode_step_gathers_its_slots_from_the_steps_tables():
    check_same(step_of([ScheduledChunk("c", 12, 1, True), ScheduledChunk("a", 8, 1, True),
                        ScheduledChunk("b", 2, 1, True)]))


def test_a_prefill_step_gives_the_same_chunks_and_slots():
    check_same(step_of([ScheduledChunk("a", 0, 9, True), ScheduledChunk("c", 4, 6, False),
                        ScheduledChunk("b", 1, 2, True)]))
