import subprocess
import sys
from typing import Optional

import pytest

from fake_runner import FakeRunner, make_request, make_scheduler, run_to_completion
from tokenmill.request import RequestStatus


def test_core_imports_no_torch():
    code = ("import sys, tokenmill.core.scheduler, tokenmill.core.kv_cache_manager, tokenmill.request, "
            "tokenmill.spec_decode.controller, tokenmill.spec_decode.ngram, tokenmill.kernels.isa, "
            "tokenmill.kernels.build; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_token_budget_chunks_long_prompts():
    scheduler, runner = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 40, max_tokens=2))
    first = scheduler.schedule()
    assert [(s.request_id, s.start, s.num_tokens, s.sample) for s in first.scheduled] == [("a", 0, 16, False)]
    scheduler.update_from_output(first, runner.execute(first))
    second = scheduler.schedule()
    assert [(s.start, s.num_tokens) for s in second.scheduled] == [(16, 16)]
    scheduler.update_from_output(second, runner.execute(second))
    outputs = run_to_completion(scheduler, runner)
    assert len(outputs["a"]) == 2
    assert all(step.total_num_tokens <= 16 for step in runner.steps)


def test_prefill_chunks_mix_with_decode_tokens():
    scheduler, runner = make_scheduler(budget=10)
    scheduler.add_request(make_request("a", 6, max_tokens=20))
    scheduler.add_request(make_request("b", 30, max_tokens=2))
    run_to_completion(scheduler, runner)
    mixed = [s for s in runner.steps
             if {x.request_id: x.num_tokens for x in s.scheduled}.get("a") == 1
             and any(x.request_id == "b" and not x.sample for x in s.scheduled)]
    assert mixed, "some step must carry a's decode token together with a chunk of b's prompt"
    assert all(step.total_num_tokens <= 10 for step in runner.steps)


def test_max_num_seqs_limits_the_running_batch():
    scheduler, runner = make_scheduler(max_seqs=2, budget=64)
    for i in range(5):
        scheduler.add_request(make_request(str(i), 3, max_tokens=4, seed_token=i))
    while scheduler.has_unfinished_requests():
        schedule = scheduler.schedule()
        assert len(schedule.scheduled) <= 2 and scheduler.num_running <= 2
        scheduler.update_from_output(schedule, runner.execute(schedule))


def test_results_do_not_depend_on_batching_chunking_or_preemption():
    def run(**limits):
        scheduler, runner = make_scheduler(**limits)
        for i in range(6):
            scheduler.add_request(make_request(f"r{i}", 5 + 7 * i, max_tokens=12, seed_token=i))
        return run_to_completion(scheduler, runner), scheduler

    reference, _ = run(budget=1024, num_blocks=256, max_seqs=1)
    batched, _ = run(budget=1024, num_blocks=256)
    chunked, _ = run(budget=3, num_blocks=256)
    preempted, scheduler = run(budget=64, num_blocks=16)
    assert scheduler.num_preemptions_total > 0, "the small pool must force preemption"
    assert batched == reference and chunked == reference and preempted == reference
    assert scheduler.kv_cache.pool.num_free_blocks == 16


def preemptions_to_the_end(scheduler, runner) -> list[str]:
    """Run the scheduler's requests to their end; the ids of the requests preempted, in the order they were."""
    preempted = []
    while scheduler.has_unfinished_requests():
        before = {r.request_id: r.num_preemptions for r in scheduler.requests.values()}
        schedule = scheduler.schedule()
        preempted += [rid for rid, r in scheduler.requests.items() if r.num_preemptions > before[rid]]
        scheduler.update_from_output(schedule, runner.execute(schedule))
    return preempted


def test_preemption_victim_is_lowest_priority_then_latest():
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4, budget=64)
    scheduler.add_request(make_request("low", 7, max_tokens=9, priority=5))
    scheduler.add_request(make_request("high-late", 7, max_tokens=9, priority=0))
    scheduler.add_request(make_request("high-early", 7, max_tokens=9, priority=0))
    preempted = preemptions_to_the_end(scheduler, runner)
    assert preempted and preempted[0] == "low"


def test_priority_orders_admission():
    scheduler, runner = make_scheduler(max_seqs=1)
    scheduler.add_request(make_request("later", 4, max_tokens=1, priority=1))
    scheduler.add_request(make_request("first", 4, max_tokens=1, priority=-1))
    schedule = scheduler.schedule()
    assert [s.request_id for s in schedule.scheduled] == ["first"]


def test_batch_lines_wait_behind_interactive_requests_and_are_preempted_first_whatever_their_priority():
    def request(rid, background, priority=0):
        made = make_request(rid, 7, max_tokens=9, priority=priority)
        made.background = background
        return made

    scheduler, runner = make_scheduler(max_seqs=1)
    scheduler.add_request(request("batch-line", True, priority=-5))
    scheduler.add_request(request("interactive", False, priority=3))
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["interactive"]
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4, budget=64)
    for rid, background in (("batch-line", True), ("late", False), ("later", False)):
        scheduler.add_request(request(rid, background))
    preempted = preemptions_to_the_end(scheduler, runner)
    assert preempted and preempted[0] == "batch-line"


def test_oversized_requests_are_rejected_with_both_numbers_and_never_stall_the_queue():
    scheduler, runner = make_scheduler(max_model_len=32, num_blocks=64)
    with pytest.raises(ValueError, match=r"40.*32"):
        scheduler.check_admissible(40, 41)
    with pytest.raises(ValueError, match=r"32.*50"):
        scheduler.check_admissible(10, 50)
    small_pool, _ = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"12 tokens.*3 blocks.*holds 2 blocks"):
        small_pool.check_admissible(6, 12)
    scheduler.check_admissible(10, 14)
    scheduler.add_request(make_request("ok", 10, max_tokens=4))
    assert run_to_completion(scheduler, runner)["ok"]


def test_abort_returns_every_block():
    scheduler, runner = make_scheduler(num_blocks=32)
    for i in range(4):
        scheduler.add_request(make_request(str(i), 9, max_tokens=50, seed_token=i))
    for _ in range(3):
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, runner.execute(schedule))
    assert scheduler.kv_cache.pool.num_free_blocks < 32
    assert sorted(scheduler.finish_requests(["0", "1", "2", "3"], RequestStatus.FINISHED_ABORTED)) == ["0", "1", "2", "3"]
    assert scheduler.kv_cache.pool.num_free_blocks == 32
    assert not scheduler.has_unfinished_requests()
    assert set(scheduler.schedule().finished_request_ids) == {"0", "1", "2", "3"}


def test_n_samples_fork_after_prefill_and_share_prompt_blocks():
    scheduler, runner = make_scheduler(num_blocks=64, block_size=4, budget=64)
    scheduler.add_request(make_request("p", 10, max_tokens=3, n=3))
    schedule = scheduler.schedule()
    assert [s.request_id for s in schedule.scheduled] == ["p"]
    scheduler.update_from_output(schedule, runner.execute(schedule))
    first_two = scheduler.kv_cache.block_tables("p")[0][:2]
    assert [scheduler.kv_cache.pool.ref_counts[b] for b in first_two] == [3, 3]
    children = sorted(r for r in scheduler.requests if r != "p")
    assert children == ["p#1", "p#2"]
    assert all(scheduler.requests[c].num_computed_tokens == 8 for c in children)
    run_to_completion(scheduler, runner)
    assert all(len(scheduler.requests[r].output_token_ids) == 3 for r in ["p", "p#1", "p#2"])
    assert scheduler.kv_cache.pool.num_free_blocks == 64


def test_stop_token_and_min_tokens():
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams
    req = Request("x", [1, 2], SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[9]), 5, (2,))
    req.output_token_ids.append(2)
    assert not req.check_stop_token(2), "EOS before min_tokens does not stop"
    req.output_token_ids.append(7)
    req.output_token_ids.append(9)
    assert req.check_stop_token(9) and req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 9


def test_a_lost_worker_group_resumes_every_request_by_recompute_with_the_same_tokens():
    """`recompute_everything` (a replaced worker group): the running requests, a step in flight among them, go
    back to the queue with nothing computed, the runner is told every request again in full, and every request
    ends with the tokens it would have had undisturbed."""
    def run(lose_after: Optional[int]):
        scheduler, runner = make_scheduler(budget=16, num_blocks=64, prefix_caching=True)
        for i in range(4):
            scheduler.add_request(make_request(f"r{i}", 9 + 5 * i, max_tokens=10, seed_token=i))
        outputs: dict[str, list[int]] = {}
        step = 0
        while scheduler.has_unfinished_requests():
            schedule = scheduler.schedule()
            step += 1
            if step == lose_after:  # this step's answer never comes: its group died
                scheduler.recompute_everything()
                assert scheduler.kv_cache.reset_prefix_cache() and not scheduler.running
                assert all(r.num_computed_tokens == 0 for r in scheduler.waiting)
                runner = FakeRunner(scheduler.kv_cache)  # a new group: it knows no request, its pool is empty
                continue
            for update in scheduler.update_from_output(schedule, runner.execute(schedule)):
                outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        return outputs

    assert run(lose_after=6) == run(lose_after=None)
