"""How an `LLMEngine` is built, section by section: the model's facts, the KV cache's plan, the workers' spec,
the KV cache manager with its transfers and events, the scheduler, and the state between steps."""

from __future__ import annotations

import threading
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from tokenmill.config import KV_CACHE_FORMATS
from tokenmill.config_checks import swaps_preempted
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduling import SchedulingLimits
from tokenmill.core.swap_space import PreemptionCosts
from tokenmill.engine.kv_event_publisher import ZmqEventPublisher
from tokenmill.engine.kv_transfer import KVTransfers, model_identity
from tokenmill.engine.lora_registry import LoRARegistry
from tokenmill.engine.telemetry import ChunkInfo, Telemetry
from tokenmill.kv_events_config import KVEventsConfig
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.models.arch import kv_cache_layout
from tokenmill.models.loader import ModelSource
from tokenmill.multimodal.processing import ImageProcessing
from tokenmill.worker.model_setup import resolve_device, resolve_dtype
from tokenmill.worker.worker import WorkerSpec

# image positions whose embeddings the runner keeps at least (four steps' encoder budgets when that is more):
# the rest of an image that chunked prefill split, and the same image in other requests, reuse them
ENCODER_CACHE_MIN = 8192

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.core.sched_output import SchedulerOutput
    from tokenmill.executor import Executor
    from tokenmill.structured.compiler import GrammarCache
    from tokenmill.structured.step_grammars import StepGrammars

_GIB = 1 << 30


@dataclass(frozen=True)
class _KVPlan:
    """The KV cache's sizes, decided before any worker starts (the pool's num_blocks is the asked-for size:
    on CUDA the ranks may size it themselves, and the executor reports what they hold)."""

    block_size: int
    block_bytes: int
    num_blocks: int
    tier_slots: int
    swap_slots: int
    quantized_kv: Optional[str]  # "int8" / "fp8" (attention/kv_quant.py), None: the compute dtype


class EngineBuild:
    """`LLMEngine`'s base class: the sections its `__init__` runs in order (each sets the attributes it
    names), and the sizes they decide."""

    config: EngineConfig
    executor: Executor
    async_scheduling: bool

    def _read_model(self, source: ModelSource) -> None:
        """The model's facts: source, tokenizer, architecture, device, dtype, context, adapters."""
        config = self.config
        self.source, self.tokenizer, self.arch = source, source.tokenizer, source.arch
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device, self.arch.checkpoint_dtype)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = self.arch.eos_token_ids
        self.loras: Optional[LoRARegistry] = None  # the LoRA adapters served, with enable_lora
        self.image_processing: Optional[ImageProcessing] = None  # a vision-language model's prompts with images
        if self.arch.vision is not None:
            self.image_processing = ImageProcessing(source.path, self.arch.vision)
        if config.model.enable_lora:
            self.loras = LoRARegistry(self.arch, config.model.max_lora_rank, config.model.max_cpu_loras
                                      or max(8, 4 * config.model.max_loras))

    def _plan_kv_cache(self) -> _KVPlan:
        """The KV cache's layout and sizes: the pool (every rank's heads together: the budget is the whole
        run's), the second tier and the swap space."""
        cache = self.config.cache
        quantized_kv = None if cache.kv_cache_dtype == "auto" else KV_CACHE_FORMATS[cache.kv_cache_dtype]
        if quantized_kv and self.arch.mla is not None:
            raise ValueError(f"kv_cache_dtype {cache.kv_cache_dtype}: MLA latent caches are not quantised; use auto")
        self.kv_layout = kv_cache_layout(self.arch, self.dtype.itemsize, quantized=quantized_kv)
        block_bytes = self.kv_layout.block_bytes(cache.block_size)
        tier_slots = max(1, int(cache.secondary_kv_gb * _GIB) // block_bytes) \
            if cache.prefix_caching and cache.secondary_kv_gb > 0 else 0
        swap_slots = max(1, int(cache.swap_space_gb * _GIB) // block_bytes) \
            if swaps_preempted(self.config, len(self.kv_layout.groups), self.arch.architecture) else 0
        return _KVPlan(cache.block_size, block_bytes, self._num_kv_blocks(block_bytes), tier_slots, swap_slots,
                       quantized_kv)

    def _worker_spec(self, plan: _KVPlan) -> WorkerSpec:
        """What every rank is built from."""
        config, parallel = self.config, self.config.parallel
        return WorkerSpec(config.model, self.source.path, str(self.device), str(self.dtype).removeprefix("torch."),
                          self.max_model_len, plan.num_blocks, plan.block_size, plan.tier_slots,
                          config.cache.secondary_kv_folder, self.eos_token_ids, swap_slots=plan.swap_slots,
                          quantized_kv=plan.quantized_kv, tp_size=parallel.tensor_parallel_size,
                          pp_size=parallel.pipeline_parallel_size, tp_exact=parallel.tensor_parallel_exact,
                          expert_parallel=parallel.enable_expert_parallel,
                          profile_tokens=config.scheduler.max_num_batched_tokens,
                          max_num_seqs=config.scheduler.max_num_seqs,
                          gpu_memory_utilization=config.cache.gpu_memory_utilization,
                          encoder_cache_tokens=max(ENCODER_CACHE_MIN, 4 * config.scheduler.encoder_budget))

    def _build_kv_cache(self, plan: _KVPlan, events_config: KVEventsConfig,
                        transfer_config: Optional[KVTransferConfig], on_failure: ExitStack) -> None:
        """The KV cache manager over the blocks every rank holds, its transfers and its event publisher."""
        cache = self.config.cache
        self.kv_cache = KVCacheManager(self.executor.num_blocks, plan.block_size,
                                       enable_prefix_caching=cache.prefix_caching,
                                       hash_seed=cache.prefix_caching_hash_seed, secondary_slots=plan.tier_slots,
                                       windows=self.kv_layout.windows, record_events=events_config.active)
        self.kv_transfers: Optional[KVTransfers] = None
        if transfer_config is not None:
            fingerprint = {"model": model_identity(self.source.path), "architecture": self.arch.architecture,
                           "dtype": str(self.dtype), "block_bytes": plan.block_bytes,
                           "kv_rows": plan.quantized_kv or "dtype"}  # int8 and fp8 blocks have one size
            self.kv_transfers = KVTransfers(transfer_config, fingerprint, self.kv_cache)
            on_failure.callback(self.kv_transfers.close)
        self.kv_events: Optional[ZmqEventPublisher] = None
        if events_config.active:
            self.kv_events = ZmqEventPublisher(events_config, self.config.parallel.data_parallel_rank)
            on_failure.callback(self.kv_events.shutdown)
            self._publish_kv_events()

    def _build_scheduler(self, plan: _KVPlan) -> None:
        scheduler = self.config.scheduler
        limits = SchedulingLimits(scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
                                  self.max_model_len, scheduler.schedule_policy,
                                  self.executor.max_steps_in_flight,
                                  self.config.model.max_loras if self.config.model.enable_lora else 0,
                                  scheduler.preemption_mode,
                                  PreemptionCosts.for_model(self.arch, plan.block_bytes / plan.block_size,
                                                            self.device.type),
                                  scheduler.encoder_budget if self.arch.vision is not None else 0,
                                  self.async_scheduling, self.config.speculative.enabled)
        self.scheduler = Scheduler(limits, self.kv_cache, plan.swap_slots)

    def _build_step_state(self) -> None:
        """What lives between steps: grammars, drafts, the steps in flight, telemetry."""
        self._grammar_cache: Optional[GrammarCache] = None
        self.encoder_totals: tuple[int, float] = (0, 0.0)  # images the vision encoder encoded, and its seconds
        self._grammar_lock = threading.Lock()
        self.step_grammars: Optional[StepGrammars] = None
        self._draft_probs: dict = {}  # request id -> distributions of its drafted proposals, for the next step
        # Steps submitted and not yet finished, oldest first, each with its grammar-mask failures.
        # Invariant: the executor returns outputs in this order; at most executor.max_steps_in_flight.
        # Each entry: the step, its grammar mask failures, when it was submitted and its chunks' telemetry.
        self._in_flight: deque[tuple[SchedulerOutput, dict, float, list[ChunkInfo]]] = deque()
        self.telemetry = Telemetry()

    def _num_kv_blocks(self, block_bytes: int) -> int:
        """The pool's size: num_kv_blocks, else kv_cache_memory_gb's budget, else on CUDA 0 (the ranks size
        it from free GPU memory: worker/memory_profile.py), else 1 GiB's worth."""
        cache = self.config.cache
        if cache.num_kv_blocks:
            return cache.num_kv_blocks
        if cache.kv_cache_memory_gb is None and self.device.type == "cuda":
            return 0
        return max(1, int((cache.kv_cache_memory_gb or 1.0) * _GIB) // block_bytes)

    def _max_model_len(self) -> int:
        limit, reason = self.arch.max_position_embeddings, "the model's context length"
        asked = self.config.model.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ValueError(f"max_model_len {asked} is larger than {reason}, {limit}")
        return asked
