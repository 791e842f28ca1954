"""Speculative tokens in the request model: scheduling, rollback, the controller and the n-gram proposer (no torch)."""

from fake_runner import EOS, make_request, make_scheduler, next_token, run_to_completion
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.controller import COOLDOWN_STEPS, Draft, SpeculationController
from tokenmill.spec_decode.ngram import NgramProposer


class OracleProposer:
    """Proposes the fake model's true continuation, with every `wrong_every`-th proposal made wrong."""

    def __init__(self, wrong_every: int = 3) -> None:
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, wanted):
        result = {}
        for request, room in wanted:
            sequence, proposal = request.prompt_token_ids + request.output_token_ids, []
            for _ in range(room):
                self.calls += 1
                token = next_token(sequence)
                if self.calls % self.wrong_every == 0:
                    token += 1  # a wrong guess: everything after it must be rejected too
                proposal.append(token)
                sequence = sequence + [token]
            result[request.request_id] = Draft(proposal)
        return result

    def forget(self, request_id):
        pass


def run_speculative(scheduler, runner, controller, max_steps=10_000):
    outputs = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        schedule = scheduler.schedule()
        updates = scheduler.update_from_output(schedule, runner.execute(schedule))
        for update in updates:
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        for request in scheduler.running:  # rollback: the cache never holds more than the sequence's tokens
            assert request.num_computed_tokens <= request.num_tokens
            assert len(scheduler.kv_cache.block_tables(request.request_id)[0]) <= \
                scheduler.kv_cache.blocks_for(request.num_computed_tokens + 1)
        scheduler.kv_cache.pool.check_invariants()
        controller.observe(updates)
        propose(scheduler, controller)
    raise AssertionError("scheduler did not finish")


def propose(scheduler, controller):
    """What the engine does after each step: the controller's drafts become the scheduler's proposals."""
    drafts = controller.propose(scheduler.running)
    scheduler.set_proposals({rid: draft.token_ids for rid, draft in drafts.items()})


def requests(count=5):
    return [make_request(f"r{i}", 5 + 6 * i, max_tokens=20, seed_token=i) for i in range(count)]


def test_outputs_equal_plain_decoding_and_rejected_slots_are_released():
    scheduler, runner = make_scheduler(block_size=4, budget=64, num_blocks=128)
    for request in requests():
        scheduler.add_request(request)
    plain = run_to_completion(scheduler, runner)

    scheduler, runner = make_scheduler(block_size=4, budget=64, num_blocks=128)
    for request in requests():
        scheduler.add_request(request)
    controller = SpeculationController(OracleProposer(), num_tokens=4, max_batch=8, min_acceptance=0.0)
    speculative = run_speculative(scheduler, runner, controller)

    assert speculative == plain  # FakeRunner also checked that no step read a rejected token's KV
    totals = scheduler.spec_totals
    assert 0 < totals.accepted_tokens < totals.draft_tokens
    assert totals.emitted_tokens == totals.accepted_tokens + totals.num_rounds
    # per proposal position: the counts add up to the totals, and a later position is accepted only after the ones
    # before it (the per-position acceptance `tokenmill bench throughput` reports)
    drafted, accepted = totals.drafted_per_position, totals.accepted_per_position
    assert (sum(drafted), sum(accepted), drafted[0]) == (totals.draft_tokens, totals.accepted_tokens, totals.num_rounds)
    assert len(drafted) == len(accepted) == 4 and list(accepted) == sorted(accepted, reverse=True)
    assert all(a <= d for a, d in zip(accepted, drafted)) and accepted[0] > accepted[-1]
    assert len(runner.steps) < sum(len(v) for v in plain.values())
    assert scheduler.kv_cache.pool.num_used_blocks == 0


def test_no_proposals_past_max_tokens_and_a_stop_token_ends_the_step():
    scheduler, runner = make_scheduler(block_size=4, budget=64)
    prompt = [7, 8, 9, 10, 11]
    first = next_token(prompt)
    sequence = prompt + [first]
    tail = []
    for _ in range(2):
        tail.append(next_token(sequence + tail))
    # a request that stops on the third generated token, proposed by an oracle that knows the future
    request = Request("s", prompt, SamplingParams(max_tokens=10, stop_token_ids=[tail[1]]), 10, (EOS,))
    scheduler.add_request(request)
    controller = SpeculationController(OracleProposer(wrong_every=1000), num_tokens=4, max_batch=8,
                                       min_acceptance=0.0)
    outputs = run_speculative(scheduler, runner, controller)
    assert outputs["s"] == [first] + tail  # the accepted proposals after the stop token are dropped
    assert request.stop_reason == tail[1]

    scheduler, runner = make_scheduler(block_size=4, budget=64)
    scheduler.add_request(make_request("m", 6, max_tokens=3))
    controller = SpeculationController(OracleProposer(wrong_every=1000), num_tokens=4, max_batch=8,
                                       min_acceptance=0.0)
    assert len(run_speculative(scheduler, runner, controller)["m"]) == 3
    verified = [s for step in runner.steps for s in step.scheduled if s.spec_token_ids]
    # a step's tokens end one before the last position max_tokens allows: its sampled token takes that one
    assert verified and all(s.start + s.num_tokens <= 6 + 3 - 1 for s in verified)


def test_proposals_give_way_to_the_budget_and_to_a_short_pool():
    scheduler, runner = make_scheduler(block_size=4, budget=3)
    request = make_request("a", 5, max_tokens=8)
    scheduler.add_request(request)
    scheduler.update_from_output(s := scheduler.schedule(), runner.execute(s))
    scheduler.update_from_output(s := scheduler.schedule(), runner.execute(s))
    request.spec_token_ids = [1, 2, 3, 4]
    step = scheduler.schedule()
    assert step.scheduled[0].spec_token_ids == [1, 2]  # 1 real token + 2 proposals fill the budget of 3

    scheduler, runner = make_scheduler(block_size=4, num_blocks=2, budget=64)
    request = make_request("b", 6, max_tokens=2)
    scheduler.add_request(request)
    scheduler.update_from_output(s := scheduler.schedule(), runner.execute(s))
    request.spec_token_ids = [1, 2, 3, 4]  # would need a third block: dropped, nobody is preempted
    step = scheduler.schedule()
    assert step.num_preempted == 0 and step.scheduled[0].spec_token_ids == []


def test_controller_stands_aside_for_big_batches_and_poor_acceptance():
    scheduler, runner = make_scheduler(block_size=4, budget=256, max_seqs=16)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 4, max_tokens=200, seed_token=i))
    controller = SpeculationController(OracleProposer(wrong_every=1), num_tokens=3, max_batch=4, min_acceptance=0.5)
    scheduler.update_from_output(s := scheduler.schedule(), runner.execute(s))
    propose(scheduler, controller)
    assert all(not r.spec_token_ids for r in scheduler.running)  # 6 running > max_batch 4

    scheduler.finish_requests(["r4", "r5"], scheduler.running[0].status.FINISHED_ABORTED)
    def rounds_in(steps: int) -> int:
        rounds = 0
        for _ in range(steps):
            propose(scheduler, controller)
            rounds += sum(bool(r.spec_token_ids) for r in scheduler.running)
            schedule = scheduler.schedule()
            controller.observe(scheduler.update_from_output(schedule, runner.execute(schedule)))
        return rounds

    # every proposal is wrong: each request gets its two rounds, then sits out the cooldown
    assert rounds_in(COOLDOWN_STEPS) == 2 * 4
    assert all(controller.is_paused(r.request_id) for r in scheduler.running)
    # after the cooldown it tries again, fails again, and sits out twice as long
    assert rounds_in(2 + 2 * COOLDOWN_STEPS) == 2 * 4
    assert rounds_in(2) == 2 * 4


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    ngram = NgramProposer(min_n=2, max_n=3)
    assert ngram.propose_one([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3) == [5, 6, 1]  # latest occurrence of [1, 2]
    assert ngram.propose_one([9, 1, 2, 7, 3, 1, 2, 8, 9, 1, 2], 2) == [7, 3]  # [9, 1, 2] beats a later [1, 2]
    assert ngram.propose_one([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # never past the sequence's end
    assert ngram.propose_one([1, 2, 3, 4, 5], 3) == []
    assert NgramProposer(1, 1).propose_one([4, 5, 4], 2) == [5, 4]
