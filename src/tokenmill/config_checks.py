"""The rules between settings, and between settings and the model, as pure functions.

Each takes plain values (what the config says, what the model's KV layout is) and raises ValueError
naming the setting, or says what follows from the combination. The engine calls them all before it
starts a worker, so a refused combination never leaves anything to clean up.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig, ParallelConfig

if TYPE_CHECKING:
    from tokenmill.core.kv_spec import KVCacheLayout
    from tokenmill.models.arch import ArchConfig

logger = logging.getLogger(__name__)


def check_node_rank(parallel: ParallelConfig) -> None:
    """The engine runs on node 0; another node's `tokenmill serve` runs only workers."""
    if parallel.node_rank != 0:
        raise ValueError(f"node_rank {parallel.node_rank} runs only workers, and the engine runs on node 0: "
                         f"start this node with `tokenmill serve MODEL --nnodes {parallel.nnodes} "
                         f"--node-rank {parallel.node_rank} ...`")


def check_lora(config: EngineConfig) -> None:
    """LoRA adapters run on one rank."""
    if config.model.enable_lora and config.parallel.world_size > 1:
        raise ValueError("enable_lora: LoRA adapters run at tensor and pipeline parallel size 1")


def swaps_preempted(config: EngineConfig, layout: KVCacheLayout, architecture: str) -> bool:
    """Whether preempted requests swap their blocks out (else they are recomputed). Swapping moves a request's whole
    block tables: full attention's K/V and recurrent states (core/swap_space.py). A model with sliding-window or
    chunked local layers, whose groups give blocks back before a request ends, recomputes under `auto` and is
    refused under `swap`."""
    mode = config.scheduler.preemption_mode
    if mode == "recompute" or config.cache.swap_space_gb <= 0:
        return False
    windowed = [group for group in layout.groups if group.sliding_window is not None
                or group.attention_chunk is not None]
    if windowed:
        if mode == "swap":
            kind = "sliding-window" if windowed[0].sliding_window is not None else "chunked local attention"
            raise ValueError(f"preemption_mode swap: {architecture} has {kind} layers (KV cache groups that give "
                             "blocks back before a request ends), whose blocks are not swapped; use recompute")
        return False
    return True


def check_kv_events(config: EngineConfig, events_active: bool) -> None:
    """KV events describe the prefix cache's blocks."""
    if events_active and not config.cache.prefix_caching:
        raise ValueError("kv_events_config: KV events describe the prefix cache's blocks; they need "
                         "prefix_caching on")


def check_kv_transfer(config: EngineConfig, num_kv_groups: int) -> None:
    """Transfers load blocks into the prefix cache of one rank's single KV cache group."""
    problem = ("prefix_caching is off" if not config.cache.prefix_caching
               else "the model has several KV cache groups" if num_kv_groups > 1
               else "the model runs on several ranks" if config.parallel.world_size > 1 else None)
    if problem:
        raise ValueError(f"kv_transfer_config: transfers load blocks into the prefix cache of one rank's "
                         f"single KV group, but {problem}")


def async_scheduling_applies(config: EngineConfig, device_type: str) -> bool:
    """Whether steps are scheduled one ahead of the device (`SchedulerConfig.async_scheduling`): by default on
    CUDA with one rank in the engine's process; asked for explicitly, refused with several ranks or worker
    processes, whose non-sampling ranks cannot fill a placeholder."""
    asked, parallel = config.scheduler.async_scheduling, config.parallel
    if asked is None:
        return device_type == "cuda" and parallel.backend == "uni"
    if asked and parallel.backend != "uni":
        raise ValueError("async_scheduling: placeholders are filled on the rank that sampled them, so async "
                         "scheduling runs the model on one rank in the engine's process (distributed_executor_backend "
                         f"uni), but this engine uses {parallel.backend} with {parallel.world_size} rank(s); "
                         "use --no-async-scheduling")
    return asked


def for_recurrent_states(config: EngineConfig, architecture: str) -> EngineConfig:
    """`config` for a model whose layers keep a recurrent state per request (Mamba2, hybrids): prefix caching is
    turned off with a log line (a state page holds the state after a request's latest token, not at block
    boundaries, so there is nothing to reuse). Preemption recomputes or swaps the state pages out and back as any
    block (core/swap_space.py). Speculative decoding keeps each verified proposal's state until the sampler has
    accepted some (layers/mamba2_mixer.py's StateCandidates), in the sampling rank's process: it is refused on
    several ranks."""
    if config.speculative.enabled and config.parallel.world_size > 1:
        raise ValueError(f"speculative decoding: {architecture} keeps a recurrent state per request, which the "
                         "sampling rank rolls back past rejected proposals in its own process: it runs on one rank "
                         f"(this engine has {config.parallel.world_size}); turn speculative decoding off or use one rank")
    if not config.cache.prefix_caching:
        return config
    logger.info("prefix caching is off: %s keeps a recurrent state per request, which is not cached at block "
                "boundaries", architecture)
    return replace(config, cache=replace(config.cache, prefix_caching=False))


def for_model(config: EngineConfig, arch: ArchConfig) -> EngineConfig:
    """`config` as the model `arch` allows it (for_recurrent_states where its layers keep a recurrent state, then
    for_hidden_state_drafts); ValueError for what it refuses. README's support table asks this too."""
    if arch.keeps_recurrent_state:  # (Mamba2, Qwen3-Next's Gated DeltaNet): no prefix caching
        config = for_recurrent_states(config, arch.architecture)
    if config.speculative.speculative_method == "eagle3" and (arch.layer_blocks or arch.falcon_h1 is not None):
        raise ValueError(f"speculative_method eagle3: {arch.architecture} runs its checkpoint's layers as decoder "
                         "layers of another count (blocks grouped, or each layer halved), so an EAGLE-3 head's layer "
                         "ids would tap other places; use ngram or draft_model")
    return for_hidden_state_drafts(config)  # EAGLE-3 / MTP: no prefix caching


def for_hidden_state_drafts(config: EngineConfig) -> EngineConfig:
    """`config` for an EAGLE-3 head or MTP layer drafting (speculative_method eagle3 / mtp), which reads the target's
    hidden state at every position it feeds: prefix caching is turned off with a log line (a cached prefix is not
    computed again, so its hidden states would be missing and such a request could not speculate)."""
    if config.speculative.speculative_method not in ("eagle3", "mtp") or not config.cache.prefix_caching:
        return config
    logger.info("prefix caching is off: speculative_method %s reads the target's hidden state at every position, "
                "which a cached prefix does not compute", config.speculative.speculative_method)
    return replace(config, cache=replace(config.cache, prefix_caching=False))
