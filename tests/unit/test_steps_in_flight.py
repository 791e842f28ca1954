"""Pipeline stages keep several steps in flight: each takes its own requests, and a request's tokens are
those of one step at a time (no torch; the fake runner runs each step when it is submitted, which is the
order every rank runs them in)."""

from __future__ import annotations

from collections import deque

from fake_runner import make_request, make_scheduler, run_to_completion
from tokenmill.request import RequestStatus


def run_pipelined(scheduler, runner, depth: int, on_step=None, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Keep up to `depth` steps in flight, finishing the oldest each round, as the engine does."""
    outputs: dict[str, list[int]] = {}
    in_flight: deque = deque()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not in_flight:
            return outputs
        while len(in_flight) < depth:
            schedule = scheduler.schedule()
            if schedule.is_empty and in_flight and not schedule.finished_request_ids:
                break
            busy = {c.request_id for step, _ in in_flight for c in step.scheduled}
            assert not busy & {c.request_id for c in schedule.scheduled}, "a request in two steps in flight"
            if in_flight:
                assert schedule.num_preempted == 0, "a preemption while a step was in flight"
            in_flight.append((schedule, runner.execute(schedule)))
            if on_step is not None:
                on_step(schedule, len(in_flight))
        schedule, result = in_flight.popleft()
        for update in scheduler.update_from_output(schedule, result):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        scheduler.kv_cache.pool.check_invariants()
    raise AssertionError("scheduler did not finish")


def requests():
    return [make_request(f"r{i}", 5 + 7 * i, max_tokens=6 + i, seed_token=i) for i in range(6)]


def test_two_steps_in_flight_give_the_tokens_of_one_step_at_a_time():
    scheduler, runner = make_scheduler(budget=16)
    for request in requests():
        scheduler.add_request(request)
    expected = run_to_completion(scheduler, runner)

    scheduler, runner = make_scheduler(budget=16, steps_in_flight=2)
    for request in requests():
        scheduler.add_request(request)
    overlapped = []
    got = run_pipelined(scheduler, runner, 2, on_step=lambda s, n: overlapped.append(n == 2 and not s.is_empty))
    assert got == expected
    assert sum(overlapped) > len(overlapped) // 2, "most steps should run beside another"
    assert scheduler.kv_cache.pool.num_used_blocks == 0 and not scheduler.in_flight


def test_steps_in_flight_split_the_running_requests_evenly():
    scheduler, runner = make_scheduler(budget=64, steps_in_flight=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=20, seed_token=i))
    sizes = []
    run_pipelined(scheduler, runner, 2, on_step=lambda s, n: sizes.append(len(s.scheduled)))
    assert set(sizes[:20]) == {2}, sizes


def test_a_full_pool_waits_for_the_step_in_flight_instead_of_preempting():
    # 12 blocks of 4 tokens: three requests growing to 24 tokens each cannot all fit
    scheduler, runner = make_scheduler(num_blocks=12, budget=32, steps_in_flight=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 8, max_tokens=16, seed_token=i))
    expected_scheduler, expected_runner = make_scheduler(num_blocks=64, budget=32)
    for i in range(3):
        expected_scheduler.add_request(make_request(f"r{i}", 8, max_tokens=16, seed_token=i))
    assert run_pipelined(scheduler, runner, 2) == run_to_completion(expected_scheduler, expected_runner)
    assert scheduler.num_preemptions_total > 0  # preempted, but only with nothing in flight (checked above)


def test_a_request_aborted_in_flight_is_dropped_and_its_blocks_reused_safely():
    scheduler, runner = make_scheduler(num_blocks=16, budget=32, steps_in_flight=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 6, max_tokens=12, seed_token=i))
    aborted = []

    def abort_once(schedule, depth):
        if not aborted and depth == 2 and schedule.scheduled:
            victim = schedule.scheduled[0].request_id
            aborted.append(victim)
            assert scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED) == [victim]
            scheduler.pop_finished(victim)
            scheduler.add_request(make_request("late", 9, max_tokens=8, seed_token=9))

    outputs = run_pipelined(scheduler, runner, 2, on_step=abort_once)
    assert aborted
    assert len(outputs.get(aborted[0], [])) < 12
    assert len(outputs["late"]) == 8  # the fake runner checked it never read the aborted request's KV
    assert scheduler.kv_cache.pool.num_used_blocks == 0 and not scheduler.in_flight
