"""The parts an `LLMEngine` is built from, each made by a function that returns it: the model's facts, the KV
cache's plan, the workers' spec, the KV cache manager with its transfers and event publisher, and the
scheduler. The engine's `__init__` calls them in order and holds what they return; nothing here keeps
state of its own."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from tokenmill.config import KV_CACHE_FORMATS
from tokenmill.config_checks import swaps_preempted
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_spec import KVCacheLayout
from tokenmill.core.scheduler import Scheduler, StepAttachment
from tokenmill.core.scheduling import SchedulingLimits
from tokenmill.core.swap_space import PreemptionCosts
from tokenmill.engine.kv_event_publisher import ZmqEventPublisher
from tokenmill.engine.kv_transfer import KVTransfers, model_identity
from tokenmill.engine.lora_registry import LoRARegistry
from tokenmill.kv_events_config import KVEventsConfig
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.models.arch import ArchConfig, kv_cache_layout
from tokenmill.models.loader import ModelSource
from tokenmill.multimodal.processing import ImageProcessing
from tokenmill.worker.model_setup import resolve_device, resolve_dtype
from tokenmill.worker.worker import WorkerSpec

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig

# image positions whose embeddings the runner keeps at least (four steps' encoder budgets when that is more):
# the rest of an image that chunked prefill split, and the same image in other requests, reuse them
ENCODER_CACHE_MIN = 8192

_GIB = 1 << 30


@dataclass(frozen=True)
class ModelFacts:
    """What the engine knows of its model before any worker starts: where it came from, its architecture,
    the device and dtype it runs in, and the context it serves (`read_model`)."""

    source: ModelSource
    arch: ArchConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int


@dataclass(frozen=True)
class KVPlan:
    """The KV cache's layout and sizes, decided before any worker starts (`num_blocks` is the asked-for size:
    on CUDA the ranks may size the pool themselves, and the executor reports what they hold)."""

    layout: KVCacheLayout
    block_size: int
    block_bytes: int
    num_blocks: int
    tier_slots: int
    swap_slots: int
    quantized_kv: Optional[str]  # "int8" / "fp8" (attention/kv_quant.py), None: the compute dtype


def read_model(config: EngineConfig, source: ModelSource) -> ModelFacts:
    """The facts of the model `source` under `config`: its device, dtype and context length. ValueError when
    max_model_len asks for more than the model's context."""
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device, source.arch.checkpoint_dtype)
    return ModelFacts(source, source.arch, device, dtype, _max_model_len(config, source.arch))


def make_image_processing(model: ModelFacts) -> Optional[ImageProcessing]:
    """The prompt-with-images processing of a vision-language model; None for a text-only one."""
    return ImageProcessing(model.source.path, model.arch.vision) if model.arch.vision is not None else None


def make_lora_registry(config: EngineConfig, arch: ArchConfig) -> Optional[LoRARegistry]:
    """The registry of the LoRA adapters served, with enable_lora; None without."""
    if not config.model.enable_lora:
        return None
    model = config.model
    return LoRARegistry(arch, model.max_lora_rank, model.max_cpu_loras or max(8, 4 * model.max_loras))


def plan_kv_cache(config: EngineConfig, model: ModelFacts) -> KVPlan:
    """The KV cache's layout and sizes: the pool (every rank's heads together: the budget is the whole run's),
    the second tier and the swap space."""
    cache = config.cache
    quantized_kv = None if cache.kv_cache_dtype == "auto" else KV_CACHE_FORMATS[cache.kv_cache_dtype]
    if quantized_kv and model.arch.mla is not None:
        raise ValueError(f"kv_cache_dtype {cache.kv_cache_dtype}: MLA latent caches are not quantised; use auto")
    layout = kv_cache_layout(model.arch, model.dtype.itemsize, quantized=quantized_kv)
    block_bytes = layout.block_bytes(cache.block_size)
    tier_slots = max(1, int(cache.secondary_kv_gb * _GIB) // block_bytes) \
        if cache.prefix_caching and cache.secondary_kv_gb > 0 else 0
    swap_slots = max(1, int(cache.swap_space_gb * _GIB) // block_bytes) \
        if swaps_preempted(config, layout, model.arch.architecture) else 0
    return KVPlan(layout, cache.block_size, block_bytes, _num_kv_blocks(config, model, block_bytes), tier_slots,
                  swap_slots, quantized_kv)


def worker_spec(config: EngineConfig, model: ModelFacts, plan: KVPlan) -> WorkerSpec:
    """What every rank is built from."""
    parallel = config.parallel
    return WorkerSpec(config.model, model.source.path, str(model.device), str(model.dtype).removeprefix("torch."),
                      model.max_model_len, plan.num_blocks, plan.block_size, plan.tier_slots,
                      config.cache.secondary_kv_folder, model.arch.eos_token_ids, swap_slots=plan.swap_slots,
                      quantized_kv=plan.quantized_kv, tp_size=parallel.tensor_parallel_size,
                      pp_size=parallel.pipeline_parallel_size, tp_exact=parallel.tensor_parallel_exact,
                      expert_parallel=parallel.enable_expert_parallel, threads=parallel.threads,
                      cpu_bind=parallel.cpu_bind, profile_tokens=config.scheduler.max_num_batched_tokens,
                      max_num_seqs=config.scheduler.max_num_seqs,
                      gpu_memory_utilization=config.cache.gpu_memory_utilization,
                      encoder_cache_tokens=max(ENCODER_CACHE_MIN, 4 * config.scheduler.encoder_budget))


def build_kv_cache(config: EngineConfig, model: ModelFacts, plan: KVPlan, num_blocks: int,
                   events_config: KVEventsConfig, transfer_config: Optional[KVTransferConfig], on_failure: ExitStack
                   ) -> tuple[KVCacheManager, Optional[KVTransfers], Optional[ZmqEventPublisher]]:
    """The KV cache manager over the `num_blocks` blocks every rank holds, its transfers (with a transfer
    config) and its event publisher (with events on); what they start is stopped by `on_failure`."""
    cache = config.cache
    kv_cache = KVCacheManager(num_blocks, plan.block_size, enable_prefix_caching=cache.prefix_caching,
                              hash_seed=cache.prefix_caching_hash_seed, secondary_slots=plan.tier_slots,
                              windows=plan.layout.windows, record_events=events_config.active,
                              state_groups=plan.layout.state_groups,
                              state_pages=plan.layout.state_blocks(plan.block_size),
                              chunks=plan.layout.chunks)
    transfers = None
    if transfer_config is not None:
        fingerprint = {"model": model_identity(model.source.path), "architecture": model.arch.architecture,
                       "dtype": str(model.dtype), "block_bytes": plan.block_bytes,
                       "kv_rows": plan.quantized_kv or "dtype"}  # int8 and fp8 blocks have one size
        transfers = KVTransfers(transfer_config, fingerprint, kv_cache)
        on_failure.callback(transfers.close)
    events = None
    if events_config.active:
        events = ZmqEventPublisher(events_config, config.parallel.data_parallel_rank)
        on_failure.callback(events.shutdown)
    return kv_cache, transfers, events


def build_scheduler(config: EngineConfig, model: ModelFacts, plan: KVPlan, kv_cache: KVCacheManager,
                    max_steps_in_flight: int, async_scheduling: bool,
                    attachments: Sequence[StepAttachment] = ()) -> Scheduler:
    """The scheduler over `kv_cache`, with `config`'s limits, completing each step it builds with the
    `attachments` (core/scheduler.py's `StepAttachment`)."""
    scheduler = config.scheduler
    kv_bytes_per_token, state_bytes = _swapped_bytes(plan)
    limits = SchedulingLimits(scheduler.max_num_batched_tokens, scheduler.max_num_seqs, model.max_model_len,
                              scheduler.schedule_policy, max_steps_in_flight,
                              config.model.max_loras if config.model.enable_lora else 0,
                              scheduler.preemption_mode,
                              PreemptionCosts.for_model(model.arch, kv_bytes_per_token, model.device.type, state_bytes),
                              scheduler.encoder_budget if model.arch.vision is not None else 0,
                              async_scheduling, config.speculative.enabled, scheduler.max_num_prompt_tokens)
    return Scheduler(limits, kv_cache, plan.swap_slots, attachments)


def _swapped_bytes(plan: KVPlan) -> tuple[float, float]:
    """What swapping a request out copies: (bytes per token of its attention groups' blocks, bytes of its recurrent
    states' pages, whatever its length)."""
    layout = plan.layout
    state_groups = len(layout.state_groups)
    if layout.attention_spec is None:  # all recurrent: a pool block is a request's state page
        return 0.0, float(state_groups * plan.block_bytes)
    attention_groups = len(layout.groups) - state_groups
    return (attention_groups * plan.block_bytes / plan.block_size,
            float(state_groups * layout.state_blocks(plan.block_size) * plan.block_bytes))


def _num_kv_blocks(config: EngineConfig, model: ModelFacts, block_bytes: int) -> int:
    """The pool's size: num_kv_blocks, else kv_cache_memory_gb's budget, else on CUDA 0 (the ranks size it
    from free GPU memory: worker/memory_profile.py), else 1 GiB's worth."""
    cache = config.cache
    if cache.num_kv_blocks:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_gb is None and model.device.type == "cuda":
        return 0
    return max(1, int((cache.kv_cache_memory_gb or 1.0) * _GIB) // block_bytes)


def _max_model_len(config: EngineConfig, arch: ArchConfig) -> int:
    limit, reason = arch.max_position_embeddings, "the model's context length"
    asked = config.model.max_model_len
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len {asked} is larger than {reason}, {limit}")
    return asked
