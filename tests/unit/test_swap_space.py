"""The swap space's slot accounting and the preemption cost estimate (no torch)."""

from __future__ import annotations

from types import SimpleNamespace

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.swap_space import PreemptionCosts, SwapSpace


def test_swap_out_and_in_move_blocks_through_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    swap = SwapSpace(num_slots=3)
    assert kv.allocate_slots("a", 10)  # 3 blocks
    blocks = list(kv.block_tables("a")[0])
    assert swap.swap_out(kv, "a") and swap.holds("a")
    assert kv.pool.num_free_blocks == 8 and swap.num_free_slots == 0
    copies = swap.take_copies()
    assert copies.connector == "swap" and copies.out == list(zip(blocks, [0, 1, 2])) and copies.into == []
    assert kv.allocate_slots("b", 12)
    assert not swap.swap_out(kv, "b")  # no slot left: the caller recomputes
    assert kv.allocate_slots("a", 11)
    swap.swap_in(kv, "a", 10)
    copies = swap.take_copies()
    assert copies.into == list(zip([0, 1, 2], kv.block_tables("a")[0][:3])) and not swap.holds("a")
    assert swap.num_free_slots == 0  # read by the runner this step: free only after it
    swap.end_step()
    assert swap.num_free_slots == 3


def test_every_group_table_swaps_a_state_page_included():
    # a hybrid's groups: a recurrent state of 2 pool blocks (group 0) beside full attention (group 1)
    kv = KVCacheManager(num_blocks=12, block_size=4, windows=(None, None), state_groups=frozenset({0}), state_pages=2)
    swap = SwapSpace(num_slots=5)
    assert kv.allocate_slots("a", 10)  # 2 state blocks + 3 attention blocks
    state, attention = (list(table) for table in kv.block_tables("a"))
    assert swap.swap_out(kv, "a") and kv.pool.num_free_blocks == 12
    assert swap.take_copies().out == list(zip(state + attention, range(5)))
    assert kv.allocate_slots("b", 1)  # takes freed blocks: its own state page from the start
    assert not swap.swap_out(kv, "b")  # 3 blocks, no slot left: the caller recomputes
    assert kv.allocate_slots("a", 11)
    swap.swap_in(kv, "a", 10)
    new_state, new_attention = kv.block_tables("a")
    # each group's slots go back into that group's new blocks: the state into the new state page
    assert swap.take_copies().into == list(zip([0, 1], new_state)) + list(zip([2, 3, 4], new_attention[:3]))


def test_a_dropped_request_frees_its_slots_after_the_step():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    swap = SwapSpace(num_slots=2)
    kv.allocate_slots("a", 5)
    swap.swap_out(kv, "a")
    swap.drop("a")
    assert swap.num_free_slots == 0
    swap.end_step()
    assert swap.num_free_slots == 2 and not swap.holds("a")


def test_the_cheaper_way_back():
    arch = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, intermediate_size=1536, moe=None)
    kv_bytes = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M in bfloat16: 23 KB of KV against 0.2 GFLOP per token
    assert PreemptionCosts.for_model(arch, kv_bytes, "cpu").swap_is_cheaper(100)
    # a recurrent state copies its size whatever the tokens: dearer than recomputing a few, cheaper than many
    states = PreemptionCosts(kv_bytes_per_token=0, active_params=1e6, attention_width=0, copy_bytes_per_second=1e10,
                             flops_per_second=1e14, state_bytes=1e6)
    assert not states.swap_is_cheaper(100) and states.swap_is_cheaper(100_000)
    # much KV per FLOP (a fast device, few parameters): recompute, until attention's n^2 makes it dearer
    costs = PreemptionCosts(kv_bytes_per_token=1e6, active_params=1e6, attention_width=1e3,
                            copy_bytes_per_second=1e10, flops_per_second=1e14)
    assert not costs.swap_is_cheaper(100)
    assert costs.swap_is_cheaper(100_000_000)
