"""The synchronous engine: add requests, step, collect outputs."""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence, Union

from tokenmill.config import EngineConfig
from tokenmill.config_checks import (async_scheduling_applies, check_kv_events, check_kv_transfer, check_lora,
                                     check_node_rank, for_model)
from tokenmill.core.kv_connector import TRANSFER
from tokenmill.core.sched_output import RequestUpdate, SchedulerOutput
from tokenmill.core.scheduler import StepAttachment
from tokenmill.core.scheduling import SpecTotals
from tokenmill.engine.engine_build import (build_kv_cache, build_scheduler, make_image_processing,
                                           make_lora_registry, plan_kv_cache, read_model, worker_spec)
from tokenmill.engine.engine_errors import WeightTransferError
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.kv_event_publisher import to_wire
from tokenmill.engine.lora_registry import LoRARegistry
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.process_memory import resident_bytes
from tokenmill.engine.step_attachments import DraftProbs, GrammarMasking, LoRAUnloads
from tokenmill.engine.telemetry import DECODE, PREFILL, ChunkInfo, Telemetry
from tokenmill.executor import Executor, make_executor
from tokenmill.kv_events_config import KVEventsConfig
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.lora.request import LoRARequest
from tokenmill.models.loader import ModelSource, load_model_source, model_location
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.multimodal.processing import ImageLike, ImageProcessing
from tokenmill.outputs import RequestOutput
from tokenmill.request import RequestStatus, TenantShare
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.setup import make_speculation
from tokenmill.structured.compiler import GrammarCache
from tokenmill.structured.step_grammars import StepGrammars
from tokenmill.worker.worker import check_divisible

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues and cache; the counters are totals since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    secondary_cache_hits: int
    secondary_cache_saves: int
    spec: SpecTotals = field(default_factory=SpecTotals)
    encoder_images: int = 0  # images the vision encoder encoded (encoder-cache misses)
    encoder_seconds: float = 0.0  # the time it spent on them


@dataclass(frozen=True)
class _StepInFlight:
    """A step submitted and not yet finished: its grammar-mask failures, when it was submitted (monotonic)
    and its chunks' telemetry."""

    schedule: SchedulerOutput
    mask_failures: dict
    submitted: float
    chunks: list[ChunkInfo]


class LLMEngine:
    """Loads a model and runs requests through scheduler -> runner -> output processor, one step at a time.
    Its parts are made by engine/engine_build.py's functions, in the order `__init__` calls them."""

    def __init__(self, config: EngineConfig, source: Optional[ModelSource] = None) -> None:
        check_node_rank(config.parallel)
        check_lora(config)
        started = time.perf_counter()
        model = read_model(config, source or load_model_source(config.model.model, **model_location(config.model)))
        config = for_model(config, model.arch)  # recurrent states, EAGLE-3 / MTP: no prefix caching
        self.config = config
        self.source, self.tokenizer, self.arch = model.source, model.source.tokenizer, model.arch
        self.device, self.dtype, self.max_model_len = model.device, model.dtype, model.max_model_len
        self.eos_token_ids = self.arch.eos_token_ids
        self.image_processing: Optional[ImageProcessing] = make_image_processing(model)
        self.loras: Optional[LoRARegistry] = make_lora_registry(config, self.arch)
        plan = plan_kv_cache(config, model)
        self.kv_layout = plan.layout
        events_config = KVEventsConfig.parse(config.cache.kv_events_config).for_rank(config.parallel.data_parallel_rank)
        check_kv_events(config, events_config.active)
        transfer_config = KVTransferConfig.parse(config.cache.kv_transfer_config)
        if transfer_config is not None:
            check_kv_transfer(config, len(self.kv_layout.groups))
        check_divisible(self.arch, config.parallel.tensor_parallel_size, config.parallel.tensor_parallel_exact,
                        config.parallel.pipeline_parallel_size, config.parallel.enable_expert_parallel)
        self.async_scheduling = async_scheduling_applies(config, self.device.type)
        # every check is done: what starts from here is stopped again if a later part fails
        with ExitStack() as on_failure:
            self._worker_spec = worker_spec(config, model, plan)
            self.executor: Executor = make_executor(self._worker_spec, config.parallel, self.source)
            on_failure.callback(self.executor.shutdown)
            self.kv_cache, self.kv_transfers, self.kv_events = build_kv_cache(
                config, model, plan, self.executor.num_blocks, events_config, transfer_config, on_failure)
            if self.kv_events is not None:
                self._publish_kv_events()
            self._init_step_state()
            attachments: list[StepAttachment] = [self._drafts, self._grammar]
            if self.loras is not None:
                attachments.append(LoRAUnloads(self.loras, lambda: self.num_steps_in_flight))
            self.scheduler = build_scheduler(config, model, plan, self.kv_cache, self.executor.max_steps_in_flight,
                                             self.async_scheduling, attachments)
            self.speculation = make_speculation(config, self) if config.speculative.enabled else None
            on_failure.pop_all()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.inputs = InputProcessor(self.scheduler, self.arch.architecture, self.arch.vocab_size, self.max_model_len,
                                     self.eos_token_ids, self.tokenize, lambda spec: self.grammars.compile(spec),
                                     config.scheduler.schedule_policy, config.scheduler.max_num_seqs,
                                     self.image_processing, self.loras, self.kv_transfers,
                                     self.arch.hidden_size if config.model.enable_prompt_embeds else None)
        logger.info("engine ready in %.1fs: %s on %s (%s), %d KV blocks x %d tokens, max_model_len %d",
                    time.perf_counter() - started, self.arch.architecture, self.device, self.executor.description,
                    self.kv_cache.num_blocks, plan.block_size, self.max_model_len)
        logger.info("async scheduling: %s", "on (a step is prepared while the one before it runs)"
                    if self.async_scheduling else "off (one step at a time; --async-scheduling turns it on)")
        rows = config.cache.kv_cache_dtype
        rows = f"{rows} rows, a float32 scale each" if rows != "auto" else str(self.dtype).replace("torch.", "") + " rows"
        logger.info("KV cache: %d blocks of %d tokens x %d layers (%.1f KiB each, %s); %s", self.kv_cache.num_blocks,
                    plan.block_size, self.kv_layout.layers_per_group, plan.block_bytes / 1024, rows,
                    self.kv_layout.describe(plan.block_size))

    def _init_step_state(self) -> None:
        """What lives between steps: grammars, drafts, the steps in flight, telemetry, what sleeps."""
        self.asleep: set[str] = set()  # "weights", "kv_cache": see `sleep`
        self.weight_group = None  # the trainer's weight-update group joined (parallel/weight_sync.py), if any
        self.encoder_totals: tuple[int, float] = (0, 0.0)  # images the vision encoder encoded, and its seconds
        self._grammar = GrammarMasking(lambda: GrammarCache(self.tokenizer, self.arch.vocab_size, self.eos_token_ids))
        self._drafts = DraftProbs()
        # Invariant: the executor returns outputs in this order; at most executor.max_steps_in_flight, plus
        # one with async scheduling (`step`).
        self._in_flight: deque[_StepInFlight] = deque()
        self.telemetry = Telemetry()

    @property
    def runner(self):
        """The model runner, when the model runs in this process (the in-process executor)."""
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise AttributeError("the model runs in worker processes: this process has no runner")
        return worker.runner

    @property
    def model(self):
        """The loaded model, when it runs in this process (the in-process executor)."""
        return self.runner.model

    @property
    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache of structured output (built, with the step's matchers, on first use;
        thread-safe)."""
        return self._grammar.cache

    @property
    def step_grammars(self) -> Optional[StepGrammars]:
        """The matchers of the constrained requests; None until structured output is first used."""
        return self._grammar.step_grammars

    def shutdown(self) -> None:
        """Stop the executor's workers (a no-op for the in-process executor), the KV event publisher and
        the KV transfer listener, and leave a trainer's weight-update group."""
        self.destroy_weights_update_group()
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.kv_transfers is not None:
            self.kv_transfers.close()

    def _publish_kv_events(self) -> None:
        """Send the prefix cache's events since the last call as one batch (none when nothing happened)."""
        events = self.kv_cache.events.drain()
        if events:
            medium = "GPU" if self.device.type == "cuda" else "CPU"
            self.kv_events.publish(to_wire(events, self.kv_cache.block_size, medium, self.kv_cache.num_groups > 1))

    # ------------------------------------------------------------------ requests
    def prepare_images(self, prompt_token_ids: list[int], images: Sequence[ImageLike]
                       ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """The prompt with each image's placeholder expanded, and the images' features (multimodal/processing.py);
        thread-safe. ValueError for a text-only model, or placeholders and images that do not pair up."""
        return self.inputs.prepare_images(prompt_token_ids, images)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `prompt` with the model's tokenizer."""
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids

    def add_request(self, request_id: str, prompt: Union[str, list[int], None], params: SamplingParams,
                    prompt_token_ids: Optional[list[int]] = None, priority: int = 0,
                    arrival_time: Optional[float] = None, lora_request: Optional[LoRARequest] = None,
                    images: Sequence[ImageLike] = (), prompt_embeds: Any = None, background: bool = False,
                    tenant: Optional[TenantShare] = None) -> None:
        """Queue a request (with the LoRA adapter `lora_request`, registered on first use; for a vision-language
        model, with `images`, one per image placeholder of the prompt; with `prompt_embeds`, a [tokens, hidden]
        tensor, the prompt given as input embeddings under enable_prompt_embeds; `background`: a batch job's line,
        queued below every interactive request; `tenant`: who it is served for, in the scheduler's fair share).
        Raises ValueError (naming the problem) if it can never run (engine/input_processor.py)."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.asleep:
            raise ValueError(f"the engine is asleep ({', '.join(sorted(self.asleep))}): wake_up first")
        processed = self.inputs.process(request_id, prompt, params, prompt_token_ids, priority, arrival_time,
                                        lora_request, images, prompt_embeds, background, tenant)
        request = processed.request
        self.scheduler.add_request(request)
        self.output_processor.add(request_id, processed.prompt_text, request.prompt_token_ids,
                                  request.sampling_params, request.arrival_time)

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        """Stop requests now; their KV blocks return to the pool. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            internal = self.output_processor.internal_ids(request_id)
            self.scheduler.finish_requests(internal, RequestStatus.FINISHED_ABORTED)
            for rid in internal:
                self._record_finished(rid, "abort")
                self.scheduler.pop_finished(rid)
            if self.speculation is not None:
                self.speculation.forget(internal)
            self.output_processor.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running, or a step is still in flight."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (pool and second tier), as vLLM's reset_prefix_cache: False, nothing changed,
        while requests hold blocks (finish, abort or pause them first)."""
        if self._in_flight or not self.kv_cache.reset_prefix_cache():
            return False
        if self.kv_events is not None:
            self._publish_kv_events()
        return True

    def replace_workers(self) -> int:
        """After the worker group failed (a rank died or hung): stop what is left of it, start a new one with the
        same ranks, which load the weights again, and let every unfinished request resume by recomputing its
        prompt and the tokens it already produced; the prefix cache is forgotten (its blocks were the old group's).
        Returns the requests that resume. ValueError when the group cannot be replaced here (one rank in the
        engine's process, or ranks on other nodes); what starting the new group raises, when it fails."""
        old = self.executor
        refused = old.replacement_refused()
        if refused is not None:
            raise ValueError(refused)
        self._in_flight.clear()
        self._drafts.hold({})
        self.scheduler.recompute_everything()
        if not self.kv_cache.reset_prefix_cache():
            raise RuntimeError("KV blocks stayed held after every request was set to recompute")
        if self.kv_events is not None:
            self._publish_kv_events()
        old.shutdown(grace=0.5)  # a hung rank never stops by itself
        self.executor = make_executor(self._worker_spec, self.config.parallel, self.source)
        if self.executor.num_blocks < self.kv_cache.num_blocks:
            raise RuntimeError(f"the new worker group holds {self.executor.num_blocks} KV blocks, fewer than the "
                               f"{self.kv_cache.num_blocks} the scheduler plans with")
        return self.scheduler.num_waiting

    def update_weights_from_disk(self, model_path: str) -> int:
        """Serve the weights of the checkpoint at `model_path` (a folder or Hub id of the same model: architecture,
        config and weight format, checked tensor by tensor), copied in place, then forget the prefix cache, whose
        blocks the old weights computed. Only while no request is unfinished (pause with abort or wait first: a
        request kept would go on from K/V the old weights computed). ValueError naming the problem, the old weights
        still serving. The staging copy costs a second copy of the weights in memory while it runs. Returns the
        bytes copied."""
        self._check_idle("update_weights_from_disk")
        self._check_updatable("update_weights_from_disk")
        from tokenmill.models.loader.resolve import resolve_model_path

        path = resolve_model_path(model_path)
        copied = sum(self.executor.call("load_weights_from", (path,)))  # (every rank its shard)
        if not self.reset_prefix_cache():  # (idle: no block is held)
            raise RuntimeError("the prefix cache could not be reset after the weight update")
        logger.info("weights updated in place from %s (%.1f MB copied); prefix cache reset", path, copied / 1e6)
        return copied

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: Optional[str] = None,
                                  timeout_s: float = 120.0) -> None:
        """Join the process group a trainer streams new weights over (SGLang's init_weights_update_group; the
        trainer is rank 0 and serves the rendezvous at master_address:master_port; this engine is rank
        `rank_offset`). Blocks until every rank has joined, at most `timeout_s`. One group at a time."""
        self._check_updatable("init_weights_update_group")
        if self.weight_group is not None:
            raise ValueError(f"already in weight-update group {self.weight_group.name!r}: destroy it first")
        from tokenmill.parallel.weight_sync import open_group

        try:
            self.weight_group = open_group(master_address, master_port, rank_offset, world_size, group_name,
                                           backend, self.device, timeout_s)
        except (RuntimeError, OSError) as exc:  # (torch's DistStoreError is a RuntimeError)
            raise WeightTransferError(f"could not join weight-update group {group_name!r} at "
                                      f"{master_address}:{master_port}: {exc}") from exc

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: Optional[str] = None) -> int:
        """Receive the tensors the trainer broadcasts over the weight-update group (SGLang's
        update_weights_from_distributed: one per name, in order, of the dtypes and shapes given) and serve them in
        place of the checkpoint's of those names (Worker.load_weights_from_tensors), then forget the prefix cache.
        Only while no request is unfinished. Atomic: a name or shape the checkpoint lacks (ValueError) or a
        transfer that breaks (WeightTransferError: the trainer died; the group is left, join a new one) leaves
        the old weights serving. The staging copy costs the sent tensors plus a second copy of the weights while it
        runs. Returns the bytes copied."""
        self._check_updatable("update_weights_from_distributed")
        group = self.weight_group
        if group is None or group_name not in (None, group.name):
            named = f" {group_name!r}" if group_name else ""
            raise ValueError(f"no weight-update group{named} is joined: call init_weights_update_group first")
        self._check_idle("update_weights_from_distributed")
        try:
            tensors = group.receive(names, dtypes, shapes)
        except RuntimeError as exc:
            self.destroy_weights_update_group()
            raise WeightTransferError(f"the weight transfer broke (the trainer stopped sending; the served weights "
                                      f"are unchanged, and the group is left: join a new one): {exc}") from exc
        copied = sum(self.executor.call("load_weights_from_tensors", (tensors,)))  # (every rank its shard)
        if not self.reset_prefix_cache():  # (idle: no block is held)
            raise RuntimeError("the prefix cache could not be reset after the weight update")
        logger.info("weights updated in place from %d tensors of group %r (%.1f MB copied); prefix cache reset",
                    len(tensors), group.name, copied / 1e6)
        return copied

    def destroy_weights_update_group(self, group_name: Optional[str] = None) -> bool:
        """Leave the weight-update group (SGLang's destroy_weights_update_group); False when not in one."""
        group = self.weight_group
        if group is None or group_name not in (None, group.name):
            return False
        self.weight_group = None
        try:
            group.close()
        except RuntimeError as exc:  # (a broken group's connections are gone already)
            logger.warning("leaving weight-update group %r: %s", group.name, exc)
        return True

    def _check_updatable(self, method: str) -> None:
        """ValueError while LoRA adapters are served (they are on the base weights)."""
        if self.loras is not None:
            raise ValueError(f"{method}: LoRA adapters are served on the base weights; start without enable_lora "
                             "to update them")

    def _check_idle(self, method: str) -> None:
        if self.has_unfinished_requests():
            raise ValueError(f"{method}: requests are unfinished (their K/V is the old weights'); wait for them, "
                             "abort them, or pause with mode abort or wait first")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """vLLM's collective_rpc: `method` of the worker extension class (--worker-extension-cls) called on every
        rank between steps, each rank's result in a list, in rank order. ValueError for a method the class does not
        define."""
        return self.executor.call("call_extension", (method, tuple(args), dict(kwargs or {})))

    def sleep(self, level: int = 1) -> dict[str, int]:
        """vLLM's sleep mode, on CPU: level 1 gives the KV pool's memory back to the OS (its blocks and the prefix
        cache are forgotten: they read as zeros after); level 2 also lets go of the weights, which `wake_up`
        reloads from the checkpoint. Only while no request is unfinished; requests are refused until `wake_up`.
        Both run on every rank. Returns the engine process's resident memory before and after (with several ranks
        their pools and weights are in their own processes) and the KV pool bytes every rank released."""
        problem = (f"level must be 1 or 2, got {level!r}" if level not in (1, 2)
                   else "requests are unfinished: wait for them, abort them or pause first" if self.has_unfinished_requests()
                   else f"it runs on CPU for now (this engine runs on {self.device.type})" if self.device.type != "cpu"
                   else None)
        if problem is None and level == 2 and (self.loras is not None or self.image_processing is not None
                                               or self.speculation is not None):
            problem = "level 2 reloads the model alone: not with LoRA adapters, images or speculation (use level 1)"
        if problem is not None:
            raise ValueError(f"sleep: {problem}")
        before = resident_bytes()
        released = sum(self.executor.call("release_kv_pool"))  # (every rank's pool)
        self.reset_prefix_cache()  # (idle: nothing is held) the pool's blocks are zeros now
        if level == 2:
            self.executor.call("drop_weights")
        self.asleep = {"kv_cache", "weights"} if level == 2 else {"kv_cache"}
        after = resident_bytes()
        logger.info("asleep (level %d): resident memory %.1f -> %.1f MB, KV pool %.1f MB released", level,
                    before / 1e6, after / 1e6, released / 1e6)
        return {"resident_bytes_before": before, "resident_bytes_after": after, "kv_pool_bytes_released": released}

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """End sleep mode for `tags` ("weights", "kv_cache"; None: both): the weights reloaded (after level 2),
        the KV pool usable again (its pages come back as they are written). Requests run once nothing sleeps."""
        tags = set(tags) if tags is not None else {"weights", "kv_cache"}
        unknown = tags - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; known: weights, kv_cache")
        if "weights" in tags and "weights" in self.asleep:
            self.executor.call("restore_weights")  # (every rank its shard)
        self.asleep -= tags

    @property
    def is_sleeping(self) -> bool:
        """Whether any part (weights, KV cache) sleeps."""
        return bool(self.asleep)

    def stats(self) -> EngineStats:
        """Queue sizes, cache use and cumulative counters, for metrics."""
        kv, scheduler = self.kv_cache, self.scheduler
        tier_hits = kv.tier.num_hits * kv.block_size if kv.tier is not None else 0
        tier_saves = kv.tier.num_saves if kv.tier is not None else 0
        return EngineStats(scheduler.num_running, scheduler.num_waiting, kv.usage, scheduler.num_preemptions_total,
                           kv.prefix_queries, kv.prefix_hits, kv.pool.num_evictions, tier_hits, tier_saves,
                           replace(scheduler.spec_totals), *self.encoder_totals)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps submitted to the executor and not yet finished (at most one per pipeline stage)."""
        return len(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.output_processor.states)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Schedule and submit steps while the executor has room for one more in flight (one at a time with
        a single stage, one ahead of the device with async scheduling), then finish the oldest: the outputs
        of every request it touched."""
        depth = self.executor.max_steps_in_flight + self.async_scheduling
        try:
            while len(self._in_flight) < depth and self._submit_next():
                pass
            return self._finish_oldest() if self._in_flight else []
        except BaseException:
            self._abandon_in_flight()
            raise
        finally:
            if self.kv_events is not None:
                self._publish_kv_events()

    def _submit_next(self) -> bool:
        """Schedule a step and submit it; False when there is nothing to submit while others are in flight."""
        schedule = self.scheduler.schedule()  # with its drafts' distributions, grammar masks and LoRA unloads
        mask_failures = self._grammar.take_failures()
        if self._in_flight and not schedule.has_work():
            return False
        chunks = self._chunk_infos(schedule)
        self.executor.submit(schedule)
        self._in_flight.append(_StepInFlight(schedule, mask_failures, time.monotonic(), chunks))
        return True

    def _chunk_infos(self, schedule: SchedulerOutput) -> list[ChunkInfo]:
        """The telemetry of each scheduled chunk: decode when it computes one new token (plus its
        proposals) past the prompt, else prefill (a prompt chunk, or tokens recomputed after preemption)."""
        infos = []
        for chunk in schedule.scheduled:
            request = self.scheduler.requests[chunk.request_id]
            decode = (chunk.sample and chunk.num_tokens == 1 + len(chunk.spec_token_ids)
                      and chunk.start >= len(request.prompt_token_ids))
            infos.append(ChunkInfo(chunk.request_id, chunk.num_tokens, DECODE if decode else PREFILL,
                                   request.num_preemptions, request.arrival_time, chunk.sample))
        return infos

    def _finish_oldest(self) -> list[RequestOutput]:
        """Collect the oldest step in flight and turn its results into the outputs of the requests it
        touched: the scheduler advances them, the output processor detokenises and finds stop strings,
        the requests that ended are recorded and forgotten, and speculation proposes for the next step."""
        step = self._in_flight.popleft()
        result = self.executor.collect()
        transfers = step.schedule.copies(TRANSFER)
        if transfers is not None and transfers.into:
            self.kv_transfers.remove_imported([path for path, _, _ in transfers.into])
        self._grammar.finish(step.schedule, result, step.mask_failures)
        updates = self.scheduler.update_from_output(step.schedule, result)
        self.encoder_totals = (self.encoder_totals[0] + result.encoder_images,
                               self.encoder_totals[1] + result.encoder_seconds)
        outputs, stopped, failed = self.output_processor.process(updates)
        if self.kv_transfers is not None:
            self._describe_transfers(outputs)
        self.telemetry.record_step(step.submitted, step.chunks, graphed=result.graphed)
        self._end_requests(updates, stopped, failed)
        if self.speculation is not None:
            self.speculation.observe(updates)
            drafts = self.speculation.propose(self.scheduler.running, busy=self.scheduler.in_flight)
            self.scheduler.set_proposals({rid: draft.token_ids for rid, draft in drafts.items()})
            self._drafts.hold({rid: draft.probs for rid, draft in drafts.items() if draft.probs is not None})
        return outputs

    def _end_requests(self, updates: list[RequestUpdate], stopped: list[str], failed: list[str]) -> None:
        """Finish the requests a stop string ended (`stopped`) or whose output failed (`failed`), record every
        request that ended in this step, and forget them in the scheduler."""
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        ended = set(stopped)
        for update in updates:
            if update.finish_reason is not None or update.request_id in ended:
                self._record_finished(update.request_id, update.finish_reason or "stop")
        for request_id in failed:
            self._record_finished(request_id, "error")
        for request_id in [u.request_id for u in updates] + failed:
            self.scheduler.pop_finished(request_id)

    def _describe_transfers(self, outputs: list[RequestOutput]) -> None:
        """Give each finished prefill-server request's output its kv_transfer_params."""
        for output in outputs:
            request = self.scheduler.requests.get(output.request_id)
            if output.finished and request is not None and request.kv_export_path is not None:
                try:
                    output.kv_transfer_params = self.kv_transfers.describe(request)
                except OSError as exc:
                    logger.warning("request %s: its KV transfer file cannot be described (%s)",
                                   request.request_id, exc)
                    output.kv_transfer_params = {"do_remote_prefill": False, "do_remote_decode": False}

    def _record_finished(self, request_id: str, reason: str) -> None:
        """Tell the telemetry a request ended, with its output tokens (and its arrival, so that one that
        ended before it was ever scheduled still shows while someone watches)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            self.telemetry.record_finished(request_id, reason)
        else:
            self.telemetry.record_finished(request_id, reason, len(request.output_token_ids), request.arrival_time)

    def _abandon_in_flight(self) -> None:
        """After a failed step: wait out the steps still in flight and drop their results, so that the next
        output collected is the next step's own. The requests they carried are the caller's to abort."""
        while self._in_flight:
            self._in_flight.popleft()
            try:
                self.executor.collect()
            except Exception:
                break
        self._in_flight.clear()
        self.scheduler.in_flight.clear()
