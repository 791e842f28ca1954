"""Tenants share the scheduler fairly (core/fair_share.py), on the fake runner: a flood of one tenant does not keep
another's requests out, weights divide the tokens, idling banks no credit, and no request's output changes."""

from __future__ import annotations

from fake_runner import make_request, make_scheduler, run_to_completion
from tokenmill.request import TenantShare

A, B = TenantShare("a"), TenantShare("b")


def tenant_request(rid: str, tenant, prompt_len: int, max_tokens: int, seed: int = 5):
    request = make_request(rid, prompt_len, max_tokens=max_tokens, seed_token=seed)
    request.tenant = tenant
    return request


def steps_to_first_tokens(scheduler, runner, ids: set[str]) -> dict[str, int]:
    """Run until each of `ids` has sampled its first token: the step count at which each did."""
    first: dict[str, int] = {}
    step = 0
    while len(first) < len(ids):
        step += 1
        schedule = scheduler.schedule()
        for update in scheduler.update_from_output(schedule, runner.execute(schedule)):
            if update.request_id in ids and update.new_token_ids:
                first.setdefault(update.request_id, step)
        assert step < 2_000, "the short requests never started"
    return first


def flood_then_short(tenants: bool) -> dict[str, int]:
    """Tenant a queues 40 long requests and fills the batch's 8 seats; then b queues 4 short ones: the steps
    until each of b's has its first token."""
    scheduler, runner = make_scheduler(max_seqs=8, budget=32, num_blocks=512)
    for i in range(40):
        scheduler.add_request(tenant_request(f"a{i}", A if tenants else None, 12, 40, seed=i))
    while scheduler.num_running < 8:  # a's requests hold every seat of the batch
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, runner.execute(schedule))
    short = {f"b{i}" for i in range(4)}
    for i, rid in enumerate(sorted(short)):
        scheduler.add_request(tenant_request(rid, B if tenants else None, 6, 4, seed=100 + i))
    return steps_to_first_tokens(scheduler, runner, short)


def test_one_tenants_flood_does_not_keep_another_tenants_requests_waiting():
    unfair = flood_then_short(tenants=False)
    fair = flood_then_short(tenants=True)
    assert min(unfair.values()) > 40  # one queue: b waits for a's requests to end, 8 at a time
    # b takes four of a's seats (its half of the 8 is four) and the budget its prompts lack: they start at once
    assert max(fair.values()) <= 3, fair


def test_a_tenants_short_prompt_does_not_wait_for_anothers_long_prompts_to_be_computed():
    def wait(tenants: bool) -> int:
        scheduler, runner = make_scheduler(max_seqs=16, budget=32, num_blocks=1024, max_model_len=512)
        for i in range(4):  # 1,600 prompt tokens: 50 steps of the whole budget
            scheduler.add_request(tenant_request(f"a{i}", A if tenants else None, 400, 8, seed=i))
        for _ in range(2):
            schedule = scheduler.schedule()
            scheduler.update_from_output(schedule, runner.execute(schedule))
        scheduler.add_request(tenant_request("b", B if tenants else None, 6, 2, seed=99))
        return steps_to_first_tokens(scheduler, runner, {"b"})["b"]

    assert wait(tenants=False) > 40  # the running prompts take the budget first, step after step
    # b starts level with a (the floor): a's chunk leaves b's six tokens, and b runs in the next step (without
    # that, b would wait for a's running prompt: 11 steps)
    assert wait(tenants=True) == 1


def test_weights_divide_the_tokens_while_both_tenants_are_backlogged():
    scheduler, runner = make_scheduler(max_seqs=16, budget=24, num_blocks=1024)
    heavy = TenantShare("heavy", weight=3.0)
    for i in range(60):
        scheduler.add_request(tenant_request(f"l{i}", A, 30, 2, seed=i))
        scheduler.add_request(tenant_request(f"h{i}", heavy, 30, 2, seed=200 + i))
    served = {"a": 0, "heavy": 0}
    for _ in range(60):  # both stay backlogged throughout
        schedule = scheduler.schedule()
        for chunk in schedule.scheduled:
            served["a" if chunk.request_id.startswith("l") else "heavy"] += chunk.num_tokens
        scheduler.update_from_output(schedule, runner.execute(schedule))
    assert 2.5 <= served["heavy"] / served["a"] <= 3.5, served


def test_an_idle_tenant_banks_no_credit():
    """b is served a little, idles while a runs alone for a long time, then comes back with a flood: it shares
    with a from then on instead of taking everything until its virtual time catches up."""
    scheduler, runner = make_scheduler(max_seqs=16, budget=24, num_blocks=1024)
    scheduler.add_request(tenant_request("b-early", B, 10, 2))
    for i in range(30):
        scheduler.add_request(tenant_request(f"a{i}", A, 30, 2, seed=i))
    run_to_completion(scheduler, runner)  # a's 30 requests: ~1,000 tokens while b is idle
    for i in range(30):
        scheduler.add_request(tenant_request(f"a-late{i}", A, 30, 2, seed=50 + i))
        scheduler.add_request(tenant_request(f"b{i}", B, 30, 2, seed=100 + i))
    served = {"a": 0, "b": 0}
    for _ in range(20):
        schedule = scheduler.schedule()
        for chunk in schedule.scheduled:
            served[chunk.request_id[0]] += chunk.num_tokens
        scheduler.update_from_output(schedule, runner.execute(schedule))
    assert 0.6 <= served["a"] / served["b"] <= 1.6, served


def test_the_fair_share_changes_who_runs_never_what_a_request_computes():
    def outputs(tenants: bool):
        scheduler, runner = make_scheduler(max_seqs=4, budget=16, num_blocks=24)  # small: preemption too
        for i in range(10):
            tenant = (A if i % 3 else TenantShare("b", 2.0)) if tenants else None
            scheduler.add_request(tenant_request(f"r{i}", tenant, 5 + 3 * i, 10, seed=i))
        return run_to_completion(scheduler, runner), scheduler

    plain, _ = outputs(False)
    shared, scheduler = outputs(True)
    assert shared == plain and scheduler.num_preemptions_total > 0


def test_a_full_waiting_queue_still_takes_a_tenant_within_its_share_of_it():
    from tokenmill.core.fair_share import FairShare

    flood = [tenant_request(f"a{i}", A, 50, 4, seed=i) for i in range(10)]  # a fills a queue of 10 / 1,000 tokens
    assert not FairShare.within_share(flood, A, 50, 10, 1000)  # a alone: its share is the whole queue, full
    assert FairShare.within_share(flood, B, 50, 10, 1000)  # b's half is 5 requests and 500 tokens
    assert not FairShare.within_share(flood, B, 600, 10, 1000)  # but not a prompt past its half of the tokens
    five = flood + [tenant_request(f"b{i}", B, 50, 4, seed=50 + i) for i in range(5)]
    assert not FairShare.within_share(five, B, 50, 10, 1000)  # its half is taken
    assert FairShare.within_share(five, TenantShare("c", 2.0), 50, 10, 1000)  # c: half of the queue (2 of 4)


def test_every_ended_request_leaves_the_live_counts_so_one_tenant_again_takes_the_queues_order():
    """The fair share keeps a count of live requests per tenant (its questions skip the queue while one tenant has
    them all): finished, aborted, forked (n > 1) and preempted requests leave nothing behind, and a tenant that was
    the only one again orders admissions by the queue alone."""
    from tokenmill.request import RequestStatus

    scheduler, runner = make_scheduler(max_seqs=4, budget=16, num_blocks=24)  # small: preemptions too
    for i in range(8):
        request = make_request(f"r{i}", 5 + 3 * i, max_tokens=6, n=2 if i % 4 == 0 else 1, seed_token=i)
        request.tenant = A if i % 2 else B
        scheduler.add_request(request)
    assert scheduler.fair.num_live_tenants == 2
    for _ in range(3):
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, runner.execute(schedule))
    scheduler.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED)  # one running or waiting of each
    run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions_total > 0 and scheduler.fair.num_live_tenants == 0
    scheduler.add_request(tenant_request("late", A, 6, 2))
    assert scheduler.fair.num_live_tenants == 1
    assert scheduler.fair.choose(scheduler.waiting, scheduler.running) is None


def test_a_steps_prompt_tokens_stay_within_their_own_cap_while_decodes_go_on():
    """max_num_prompt_tokens (a tenants server's --tenant-step-tokens): no step computes more prompt tokens than the
    cap, decodes come on top, and the outputs are the uncapped scheduler's; only the prompts of the tenant served
    next, while it has requests waiting, run past the cap (the cap keeps steps short for a newcomer, who then need
    not wait for more than its own prompts)."""
    def run(cap: int, late_tenant=None):
        scheduler, runner = make_scheduler(max_seqs=8, budget=64, num_blocks=256, prompt_budget=cap)
        for i in range(6):
            scheduler.add_request(tenant_request(f"a{i}", A, 40 + 7 * i, 12, seed=i))
        chunks, outputs, step = [], {}, 0
        while scheduler.has_unfinished_requests():
            step += 1
            if step == 3 and late_tenant is not None:
                scheduler.add_request(tenant_request("b0", late_tenant, 30, 4, seed=50))
            schedule = scheduler.schedule()
            chunks.append([(c.request_id, c.num_tokens) for c in schedule.scheduled])
            for update in scheduler.update_from_output(schedule, runner.execute(schedule)):
                outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        return chunks, outputs

    def prompt_tokens(step, tenant="a"):
        return sum(n for rid, n in step if n > 1 and rid.startswith(tenant))

    capped, capped_outputs = run(16)
    free, free_outputs = run(0)
    assert max(prompt_tokens(step) for step in capped) <= 16 < max(prompt_tokens(step) for step in free)
    assert any(prompt_tokens(step) and any(n == 1 for _, n in step) for step in capped)  # decodes beside a chunk
    assert capped_outputs == free_outputs
    # b arrives while a's prompts run: its whole 30-token prompt starts at once, a's chunks stay within the cap
    with_b, _ = run(16, late_tenant=B)
    assert max(prompt_tokens(step, "b") for step in with_b) == 30
    assert max(prompt_tokens(step) for step in with_b) <= 16
