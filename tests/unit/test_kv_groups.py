"""KV cache groups: layers grouped by what they cache, sliding-window groups giving back the blocks their
window has passed, and prefix hits that need only what a window still sees (no torch)."""

from __future__ import annotations

import pytest

from fake_runner import make_request, make_scheduler, run_to_completion
from tokenmill.core.kv_cache_manager import SKIPPED
from tokenmill.core.kv_spec import KVCacheSpec, group_layers

FULL = KVCacheSpec(1, 64, 2)
SLIDING = KVCacheSpec(1, 64, 2, sliding_window=512)


def gemma_pattern(num_layers: int) -> list[KVCacheSpec]:
    """Gemma 3's interleaving: five sliding-window layers, then one full-attention layer."""
    return [FULL if i % 6 == 5 else SLIDING for i in range(num_layers)]


def test_gemma_layers_form_equal_groups_that_share_one_pool():
    layout = group_layers(gemma_pattern(18))  # Gemma 3 270M: 15 sliding, 3 full
    assert layout.layers_per_group == 3
    assert [g.sliding_window for g in layout.groups] == [512] * 5 + [None]
    assert layout.groups[0].layers == (0, 1, 2) and layout.groups[5].layers == (5, 11, 17)
    assert layout.place(11) == (5, 1) and layout.place(4) == (1, 1)
    assert layout.block_bytes(16) == 16 * 3 * 2 * 64 * 2
    text = layout.describe()
    assert "sliding window of 512 tokens: 5 group(s), 15 layers" in text and "full attention: 1 group(s), 3 layers" in text
    assert group_layers(gemma_pattern(26)).layers_per_group == 2  # Gemma 3 1B: 22 sliding, 4 full
    assert group_layers([FULL] * 30).layers_per_group == 30  # one group: every layer shares the tables


def test_layers_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="different shapes"):
        group_layers([FULL, KVCacheSpec(2, 64, 2)])


def test_a_sliding_group_holds_only_its_window_while_the_full_group_keeps_every_block():
    scheduler, runner = make_scheduler(num_blocks=200, block_size=4, budget=8, max_model_len=256, windows=(None, 8))
    kv = scheduler.kv_cache
    scheduler.add_request(make_request("long", 40, max_tokens=60))
    most_held = 0
    while scheduler.has_unfinished_requests():
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, runner.execute(schedule))
        tables = kv.tables.get("long")
        if tables:
            held = len(tables[1]) - kv.released["long"][1]
            most_held = max(most_held, held)
            assert len(tables[0]) - kv.released["long"][0] == len(tables[0]), "the full group gives nothing back"
    # a chunk of 8 and the 7 keys before it: at most cdiv(7 + 8, 4) + 1 blocks, never the whole sequence
    assert most_held <= kv.blocks_for(7 + 8) + 1 < kv.blocks_for(100)
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_a_prefix_hit_needs_only_the_blocks_the_window_still_sees():
    scheduler, runner = make_scheduler(num_blocks=60, block_size=4, budget=64, max_model_len=128,
                                       prefix_caching=True, windows=(None, 8))
    kv = scheduler.kv_cache
    prompt = [(i * 7) % 300 + 3 for i in range(40)]
    scheduler.add_request(make_request("a", 0, prompt=prompt, max_tokens=20))
    first_outputs = run_to_completion(scheduler, runner)
    keys = kv.block_keys.leading(make_request("x", 0, prompt=prompt + [1]), 41)
    # the sliding group's early blocks went back to the pool while "a" ran, before its other blocks:
    # evicting up to them leaves every block "a" released at its end cached
    early = [kv.pool.lookup((1, key)) for key in keys[:3]]
    free_order = kv.pool.free_list()
    kv.pool.allocate(max(free_order.index(block) for block in early) + 1)
    assert all(kv.pool.lookup((1, key)) is None for key in keys[:3])
    assert all(kv.pool.lookup((0, key)) is not None for key in keys)
    blocks, num_hit = kv.match_prefix(make_request("b", 0, prompt=prompt + [7]), 41)
    assert num_hit == 40, "the full group still has every block and the window sees only the last ones"
    assert blocks[1][:3] == [SKIPPED] * 3 and SKIPPED not in blocks[0]
    assert first_outputs["a"]


@pytest.mark.parametrize("groups", [dict(num_blocks=48, windows=(None, 6, 6)),
                                    dict(num_blocks=40, windows=(None, None), chunks=(None, 8))],
                         ids=["windows", "chunks"])
def test_hits_forks_and_preemption_read_only_what_was_written(groups):
    """Under sliding windows and under attention chunks, the fake runner checks every read of every group against
    what was written there."""
    scheduler, runner = make_scheduler(block_size=4, budget=12, max_model_len=128, prefix_caching=True, **groups)
    prompt = [(i * 11) % 300 + 3 for i in range(30)]
    scheduler.add_request(make_request("a", 0, prompt=prompt, max_tokens=12))
    run_to_completion(scheduler, runner)
    for index in range(4):
        scheduler.add_request(make_request(f"b{index}", 0, prompt=prompt + [index] * 5, max_tokens=10, n=2))
    outputs = run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions_total > 0, "the pool is small enough that someone is preempted"
    assert scheduler.kv_cache.prefix_hits > 0
    assert len(outputs) == 8 and all(outputs.values())
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.num_blocks


def test_chunked_local_layers_form_their_own_groups():
    # Llama 4: three chunked layers to one full (NoPE) layer
    chunked = KVCacheSpec(1, 64, 2, attention_chunk=8192)
    layout = group_layers([FULL if i % 4 == 3 else chunked for i in range(8)])
    assert layout.chunks == [8192, 8192, 8192, None] and layout.windows == [None] * 4
    assert "chunked local attention of 8192 tokens: 3 group(s), 6 layers" in layout.describe()


def test_a_chunked_group_gives_back_the_blocks_before_its_current_chunk():
    # chunks of 8 positions, blocks of 4, chunks of at most 6 queries (budget): at most the step's 6 queries and the
    # 7 keys of its first query's chunk before them are held, never the whole sequence
    scheduler, runner = make_scheduler(num_blocks=200, block_size=4, budget=6, max_model_len=256, windows=(None, None),
                                       chunks=(None, 8))
    kv = scheduler.kv_cache
    scheduler.add_request(make_request("long", 40, max_tokens=60))
    most_held, released = 0, 0
    while scheduler.has_unfinished_requests():
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, runner.execute(schedule))  # reads checked against the writes
        tables = kv.tables.get("long")
        if tables:
            most_held = max(most_held, len(tables[1]) - kv.released["long"][1])
            released = max(released, kv.released["long"][1])
            assert kv.released["long"][0] == 0, "the full group gives nothing back"
    assert most_held <= kv.blocks_for(7 + 6) + 1 < kv.blocks_for(100) and released >= 20
    assert kv.pool.num_free_blocks == kv.num_blocks
