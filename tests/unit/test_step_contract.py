"""The scheduler -> runner step contract: plain data, a request in full once, then only what changed (no torch)."""

from __future__ import annotations

import pickle

from fake_runner import make_request, make_scheduler, run_to_completion


def step(scheduler, runner):
    schedule = scheduler.schedule()
    scheduler.update_from_output(schedule, runner.execute(schedule))
    return schedule


def test_a_request_crosses_in_full_once_then_as_diffs():
    scheduler, runner = make_scheduler(block_size=4, budget=64)
    scheduler.add_request(make_request("a", 10, max_tokens=5))
    first = step(scheduler, runner)
    assert [n.request_id for n in first.new_requests] == ["a"] and not first.cached_requests
    assert len(first.new_requests[0].prompt_token_ids) == 10
    second = step(scheduler, runner)  # decode position 10: its block is already there
    assert not second.new_requests
    (diff,) = second.cached_requests
    assert len(diff.new_token_ids) == 1 and diff.new_block_ids == [[]] and diff.block_ids_start == [3]
    step(scheduler, runner)
    fourth = step(scheduler, runner)  # position 12 needs a fourth block
    (diff,) = fourth.cached_requests
    assert len(diff.new_token_ids) == 1 and len(diff.new_block_ids[0]) == 1 and diff.block_ids_start == [3]


def test_a_decode_step_costs_the_same_whatever_the_prompt_length():
    first_sizes, decode_sizes = [], []
    for prompt_len in (8, 400):
        scheduler, runner = make_scheduler(block_size=16, budget=512, max_model_len=1024)
        scheduler.add_request(make_request("a", prompt_len, max_tokens=4))
        first_sizes.append(len(pickle.dumps(step(scheduler, runner))))
        decode_sizes.append(len(pickle.dumps(step(scheduler, runner))))
    assert first_sizes[1] - first_sizes[0] > 392  # the prompt crosses once ...
    assert abs(decode_sizes[1] - decode_sizes[0]) <= 8  # ... and never again (a few bytes: larger positions)


def test_a_resumed_request_replaces_its_block_table_without_crossing_again():
    # two requests that outgrow a 6-block pool: the later one is preempted, then resumed
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4, budget=64)
    scheduler.add_request(make_request("a", 7, max_tokens=8, seed_token=1))
    scheduler.add_request(make_request("b", 7, max_tokens=8, seed_token=2))
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(step(scheduler, runner))
    preempted = next(i for i, s in enumerate(steps) if s.num_preempted)
    resumed = next(s for s in steps[preempted + 1:] if any(c.request_id == "b" for c in s.scheduled))
    assert not any(n.request_id == "b" for n in resumed.new_requests)
    (diff,) = [d for d in resumed.cached_requests if d.request_id == "b"]
    assert diff.block_ids_start == [0] and diff.new_block_ids[0]


def test_finished_requests_are_named_once_and_their_ids_can_return():
    scheduler, runner = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 5, max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.pop_finished("a")  # as the engine does once it has emitted the final output
    scheduler.add_request(make_request("a", 6, max_tokens=2, seed_token=9))  # the same id, a new request
    schedule = step(scheduler, runner)
    assert schedule.finished_request_ids == ["a"] and [n.request_id for n in schedule.new_requests] == ["a"]
    assert run_to_completion(scheduler, runner)["a"]  # the runner rebuilt the new "a", not the old one


def test_a_step_has_work_when_any_of_its_lists_is_filled():
    from dataclasses import fields

    from tokenmill.core.sched_output import SchedulerOutput

    assert not SchedulerOutput().has_work()
    # every list of the step is work for the runner (tokens, request state, block copies, adapters): a list
    # added to the contract and forgotten by has_work() fails here
    lists = [f.name for f in fields(SchedulerOutput) if f.default_factory is list]
    assert len(lists) >= 6
    for name in lists:
        step = SchedulerOutput()
        getattr(step, name).append(object())
        assert step.has_work(), name
