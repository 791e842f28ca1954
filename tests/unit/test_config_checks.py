"""The rules between settings and the model (config_checks.py), as the engine applies them before any
worker starts."""

from dataclasses import replace

import pytest

from tokenmill.config import EngineConfig
from tokenmill.core.kv_spec import KVCacheSpec, StateCacheSpec, group_layers, single_group
from tokenmill.config_checks import (async_scheduling_applies, check_kv_events, check_kv_transfer, check_lora,
                                     check_node_rank, swaps_preempted)


def config(**options):
    return EngineConfig.from_kwargs(**options)


def test_swapping_needs_swap_space_and_groups_that_keep_every_block():
    attention = KVCacheSpec(num_kv_heads=2, head_dim=8, dtype_bytes=2)
    llama = single_group(2, attention)
    assert swaps_preempted(config(preemption_mode="swap", swap_space_gb=1), llama, "llama")
    assert swaps_preempted(config(preemption_mode="auto", swap_space_gb=1), llama, "llama")
    assert not swaps_preempted(config(preemption_mode="recompute", swap_space_gb=1), llama, "llama")
    assert not swaps_preempted(config(preemption_mode="swap", swap_space_gb=0), llama, "llama")
    # recurrent states beside full attention (a hybrid): every group keeps its blocks to the end, so they swap
    state = StateCacheSpec(conv_kernel=4, conv_dim=24, num_heads=2, head_dim=4, state_size=8, dtype_bytes=2)
    hybrid = group_layers([state, attention, state])
    assert swaps_preempted(config(preemption_mode="swap", swap_space_gb=1), hybrid, "granite")
    # sliding-window or chunked local layers: auto recomputes, swap is refused by name
    gemma = group_layers([replace(attention, sliding_window=4)] * 5 + [attention])
    assert not swaps_preempted(config(preemption_mode="auto", swap_space_gb=1), gemma, "gemma3")
    with pytest.raises(ValueError, match="preemption_mode swap: gemma3 has sliding-window layers"):
        swaps_preempted(config(preemption_mode="swap", swap_space_gb=1), gemma, "gemma3")
    llama4 = group_layers([replace(attention, attention_chunk=8)] * 3 + [attention])
    with pytest.raises(ValueError, match="preemption_mode swap: llama4 has chunked local attention layers"):
        swaps_preempted(config(preemption_mode="swap", swap_space_gb=1), llama4, "llama4")


def test_transfers_need_the_prefix_cache_one_group_and_one_rank():
    check_kv_transfer(config(), 1)
    with pytest.raises(ValueError, match="but prefix_caching is off"):
        check_kv_transfer(config(prefix_caching=False), 1)
    with pytest.raises(ValueError, match="but the model has several KV cache groups"):
        check_kv_transfer(config(), 2)
    with pytest.raises(ValueError, match="but the model runs on several ranks"):
        check_kv_transfer(config(tensor_parallel_size=2), 1)


def test_events_lora_and_node_rank():
    check_kv_events(config(), True)
    check_kv_events(config(prefix_caching=False), False)
    with pytest.raises(ValueError, match="kv_events_config: KV events describe the prefix cache"):
        check_kv_events(config(prefix_caching=False), True)
    check_lora(config(enable_lora=True))
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters run at tensor and pipeline parallel size 1"):
        check_lora(config(enable_lora=True, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="node_rank 1 runs only workers"):
        check_node_rank(config(nnodes=2, node_rank=1, tensor_parallel_size=2,
                               distributed_executor_backend="mp").parallel)
    check_node_rank(config().parallel)


def test_async_scheduling_is_on_for_one_cuda_rank_and_refused_with_worker_processes():
    assert async_scheduling_applies(config(), "cuda") and not async_scheduling_applies(config(), "cpu")
    assert async_scheduling_applies(config(async_scheduling=True), "cpu")
    assert not async_scheduling_applies(config(async_scheduling=False), "cuda")
    assert not async_scheduling_applies(config(tensor_parallel_size=2), "cuda")  # the default follows the ranks
    with pytest.raises(ValueError, match="async_scheduling: .* one rank in the engine's process"):
        async_scheduling_applies(config(async_scheduling=True, tensor_parallel_size=2), "cuda")


def test_cuda_graph_sizes_are_positive_integers():
    assert config(cuda_graph_sizes=[1, 8, 512]).model.cuda_graph_sizes == [1, 8, 512]
    for bad in ([], [0], [4, -2]):
        with pytest.raises(ValueError, match="cuda_graph_sizes must be positive integers"):
            config(cuda_graph_sizes=bad)
