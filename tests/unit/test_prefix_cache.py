"""Prefix caching in the torch-free core: reuse, the last-token rule, LRU eviction, and invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fake_runner import make_request, make_scheduler, run_to_completion
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_events import BlocksRemoved, BlocksStored
from tokenmill.request import RequestStatus

SHARED = list(range(100, 116))  # four 4-token blocks


def first_chunk(scheduler, runner, request):
    scheduler.add_request(request)
    schedule = scheduler.schedule()
    result = runner.execute(schedule)
    item = next(s for s in runner.items if s.request_id == request.request_id)
    scheduler.update_from_output(schedule, result)
    return item


def test_a_later_request_starts_after_the_shared_prefix():
    scheduler, runner = make_scheduler(prefix_caching=True)
    first = first_chunk(scheduler, runner, make_request("a", 0, prompt=SHARED + [1, 2, 3, 4], max_tokens=2))
    run_to_completion(scheduler, runner)
    item = first_chunk(scheduler, runner, make_request("b", 0, prompt=SHARED + [9, 9], max_tokens=2))
    assert item.start == 16 and item.token_ids == [9, 9]
    assert list(item.block_ids[0][:4]) == list(first.block_ids[0][:4])
    assert scheduler.kv_cache.prefix_hits == 16
    run_to_completion(scheduler, runner)
    scheduler.kv_cache.pool.check_invariants()


def test_a_full_hit_still_recomputes_the_last_prompt_token():
    scheduler, runner = make_scheduler(prefix_caching=True)
    first_chunk(scheduler, runner, make_request("a", 0, prompt=SHARED, max_tokens=1))
    run_to_completion(scheduler, runner)
    item = first_chunk(scheduler, runner, make_request("b", 0, prompt=SHARED, max_tokens=1))
    assert item.start == 12 and item.token_ids == SHARED[12:] and item.sample


def test_cache_off_reuses_nothing():
    scheduler, runner = make_scheduler(prefix_caching=False)
    first_chunk(scheduler, runner, make_request("a", 0, prompt=SHARED + [1], max_tokens=1))
    run_to_completion(scheduler, runner)
    assert first_chunk(scheduler, runner, make_request("b", 0, prompt=SHARED + [1], max_tokens=1)).start == 0


def test_outputs_equal_with_cache_on_and_off_warm_and_after_preemption():
    def run(prefix_caching, num_blocks):
        scheduler, runner = make_scheduler(num_blocks=num_blocks, budget=16, prefix_caching=prefix_caching)
        outputs = {}
        for round_ in range(2):  # the second round is warm
            for i in range(5):
                scheduler.add_request(make_request(f"{round_}-{i}", 0, prompt=SHARED[: 4 + 3 * i] + [i] * (i + 1),
                                                   max_tokens=6))
            outputs.update(run_to_completion(scheduler, runner))
        return outputs, scheduler

    reference, _ = run(False, 256)
    warm, scheduler = run(True, 256)
    tight, tight_scheduler = run(True, 14)
    assert warm == reference and tight == reference
    assert scheduler.kv_cache.prefix_hits > 0
    assert tight_scheduler.num_preemptions_total > 0 and tight_scheduler.kv_cache.pool.num_evictions > 0


def test_eviction_takes_the_least_recently_used_free_block():
    kv = KVCacheManager(num_blocks=4, block_size=2, watermark=0, enable_prefix_caching=True)
    pool = kv.pool
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.register(block, kv.block_key(None, [i, i]))
    pool.release([blocks[1]])
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    pool.share([pool.lookup(kv.block_key(None, [0, 0]))])  # a hit revives block 0
    taken = pool.allocate(2)  # the never-used block first, then the oldest free cached one
    assert blocks[1] in taken and blocks[0] not in taken
    assert pool.lookup(kv.block_key(None, [1, 1])) is None and pool.num_evictions == 1
    pool.check_invariants()


def test_keys_verify_tokens_and_chain_parents():
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    a = kv.block_key(None, [1, 2])
    assert kv.block_key(None, [1, 2]) == a and kv.block_key(None, [2, 1]) != a
    assert kv.block_key(a, [3, 4]) != kv.block_key(kv.block_key(None, [9, 9]), [3, 4])
    salted = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True, hash_seed="another seed")
    assert salted.block_key(None, [1, 2]) != a


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                         st.integers(0, 7), st.integers(1, 30), st.integers(1, 6)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from([0, 3, 16]), st.sampled_from([(None,), (6, None, 6), (9,)]))
def test_random_interleavings_keep_the_pool_consistent(operations, secondary_slots, windows):
    """add / step (finishing requests) / abort (and the evictions, second-tier saves and loads, and
    preemptions they cause) in any order: ref counts, the free list and the cache agree, cached keys
    match block contents in both tiers, and no request ever reads KV it did not (or a shared prefix
    did not) write — with one full-attention group, with sliding-window groups beside a full one (a
    window of 6 tokens, blocks of 4), and with sliding-window groups only. The KV event log, replayed
    by a subscriber, always names exactly the blocks the pool can hit."""
    scheduler, runner = make_scheduler(num_blocks=12 * len(windows), block_size=4, budget=12, max_model_len=64,
                                       prefix_caching=True, secondary_slots=secondary_slots, windows=windows,
                                       record_events=True)
    pool = scheduler.kv_cache.pool
    subscriber_view: set = set()
    counter = 0
    for op, variant, length, max_tokens in operations:
        if op == "add":
            prompt = (SHARED[: 4 * (variant % 4)] + [variant] * length)[:40]
            if len(prompt) + max_tokens <= 48:
                scheduler.add_request(make_request(f"r{counter}", 0, prompt=prompt, max_tokens=max_tokens))
                counter += 1
        elif op == "step":
            schedule = scheduler.schedule()
            scheduler.update_from_output(schedule, runner.execute(schedule))
        else:
            live = [r for r in scheduler.requests.values() if not r.status.finished]
            if live:
                scheduler.finish_requests([live[variant % len(live)].request_id], RequestStatus.FINISHED_ABORTED)
        pool.check_invariants()
        for event in scheduler.kv_cache.events.drain():
            if isinstance(event, BlocksStored):
                assert not subscriber_view & {(event.group, h) for h in event.hashes}, "stored twice"
                subscriber_view |= {(event.group, h) for h in event.hashes}
            elif isinstance(event, BlocksRemoved):
                assert {(event.group, h) for h in event.hashes} <= subscriber_view, "removed unknown block"
                subscriber_view -= {(event.group, h) for h in event.hashes}
        assert subscriber_view == {(group, digest) for group, (digest, _) in pool.cached}
        for key, block in pool.cached.items():
            _group, (_digest, tokens) = key
            written = runner.block_contents.get(block, {})
            assert [written.get(i) for i in range(len(tokens))] == list(tokens), "cached key disagrees with KV"
        tier = scheduler.kv_cache.tier
        if tier is not None:
            tier.check_invariants()
            for key, slot in tier._slots.items():
                saved = runner.tier_contents.get(slot, {})
                _group, (_digest, tokens) = key
                assert [saved.get(i) for i in range(len(tokens))] == list(tokens), "tier slot disagrees with key"
    run_to_completion(scheduler, runner)
    assert pool.num_free_blocks == pool.num_blocks


def test_lpm_admits_the_longest_cached_prefix_first_without_starving_others():
    scheduler, runner = make_scheduler(prefix_caching=True, max_seqs=1, budget=64)
    scheduler.limits = scheduler.limits.__class__(64, 1, 256, "lpm")
    first_chunk(scheduler, runner, make_request("warm", 0, prompt=SHARED + [1], max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("cold", 0, prompt=[7] * 17, max_tokens=1))
    scheduler.add_request(make_request("hit", 0, prompt=SHARED + [2], max_tokens=1))
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["hit"]

    starving, runner = make_scheduler(prefix_caching=True, max_seqs=1, budget=64)
    starving.limits = starving.limits.__class__(64, 1, 256, "lpm")
    first_chunk(starving, runner, make_request("warm", 0, prompt=SHARED + [1], max_tokens=1))
    run_to_completion(starving, runner)
    starving.add_request(make_request("cold", 0, prompt=[7] * 17, max_tokens=1))
    order = []
    for i in range(12):  # a stream of cache hits keeps arriving
        starving.add_request(make_request(f"hit{i}", 0, prompt=SHARED + [i + 10], max_tokens=1))
        schedule = starving.schedule()
        order += [s.request_id for s in schedule.scheduled if s.start == 0 or s.request_id.startswith("hit")]
        starving.update_from_output(schedule, runner.execute(schedule))
    assert "cold" in order and order.index("cold") <= 9


def test_evicted_prefix_comes_back_from_the_second_tier():
    scheduler, runner = make_scheduler(num_blocks=8, block_size=4, budget=64, prefix_caching=True,
                                       secondary_slots=8)
    first_chunk(scheduler, runner, make_request("a", 0, prompt=SHARED + [1], max_tokens=1))
    run_to_completion(scheduler, runner)
    first_chunk(scheduler, runner, make_request("flood", 0, prompt=[3] * 31, max_tokens=1))  # evicts all of a's blocks
    run_to_completion(scheduler, runner)
    kv = scheduler.kv_cache
    assert kv.pool.num_evictions >= 4 and kv.tier.num_saves >= 4
    item = first_chunk(scheduler, runner, make_request("b", 0, prompt=SHARED + [2], max_tokens=1))
    assert item.start == 16, "the shared prefix came back from the second tier instead of being recomputed"
    assert kv.tier.num_hits == 4 and len(runner.steps[-1].copies("tier").into) == 4


def test_a_reset_forgets_every_cached_block_in_both_tiers_and_waits_for_holders():
    """After new weights nothing cached may be found (vLLM's reset_prefix_cache): refused while a request holds
    blocks, then every key of the pool and the second tier is forgotten and the events say all were cleared."""
    scheduler, runner = make_scheduler(num_blocks=8, block_size=4, budget=64, prefix_caching=True,
                                       secondary_slots=8)
    kv = scheduler.kv_cache
    first_chunk(scheduler, runner, make_request("a", 0, prompt=SHARED + [1], max_tokens=1))
    run_to_completion(scheduler, runner)
    first_chunk(scheduler, runner, make_request("flood", 0, prompt=[3] * 31, max_tokens=2))  # a's blocks to the tier
    assert not kv.reset_prefix_cache()  # "flood" still runs and holds blocks: nothing changed
    run_to_completion(scheduler, runner)
    assert kv.tier.num_used and kv.pool.cached
    assert kv.reset_prefix_cache()
    assert not kv.pool.cached and kv.tier.num_used == 0
    kv.pool.check_invariants()
    kv.tier.check_invariants()
    for prompt in (SHARED + [2], [3] * 31):  # from the tier and from the pool before: recomputed now
        item = first_chunk(scheduler, runner, make_request(f"after {prompt[0]}", 0, prompt=prompt, max_tokens=1))
        assert item.start == 0
        run_to_completion(scheduler, runner)
