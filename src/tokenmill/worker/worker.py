"""A worker: one rank's device, model (its shard) and KV pool, built from a plain-data spec."""

from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tokenmill.config import ModelConfig
from tokenmill.cpu_threads import ThreadPlan, format_cpu_list, thread_plan
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.named_objects import import_named
from tokenmill.sampling.logits_processors import load_logits_processors
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.layers.moe import experts_per_rank
from tokenmill.models.arch import ArchConfig, kv_cache_geometry, kv_cache_layout
from tokenmill.models.loader import ModelSource, load_model_source
from tokenmill.parallel.group import PipelineStage, TPGroup, init_parallel, rank_device, stage_layers
from tokenmill.worker.model_runner import ModelRunner, kv_cache_storage
from tokenmill.worker.pending_output import PendingOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank (pickles: it is sent to spawned worker processes).

    The engine decides the shapes (dtype, context length, pool size) so every rank agrees on them.
    """

    model: ModelConfig
    model_path: str
    device: str
    dtype: str
    max_model_len: int
    num_blocks: int
    block_size: int
    tier_slots: int
    tier_folder: Optional[str]
    eos_token_ids: tuple[int, ...]
    swap_slots: int = 0  # host slots for preempted requests' blocks (core/swap_space.py)
    encoder_cache_tokens: int = 8192  # image positions whose embeddings the runner keeps (worker/encoder_cache.py)
    # num_blocks 0: size the pool from free GPU memory after a profiling step of this many tokens
    profile_tokens: int = 2048
    max_num_seqs: int = 128  # rows of the profiling step's head, and the largest decode graph's bucket
    gpu_memory_utilization: float = 0.9
    quantized_kv: Optional[str] = None  # an int8 or fp8 KV cache (attention/kv_quant.py)
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    init_method: Optional[str] = None  # the torch.distributed rendezvous of a parallel run (rank = stage x tp + tp rank)
    tp_exact: bool = True  # see ParallelConfig.tensor_parallel_exact
    expert_parallel: bool = False  # see ParallelConfig.enable_expert_parallel
    nnodes: int = 1  # hosts the ranks are spread over (each runs world_size / nnodes of them)
    timeout: float = 120.0  # seconds the rendezvous waits for every rank
    threads: Optional[int] = None  # see ParallelConfig.threads
    cpu_bind: str = "none"  # see ParallelConfig.cpu_bind

    @property
    def world_size(self) -> int:
        """Ranks in the run."""
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing this host's cores."""
        return self.world_size // self.nnodes

    @property
    def driver_rank(self) -> int:
        """The rank that samples and answers: the first tensor-parallel rank of the last stage."""
        return (self.pp_size - 1) * self.tp_size


# the worker's methods Worker.control reaches by name (besides release_kv_pool, its runner's)
CONTROL_CALLS = ("call_extension", "drop_weights", "restore_weights", "load_weights_from", "load_weights_from_tensors")


class Worker:
    """Loads its model and KV pool, then runs steps: `execute(SchedulerOutput) -> ModelRunnerOutput`."""

    def __init__(self, spec: WorkerSpec, source: Optional[ModelSource] = None) -> None:
        self.spec = spec
        self.weights_path = spec.model_path  # the checkpoint the served weights came from (updates move it)
        self.device = rank_device(spec.device, spec.rank, spec.ranks_per_node)
        # this rank's threads (cpu_threads.py), applied in each thread that runs it: this one (the load) first
        self.threads = thread_plan(spec.threads, spec.cpu_bind, spec.rank % spec.ranks_per_node, spec.ranks_per_node)
        self._threads_in: set[int] = set()
        self._apply_threads()
        logger.info("rank %d threads: %s", spec.rank, self.threads.describe())
        dtype = DTYPES[spec.dtype]
        source = source or load_model_source(spec.model_path, with_tokenizer=False)
        arch = source.arch
        tp, stage = TPGroup.single(), PipelineStage()
        if spec.world_size > 1:
            # before the rendezvous: all fail alike
            check_divisible(arch, spec.tp_size, spec.tp_exact, spec.pp_size, spec.expert_parallel)
            tp, stage = init_parallel(spec.rank, spec.tp_size, spec.pp_size, arch.num_hidden_layers, spec.init_method,
                                      self.device, spec.tp_exact, spec.timeout, spec.expert_parallel)
        self.tp, self.stage = tp, stage  # (a reload builds this rank's shard again: _rank_model)
        self.model, backend = self._load_rank_model(source)
        layout = kv_cache_layout(arch, dtype.itemsize, tp.size, spec.quantized_kv)
        if backend.on_triton:  # its kv_cache_shape sees a one-byte row's width only: the exact check, at start
            from tokenmill.attention.triton_paged import check_cache
            for group in layout.groups:
                if group.recurrent:  # a state page is no K/V row (layers/mamba2_mixer.py)
                    continue
                check_cache(group.spec.head_dim, group.spec.quantized, group.spec.planes)
        self.num_blocks = spec.num_blocks or self._profile_blocks(backend, layout, dtype)
        self.runner = ModelRunner(self.model, backend, self.num_blocks, spec.block_size, layout, dtype,
                                  self.device, spec.eos_token_ids, spec.model.seed, spec.tier_slots, spec.tier_folder,
                                  swap_slots=spec.swap_slots, encoder_cache_tokens=spec.encoder_cache_tokens,
                                  max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                                  prompt_embeds=spec.model.enable_prompt_embeds)
        self.runner.logits_processors = load_logits_processors(spec.model.logits_processors or [])
        self.extension_methods = _extension_methods(spec.model.worker_extension_cls)
        # (a recurrent state's per-request loop is not captured: those models run eagerly)
        graphs = self._decode_graphs_apply(backend, tp, stage) and not layout.state_groups
        if graphs:
            try:
                self.runner.use_decode_graphs(spec.max_num_seqs, spec.max_model_len,
                                              max_num_tokens=spec.profile_tokens, sizes=spec.model.cuda_graph_sizes)
            except RuntimeError as exc:  # e.g. a layer that reads the device from the host while captured
                logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
                self.runner.graphs, graphs = None, False
        self.description = (f"{dtype}, {type(backend).__name__} attention"
                            f"{', CUDA graphs' if graphs else ''}; {self.model.describe_weights()}")

    def _decode_graphs_apply(self, backend, tp: TPGroup, stage: PipelineStage) -> bool:
        """Whether steps replay CUDA graphs: on CUDA with the Triton backend, one rank, LoRA off, unless
        --enforce-eager (each reason to run eagerly is logged)."""
        if self.device.type != "cuda" or self.spec.model.enforce_eager:
            return False
        reason = ("the attention backend is not triton_paged" if not backend.on_triton
                  else "the model runs on several ranks" if tp.size > 1 or stage.size > 1
                  else "LoRA adapters are enabled" if self.spec.model.enable_lora else None)
        if reason:
            logger.info("steps run eagerly (no CUDA graphs): %s", reason)
        return reason is None

    def _profile_blocks(self, backend, layout, dtype: torch.dtype) -> int:
        """The pool's size from free GPU memory (worker/memory_profile.py): num_blocks 0 asks for it."""
        from tokenmill.worker.memory_profile import profile_kv_blocks

        if self.device.type != "cuda":
            raise ValueError("num_blocks 0 sizes the KV pool from GPU memory, which needs a CUDA device")
        cache_dtype, width = kv_cache_storage(layout, dtype)
        spec, group = self.spec, layout.attention_spec or layout.groups[0].spec
        scratch = backend.kv_cache_shape(-(-spec.profile_tokens // spec.block_size), spec.block_size,
                                         group.num_kv_heads, width, group.planes)
        return profile_kv_blocks(self.model, backend, scratch, cache_dtype, spec.profile_tokens,
                                 spec.max_num_seqs, spec.block_size, layout.block_bytes(spec.block_size),
                                 spec.gpu_memory_utilization, self.device)

    def execute(self, schedule: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on this rank."""
        self._apply_threads()
        return self.runner.execute(schedule)

    def execute_async(self, schedule: SchedulerOutput) -> PendingOutput:
        """Issue one step on this rank without waiting for the device (`ModelRunner.execute_async`)."""
        self._apply_threads()
        return self.runner.execute_async(schedule)

    def load_weights_from(self, model_path: str) -> int:
        """Serve the weights of the checkpoint at `model_path` (the same model: architecture, config and format),
        copied in place into this rank's model once a second model loaded from it has checked out
        (models/weight_update.py); ValueError, the old weights still serving, otherwise. Returns the bytes copied.
        Every rank loads its own shard (each checks the same checkpoint, so all agree on a refusal)."""
        from tokenmill.models.weight_update import check_same_model, copy_weights_in_place

        try:
            source = load_model_source(model_path, with_tokenizer=False)
            check_same_model(self.model.arch, source.arch, model_path)
            copied = copy_weights_in_place(self.model, self._rank_model(source))
        except ValueError as exc:
            raise ValueError(f"the weights at {model_path!r} were not loaded, the served ones are unchanged: {exc}"
                             ) from exc
        self.weights_path = model_path
        return copied

    def load_weights_from_tensors(self, tensors: dict[str, torch.Tensor]) -> int:
        """Serve `tensors` (Hugging Face-named, as a trainer sends them; any subset of the checkpoint) in place of
        the served checkpoint's tensors of those names: a second model is loaded from the checkpoint the served
        weights came from with these tensors in their places, checked and copied in place as `load_weights_from`
        does (ValueError, nothing changed, for a name or shape the checkpoint lacks). Tensors earlier updates sent
        and this one does not are lost: every update names what it changes against the checkpoint (trainers send
        every parameter each time). Returns the bytes copied."""
        from tokenmill.models.weight_update import copy_weights_in_place, overlaid_source

        try:
            source = overlaid_source(load_model_source(self.weights_path, with_tokenizer=False), tensors)
            return copy_weights_in_place(self.model, self._rank_model(source))
        except ValueError as exc:
            raise ValueError(f"the {len(tensors)} tensors sent were not loaded, the served weights are unchanged: "
                             f"{exc}") from exc

    def call_extension(self, method: str, args: tuple, kwargs: dict) -> Any:
        """`method` of the worker extension class (--worker-extension-cls) called with this worker as self;
        ValueError for a name the class does not define (nothing else of the worker is reachable)."""
        if method not in self.extension_methods:
            known = ", ".join(sorted(self.extension_methods)) or "none: start with --worker-extension-cls"
            raise ValueError(f"collective_rpc: {method!r} is not a method of the worker extension class (its "
                             f"methods: {known})")
        return self.extension_methods[method](self, *args, **kwargs)

    def control(self, name: str, args: tuple, kwargs: dict) -> Any:
        """A call between steps from the engine to every rank (Executor.call): `call_extension` (collective_rpc),
        `release_kv_pool` (sleep: this rank's KV pool memory given back; its bytes), `drop_weights` and
        `restore_weights` (sleep level 2 and wake_up), `load_weights_from` and `load_weights_from_tensors` (weight
        updates: each rank loads its own shard). ValueError for another name: nothing else of the worker is
        reachable."""
        if name == "release_kv_pool":
            return self.runner.release_kv_pool()
        if name in CONTROL_CALLS:
            return getattr(self, name)(*args, **kwargs)
        raise ValueError(f"{name!r} is not a worker control call ({', '.join(('release_kv_pool', *CONTROL_CALLS))})")

    def drop_weights(self) -> None:
        """Let go of the model and its weights (sleep level 2): nothing runs until `restore_weights`."""
        self.model = self.runner.model = None
        gc.collect()

    def restore_weights(self) -> None:
        """Load the model again from its checkpoint (wake_up after sleep level 2): the one it started with or the
        last `load_weights_from` read; tensors a trainer sent are not kept (vLLM's level 2 drops them too)."""
        self.model = self.runner.model = self._rank_model(load_model_source(self.weights_path, with_tokenizer=False))

    def _rank_model(self, source: ModelSource) -> Any:
        """A model of `source` built as this rank's was at start (its shard, dtype, kernels, packing, KV rows)."""
        return self._load_rank_model(source)[0]

    def _load_rank_model(self, source: ModelSource) -> tuple[Any, Any]:
        """This rank's shard of `source` (tensor-parallel group and pipeline stage) as the spec asks for it, and its
        attention backend: what the worker serves at start, and what a reload builds again."""
        from tokenmill.worker.model_setup import load_model

        spec = self.spec
        return load_model(source, spec.model, self.device, DTYPES[spec.dtype], spec.max_model_len, tp=self.tp,
                          stage=self.stage, kv_rows=spec.quantized_kv)

    def _apply_threads(self) -> None:
        """Size and pin the calling thread's OpenMP team, once per thread (OpenMP keeps it per thread)."""
        thread = threading.get_ident()
        if thread not in self._threads_in:
            apply_thread_plan(self.threads)
            self._threads_in.add(thread)


def check_divisible(arch: ArchConfig, tp_size: int, exact: bool = True, pp_size: int = 1,
                    expert_parallel: bool = False) -> None:
    """ValueError naming the numbers when `tp_size` does not divide what tensor parallelism splits, the
    model has fewer layers than pipeline stages, or has layers tensor parallelism cannot split (MLA, Mamba2
    mixers, OLMoE's whole-projection q/k norm); and when `expert_parallel` is asked of a model without MoE
    layers or whose experts `tp_size` does not divide."""
    stage_layers(arch.num_hidden_layers, pp_size, 0)
    if expert_parallel and arch.moe is None:
        raise ValueError(f"enable_expert_parallel: {arch.architecture} has no mixture-of-experts layers to shard")
    kv_cache_geometry(arch, tp_size)  # MLA refuses tensor parallelism
    mixers = {arch.layer_spec(i).mixer for i in range(arch.num_hidden_layers)} - {"attention"}
    if tp_size > 1 and mixers:
        # (the layers refuse too, models/mamba2.py, models/qwen3_next.py: here it is said before any worker starts)
        raise ValueError(f"{arch.architecture} runs at tensor_parallel_size 1 (asked for {tp_size}): "
                         + ("Mamba2" if "mamba" in mixers else "Gated DeltaNet") + " mixers are not sharded")
    split_experts = []  # without expert parallelism each expert's intermediate is split like a dense MLP's
    if tp_size > 1 and arch.moe is not None:
        if expert_parallel:
            experts_per_rank(arch.moe.num_experts, tp_size)
        else:  # (under expert parallelism the shared experts are replicated)
            split_experts.append(("expert intermediate size", arch.moe.intermediate_size))
            if arch.moe.shared_intermediate_size:
                split_experts.append(("shared experts' intermediate size", arch.moe.shared_intermediate_size))
    if tp_size > 1 and arch.qk_norm and not arch.qk_norm_per_head:
        raise ValueError(f"tensor_parallel_size {tp_size}: {arch.architecture}'s q/k norm over the whole projections "
                         "does not support tensor parallelism")
    dense = arch.moe is None or any(not arch.layer_spec(i).moe for i in range(arch.num_hidden_layers))
    parts = [("attention heads", arch.num_attention_heads), ("KV heads", arch.num_key_value_heads),
             *([("intermediate size", arch.intermediate_size)] if dense else []),  # only dense MLPs split it
             *split_experts, ("vocabulary", arch.vocab_size)]
    if exact:
        parts.append(("hidden size", arch.hidden_size))
    for what, total in parts:
        if total % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {what} ({total})")


def apply_thread_plan(plan: ThreadPlan) -> None:
    """Size (and pin) the OpenMP team of the calling thread as `plan` says: PyTorch's and the kernels' parallel
    regions started from this thread run plan.threads threads, thread i on plan.cpus[i]. RuntimeError where the
    CPUs cannot be taken (no native kernels to pin the team with, or the OS refused)."""
    if plan.threads is None:
        return
    torch.set_num_threads(plan.threads)
    if plan.cpus is None:
        return
    kernels = cpu_kernels()
    if kernels is None:
        raise RuntimeError("cpu_bind pins the OpenMP threads through the native kernels, which are off or could "
                           "not be built here; use cpu_bind none")
    os.sched_setaffinity(0, plan.cpus)  # this thread, and any thread it starts
    if not kernels.bind_threads(plan.cpus):
        raise RuntimeError(f"cpu_bind: the OS refused to pin the threads to CPUs {format_cpu_list(plan.cpus)}")


def _extension_methods(name: Optional[str]) -> dict[str, Any]:
    """The public functions of the worker extension class `name` (module:Class), by name; ValueError when it
    cannot be found."""
    if not name:
        return {}
    cls = import_named(name, "worker_extension_cls")
    return {key: value for key, value in vars(cls).items() if callable(value) and not key.startswith("_")}
