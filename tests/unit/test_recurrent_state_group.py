"""A recurrent-state KV group (Mamba2's conv and SSM states): one page per request for its life, carried
across chunks, reset by a recompute preemption, never shared or prefix-cached (no torch)."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_spec import KVCacheSpec, StateCacheSpec, group_layers
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduling import SchedulingLimits
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

STATE = StateCacheSpec(conv_kernel=4, conv_dim=96, num_heads=4, head_dim=8, state_size=16, dtype_bytes=2)


def test_recurrent_layers_form_one_group_whose_block_is_a_request_state_of_every_layer():
    layout = group_layers([STATE] * 3)
    assert layout.state_groups == {0} and layout.layers_per_group == 3
    page = 3 * 96 * 2 + 4 * 8 * 16 * 4  # conv window in the compute dtype, SSM state in float32
    assert layout.block_bytes(16) == layout.block_bytes(64) == 3 * page  # whatever the block size
    assert f"{3 * page / 1024:.1f} KiB per request" in layout.describe()


def test_prefix_caching_of_states_is_refused():
    with pytest.raises(ValueError, match="prefix caching of recurrent states"):
        KVCacheManager(8, 4, enable_prefix_caching=True, state_groups=frozenset({0}))


def test_a_request_holds_one_page_whatever_its_length_and_forks_share_none():
    kv = KVCacheManager(4, 4, watermark=0, state_groups=frozenset({0}))
    assert kv.max_blocks_held(1000, 8) == 1
    assert kv.allocate_slots("a", 3) and kv.allocate_slots("a", 300)
    assert len(kv.block_tables("a")[0]) == 1 and kv.pool.num_free_blocks == 3
    kv.trim("a", 100)
    assert len(kv.block_tables("a")[0]) == 1
    assert kv.fork("a", "a#1", 300) == 0 and kv.block_tables("a#1") == [[]]
    kv.free("a")
    kv.free("a#1")
    assert kv.pool.num_free_blocks == 4
    kv.pool.check_invariants()


class _StateRunner:
    """Stands for the model: each page holds (request, tokens folded in); a chunk from position 0 starts a
    zero state, any other must find its own request's state exactly at its start (carried across chunks and
    steps, never written by another request). The sampled token is a function of the state, so a lost or
    clobbered state would also change the ids."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.pages: dict[int, tuple[str, int, int]] = {}  # page -> (request, tokens folded, running hash)
        self.requests: dict[str, Request] = {}

    def execute(self, schedule) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        held = [self.kv.block_tables(chunk.request_id)[0] for chunk in schedule.scheduled]
        assert all(len(table) == 1 for table in held)
        assert len({table[0] for table in held}) == len(held), "two running requests share a state page"
        for chunk in schedule.scheduled:
            request = self.requests[chunk.request_id]
            (page,) = self.kv.block_tables(chunk.request_id)[0]
            if chunk.start == 0:
                state = (chunk.request_id, 0, 0)
            else:
                state = self.pages[page]
                assert state[:2] == (chunk.request_id, chunk.start), f"{chunk.request_id}: state not carried"
            digest = state[2]
            tokens = (request.prompt_token_ids + request.output_token_ids)[chunk.start:chunk.start + chunk.num_tokens]
            for token in tokens:
                digest = (digest * 31 + token) % 1_000_003
            self.pages[page] = (chunk.request_id, chunk.start + chunk.num_tokens, digest)
            if chunk.sample:
                result.sampled_token_ids[chunk.request_id] = [digest % 400 + 3]
        return result


def _run(num_pages: int, budget: int, prompts: dict[str, int], preempt_after: int = 0) -> dict[str, list[int]]:
    kv = KVCacheManager(num_pages, 4, watermark=0, state_groups=frozenset({0}))
    scheduler = Scheduler(SchedulingLimits(budget, 8, 256), kv)
    runner = _StateRunner(kv)
    runner.requests = scheduler.requests
    for rid, length in prompts.items():
        prompt = [(len(rid) * 37 + i * 11) % 300 + 3 for i in range(length)]
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=10), 10, (), 0))
    steps = 0
    while scheduler.has_unfinished_requests():
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, runner.execute(schedule))
        steps += 1
        if steps == preempt_after:  # as the scheduler does when the pool runs short: recompute
            victim = scheduler.running.pop()
            scheduler._preempt(victim)
        kv.pool.check_invariants()
        assert steps < 500
    assert kv.pool.num_free_blocks == num_pages
    return {rid: list(r.output_token_ids) for rid, r in scheduler.requests.items()}


def test_chunks_carry_the_state_and_a_recompute_preemption_restarts_it_from_zero():
    prompts = {"a": 23, "bb": 9, "ccc": 17}
    one_pass = _run(num_pages=8, budget=256, prompts=prompts)
    assert one_pass == _run(num_pages=8, budget=3, prompts=prompts)  # chunks of at most 3 tokens
    assert one_pass == _run(num_pages=2, budget=5, prompts=prompts)  # two pages: the third request waits
    assert one_pass == _run(num_pages=8, budget=7, prompts=prompts, preempt_after=6)


ATTENTION = KVCacheSpec(num_kv_heads=2, head_dim=16, dtype_bytes=2)  # 128 bytes per token and layer


def test_a_hybrid_layout_keeps_states_in_attention_blocks_of_groups_as_large_as_the_attention_groups():
    # Granite 4.0-H's pattern in small: 2 attention layers among 6 recurrent ones -> groups of 2 layers
    specs = [STATE, STATE, STATE, ATTENTION, STATE, STATE, STATE, ATTENTION]
    layout = group_layers(specs)
    assert layout.layers_per_group == 2 and layout.state_groups == {0, 1, 2}
    assert [group.layers for group in layout.groups] == [(0, 1), (2, 4), (5, 6), (3, 7)]
    assert layout.block_bytes(16) == 16 * 2 * 128  # an attention block: nothing padded to the state's size
    # 2624 bytes of one layer's state over blocks of one layer of 2048 bytes (16 tokens) or 8192 (64 tokens)
    assert STATE.page_bytes == 2624
    assert layout.state_blocks(16) == 2 and layout.state_blocks(64) == 1
    text = layout.describe(16)
    assert "KiB per request whatever its length, 0 per token (2 pool block(s) in each of its 3 group(s))" in text
    assert "full attention: 1 group(s), 2 layers, 0.2 KiB per token" in text
    with pytest.raises(ValueError, match="different state shapes"):
        group_layers([STATE, ATTENTION, StateCacheSpec(4, 64, 4, 8, 16, 2)])


def test_a_hybrid_request_holds_its_state_blocks_whatever_its_length_and_its_attention_blocks_per_token():
    kv = KVCacheManager(20, 4, watermark=0, windows=(None, None), state_groups=frozenset({1}), state_pages=3)
    assert kv.max_blocks_held(40, 8) == 10 + 3
    assert kv.allocate_slots("a", 5)
    attention, state = kv.block_tables("a")
    assert len(attention) == 2 and len(state) == 3
    assert kv.allocate_slots("a", 17)
    attention, state = kv.block_tables("a")
    assert len(attention) == 5 and len(state) == 3 and not set(attention) & set(state)
    assert kv.pool.num_free_blocks == 12
    assert not kv.can_admit("b", 40)  # 10 attention blocks and 3 for its states: 13 > 12 free
    assert kv.can_admit("b", 36)
    kv.free("a")
    assert kv.pool.num_free_blocks == 20
    kv.pool.check_invariants()
