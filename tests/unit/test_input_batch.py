"""The runner's persistent input batch (worker/input_batch.py): rows kept from the step contract's diffs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.sched_output import CachedRequestData, NewRequestData, ScheduledChunk, SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import InputBatch, StepBatch
from tokenmill.worker.request_state import PLACEHOLDER

PARAMS = SamplingParams(max_tokens=8)


def row_of(batch: InputBatch, request_id: str) -> tuple[list[int], int, list[list[int]]]:
    """(known tokens, prompt length, table per group) of a request, read from its row."""
    row = batch.row_of[request_id]
    tables = [t[row, :n[row]].tolist() for t, n in zip(batch.block_tables, batch.num_blocks)]
    return batch.token_ids[row, :batch.num_tokens[row]].tolist(), int(batch.num_prompt[row]), tables


def check_invariants(batch: InputBatch) -> None:
    assert sorted(batch.row_of.values()) == list(range(batch.num_rows))
    assert all(batch.request_ids[row] == rid for rid, row in batch.row_of.items())
    for table, num in zip(batch.block_tables, batch.num_blocks):
        for row in range(table.shape[0]):
            assert not table[row, num[row]:].any(), "entries past a row's blocks are 0"
        assert not num[batch.num_rows:].any()


def test_a_new_request_fills_the_next_row():
    batch = InputBatch(block_size=4, num_groups=2)
    batch.add("a", [1, 2, 3], [], PARAMS, [[7], [8]])
    batch.add("b", [4, 5], [6], PARAMS, [[9], [10, 11]])
    assert batch.row_of == {"a": 0, "b": 1}
    assert row_of(batch, "b") == ([4, 5, 6], 2, [[9], [10, 11]])
    check_invariants(batch)


def test_appends_add_tokens_and_a_rewrite_truncates_the_table_from_its_start():
    batch = InputBatch(block_size=4)
    batch.add("a", [1, 2, 3, 4], [], PARAMS, [[5, 6, 7]])
    batch.append_tokens(0, [10, 11])
    batch.set_blocks(0, 0, 1, [9])  # keep the first block, then 9: block 7 is dropped
    assert row_of(batch, "a") == ([1, 2, 3, 4, 10, 11], 4, [[5, 9]])
    batch.set_blocks(0, 0, 2, [12, 13])
    assert row_of(batch, "a")[2] == [[5, 9, 12, 13]]
    check_invariants(batch)


def test_a_finished_request_leaves_and_the_last_row_fills_its_hole():
    batch = InputBatch(block_size=4)
    for i, rid in enumerate("abcd"):
        batch.add(rid, [i] * (i + 1), [], PARAMS, [[i] * (i + 1)])
    batch.remove("b")
    assert batch.request_ids == ["a", "d", "c"] and batch.row_of["d"] == 1
    assert row_of(batch, "d") == ([3, 3, 3, 3], 4, [[3, 3, 3, 3]])
    batch.remove("c")  # the last row: nothing moves
    batch.remove("gone")  # never held: nothing happens
    assert batch.request_ids == ["a", "d"]
    check_invariants(batch)


def test_rows_and_columns_grow_past_the_first_sizes():
    batch = InputBatch(block_size=2, max_num_seqs=1, max_model_len=2)
    batch.add("a", [1, 2], [], PARAMS, [[1]])
    batch.add("b", list(range(9)), [], PARAMS, [[2, 3, 4, 5, 6]])
    batch.append_tokens(0, [3, 4, 5])
    batch.set_blocks(0, 0, 1, [7, 8])
    assert row_of(batch, "a") == ([1, 2, 3, 4, 5], 2, [[1, 7, 8]])
    assert row_of(batch, "b") == (list(range(9)), 9, [[2, 3, 4, 5, 6]])
    check_invariants(batch)


def step(scheduled, new=(), cached=(), finished=()) -> SchedulerOutput:
    return SchedulerOutput(list(scheduled), new_requests=list(new), cached_requests=list(cached),
                           finished_request_ids=list(finished))


def test_apply_gives_each_chunk_its_row_slice_and_the_steps_tables():
    batch = InputBatch(block_size=4)
    items = batch.apply(step([ScheduledChunk("a", 0, 4, False), ScheduledChunk("b", 2, 1, True)],
                             new=[NewRequestData("a", [1, 2, 3, 4, 5], [], PARAMS, [[3, 4]]),
                                  NewRequestData("b", [6, 7], [8], PARAMS, [[9]])]))
    assert isinstance(items, StepBatch)
    assert [item.token_ids for item in items] == [[1, 2, 3, 4], [8]]
    assert items.block_tables[0].tolist() == [[3, 4] + [0] * (items.block_tables[0].shape[1] - 2),
                                              [9] + [0] * (items.block_tables[0].shape[1] - 1)]
    assert [list(item.block_ids[0]) for item in items] == [[3, 4], [9]]
    assert list(items[1].prompt_token_ids) == [6, 7] and list(items[1].output_token_ids) == [8]
    # b finishes, a gains a token and a block: a's row is unchanged, the step's tables are a copy
    later = batch.apply(step([ScheduledChunk("a", 5, 1, True)], cached=[CachedRequestData("a", [11], [[12]], [2])],
                             finished=["b"]))
    assert later[0].token_ids == [11] and list(later[0].block_ids[0]) == [3, 4, 12]
    assert list(items[1].block_ids[0]) == [9], "an earlier step's tables never change"
    check_invariants(batch)


def test_a_chunk_past_the_known_tokens_is_the_placeholder_alone():
    batch = InputBatch(block_size=4)
    batch.apply(step([ScheduledChunk("a", 0, 3, True)], new=[NewRequestData("a", [1, 2, 3], [], PARAMS, [[1]])]))
    (item,) = batch.apply(step([ScheduledChunk("a", 3, 1, True)]))
    assert item.placeholder and item.token_ids == [PLACEHOLDER] and len(item.output_token_ids) == 0
    with pytest.raises(RuntimeError, match="step contract broken"):
        batch.apply(step([ScheduledChunk("a", 3, 2, True)]))
    with pytest.raises(RuntimeError, match="step contract broken"):
        batch.apply(step([], cached=[CachedRequestData("x", [1], [[]], [0])]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 3), st.integers(0, 5)), max_size=40))
def test_rows_always_equal_a_dict_of_lists(ops):
    """Any sequence of adds, appends, table rewrites and removals leaves every row equal to what plain
    per-request lists would hold, with rows dense."""
    batch = InputBatch(block_size=4, num_groups=2, max_num_seqs=1, max_model_len=1)
    model: dict[str, tuple[list[int], int, list[list[int]]]] = {}
    for rid, kind, n in ops:
        if rid not in model or kind == 0:
            prompt = [n + 1] * (n + 1)
            model[rid] = (list(prompt), len(prompt), [[n] * n, [n + 2]])
            batch.add(rid, prompt, [], PARAMS, model[rid][2])
        elif kind == 1:
            batch.remove(rid)
            del model[rid]
        elif kind == 2:
            tokens = list(range(n))
            batch.append_tokens(batch.row_of[rid], tokens)
            model[rid][0].extend(tokens)
        else:
            table = model[rid][2][0]
            keep = min(n, len(table))
            del table[keep:]
            table.extend([40 + n] * (n % 3))
            batch.set_blocks(batch.row_of[rid], 0, keep, [40 + n] * (n % 3))
        check_invariants(batch)
        assert {rid: row_of(batch, rid) for rid in batch.row_of} == model
    assert np.array_equal(np.sort(list(batch.row_of.values())), np.arange(batch.num_rows))
