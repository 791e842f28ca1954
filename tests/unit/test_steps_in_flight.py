"""Several steps in flight: pipeline stages, where each step takes its own requests and a request's tokens
are those of one step at a time; and async scheduling, where a request runs one step ahead of the host with
a placeholder for its last token, and gives the synchronous loop's tokens (no torch; the fake runner runs
each step when it is submitted, which is the order every rank and a device's stream run them in)."""

from __future__ import annotations

from collections import deque

from fake_runner import EOS, make_request, make_scheduler, run_to_completion
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def run_pipelined(scheduler, runner, depth: int, on_step=None, max_steps: int = 10_000,
                  overlap: bool = False) -> dict[str, list[int]]:
    """Keep up to `depth` steps in flight, finishing the oldest each round, as the engine does (`overlap`:
    async scheduling, where a request may be in the step in flight and the next one)."""
    outputs: dict[str, list[int]] = {}
    in_flight: deque = deque()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not in_flight:
            return outputs
        while len(in_flight) < depth:
            schedule = scheduler.schedule()
            if in_flight and not schedule.has_work():
                break
            busy = {c.request_id for step, _ in in_flight for c in step.scheduled}
            assert overlap or not busy & {c.request_id for c in schedule.scheduled}, "a request in two steps in flight"
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


def async_requests(stop_at: dict[str, int]) -> list[Request]:
    """Requests of several prompt lengths and max_tokens, some stopped by a stop token id (`stop_at`: request
    id -> a token its output holds, from an earlier run; EOS takes the same path in `check_stop_token`)."""
    made = []
    for i in range(6):
        base = make_request(f"r{i}", 3 + 9 * i, max_tokens=4 + 3 * i, seed_token=i)
        stops = [stop_at[base.request_id]] if base.request_id in stop_at else []
        params = SamplingParams(max_tokens=base.max_tokens, stop_token_ids=stops)
        made.append(Request(base.request_id, base.prompt_token_ids, params, base.max_tokens, (EOS,)))
    return made


def run_both(num_blocks: int = 64, budget: int = 16):
    """The tokens of the synchronous loop and of async scheduling for the same requests, and the async run's
    scheduler and runner."""
    scheduler, runner = make_scheduler(num_blocks=256, budget=budget)
    for request in async_requests({}):
        scheduler.add_request(request)
    first = run_to_completion(scheduler, runner)
    stop_at = {"r1": first["r1"][2], "r4": first["r4"][5]}
    scheduler, runner = make_scheduler(num_blocks=256, budget=budget)
    for request in async_requests(stop_at):
        scheduler.add_request(request)
    expected = run_to_completion(scheduler, runner)
    scheduler, runner = make_scheduler(num_blocks=num_blocks, budget=budget, async_scheduling=True)
    for request in async_requests(stop_at):
        scheduler.add_request(request)
    return expected, run_pipelined(scheduler, runner, 2, overlap=True), scheduler, runner


def test_async_scheduling_gives_the_tokens_of_the_synchronous_loop_and_drops_the_surplus():
    expected, got, scheduler, runner = run_both()
    assert len(expected["r1"]) == 3 and len(expected["r4"]) == 6  # stopped by their stop ids
    assert got == expected  # a surplus token after a stop or max_tokens is never appended
    assert runner.num_placeholders > 20  # decodes ran one step ahead of the host
    assert scheduler.kv_cache.pool.num_used_blocks == 0 and not scheduler.in_flight


def test_async_scheduling_preempts_only_with_nothing_in_flight_and_keeps_the_tokens():
    expected, got, scheduler, runner = run_both(num_blocks=20)  # r5 alone holds 17: others are preempted
    assert got == expected
    assert scheduler.num_preemptions_total > 0 and runner.num_placeholders > 0


def test_a_request_that_needs_its_last_token_on_the_host_never_runs_ahead():
    scheduler, runner = make_scheduler(async_scheduling=True)
    plain = make_request("plain", 5, max_tokens=10)
    penalised = Request("penalised", list(plain.prompt_token_ids), SamplingParams(max_tokens=10, presence_penalty=1.0),
                        10, (EOS,))
    held = Request("min-tokens", list(plain.prompt_token_ids), SamplingParams(max_tokens=10, min_tokens=6), 10, (EOS,))
    for request in (plain, penalised, held):
        scheduler.add_request(request)
    placeholders: dict[str, list[int]] = {}

    def record(schedule, depth):
        for item in runner.items:
            if item.placeholder:
                placeholders.setdefault(item.request_id, []).append(len(item.output_token_ids))

    outputs = run_pipelined(scheduler, runner, 2, on_step=record, overlap=True)
    assert outputs["plain"] == outputs["penalised"] == outputs["min-tokens"]
    assert len(placeholders["plain"]) >= 8 and "penalised" not in placeholders
    assert min(placeholders["min-tokens"]) >= 6  # ahead only once min_tokens no longer reads the count


def test_a_request_aborted_with_a_placeholder_in_flight_gives_its_blocks_back():
    scheduler, runner = make_scheduler(num_blocks=16, budget=32, async_scheduling=True)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 6, max_tokens=12, seed_token=i))
    aborted = []

    def abort_once(schedule, depth):
        ahead = [item.request_id for item in runner.items if item.placeholder]
        if not aborted and depth == 2 and ahead:
            aborted.append(ahead[0])
            assert scheduler.finish_requests(ahead[:1], RequestStatus.FINISHED_ABORTED) == ahead[:1]
            scheduler.pop_finished(ahead[0])
            scheduler.add_request(make_request("late", 9, max_tokens=8, seed_token=9))

    outputs = run_pipelined(scheduler, runner, 2, on_step=abort_once, overlap=True)
    assert aborted and len(outputs.get(aborted[0], [])) < 12
    assert len(outputs["late"]) == 8  # the fake runner checked it never read the aborted request's KV
    assert scheduler.kv_cache.pool.num_used_blocks == 0 and not scheduler.in_flight
