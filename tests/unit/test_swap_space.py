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
    # much KV per FLOP (a fast device, few parameters): recompute, until attention's n^2 makes it dearer
    costs = PreemptionCosts(kv_bytes_per_token=1e6, active_params=1e6, attention_width=1e3,
                            copy_bytes_per_second=1e10, flops_per_second=1e14)
    assert not costs.swap_is_cheaper(100)
    assert costs.swap_is_cheaper(100_000_000)
