"""The model runner: one SchedulerOutput in, one forward pass over a flattened batch, sampled tokens out."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from tokenmill.attention.base import AttentionBackend, SequenceChunk
from tokenmill.attention.kv_quant import STORAGE, row_width
from tokenmill.core.kv_spec import KVCacheLayout
from tokenmill.core.sched_output import GrammarMasks, ModelRunnerOutput, SchedulerOutput
from tokenmill.layers.mamba2_mixer import RecurrentState, StateChunk
from tokenmill.layers.paged_state import PagedState
from tokenmill.sampling.batch import SamplingRow
from tokenmill.sampling.logprobs import logprob_entries, logprob_tensors, token_logprobs
from tokenmill.sampling.rejection import Proposal, verify
from tokenmill.sampling.sampler import NO_TOKEN, NOTHING_ALLOWED, sample
from tokenmill.worker.encoder_cache import EncoderCache
from tokenmill.attention.host_copies import PinnedCopies
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.kv_tier_store import KVTierStore
from tokenmill.worker.kv_connectors import run_phase, worker_connectors
from tokenmill.worker.mrope import mrope_positions
from tokenmill.worker.pending_output import HostRead, PendingOutput, fail_request, step_event, to_host
from tokenmill.worker.request_state import BatchItem
from tokenmill.worker.step_inputs import StepInputs, is_decode_step
from tokenmill.kernels.zeroed_memory import zeroed


class ModelRunner:
    """Owns the KV cache tensors, its own state of every live request (from the step contract) and
    the per-request generators; turns a step's schedule into tokens.

    KV cache: `layout.layers_per_group` page tensors, in the layout the attention backend chooses; the
    layer at position j of its KV cache group g uses page tensor j, and group g's slot s (block
    s // block_size, offset s % block_size) holds that layer's K/V of the token the scheduler mapped to s
    in group g's table (core/kv_spec.py).
    """

    def __init__(self, model: Any, backend: AttentionBackend, num_blocks: int, block_size: int,
                 layout: KVCacheLayout, dtype: torch.dtype, device: torch.device,
                 eos_token_ids: tuple[int, ...], seed: int = 0, tier_slots: int = 0,
                 tier_folder: Optional[str] = None, request_seed: Callable[[int], int] = lambda seed: seed,
                 swap_slots: int = 0, encoder_cache_tokens: int = 8192, max_num_seqs: int = 16,
                 max_model_len: int = 2048, prompt_embeds: bool = False) -> None:
        self.model, self.backend = model, backend
        self.block_size, self.device = block_size, device
        self.eos_token_ids = eos_token_ids
        spec = layout.attention_spec or layout.groups[0].spec  # (a hybrid's first group may be a state's)
        cache_dtype, width = kv_cache_storage(layout, dtype)
        self.num_blocks = num_blocks
        first_layer = model.stage.first_layer
        # this pipeline stage's layers: (group, position) of each
        places = [layout.place(first_layer + i) for i in range(len(model.layers))]
        positions = sorted({position for _, position in places})
        self.state_groups = layout.state_groups  # groups of recurrent states: one page per request
        states_only = layout.attention_spec is None
        if states_only:  # (Mamba2: a pool block is a state page)
            pages = {position: RecurrentState(num_blocks, spec, dtype, device) for position in positions}
        else:
            pages = {position: zeroed(backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, width,
                                                             spec.planes), cache_dtype, device)
                     for position in positions}
        # the pages the connectors copy, block on dim 1: the K/V tensors (a hybrid's states live in their blocks), or
        # the state pages' bytes (swap preemption copies a Mamba2 request's states as it copies K/V)
        self.kv_pages = [pages[position].page if states_only else pages[position] for position in positions]
        # one per layer (layers share pages); a hybrid's recurrent layer keeps its states in the blocks of its
        # position's K/V tensor (layers/paged_state.py, core/kv_spec.py's budget rule)
        self.kv_caches = [PagedState(pages[position], layout.state_spec)
                          if group in self.state_groups and not states_only else pages[position]
                          for group, position in places]
        self.layer_groups = [group for group, _ in places]
        self.tier = None
        if tier_slots:
            self.tier = KVTierStore(backend.kv_cache_shape(tier_slots, block_size, spec.num_kv_heads, width,
                                                           spec.planes),
                                    len(self.kv_pages), cache_dtype, device, tier_folder)
        self.swap = None  # preempted requests' blocks (core/swap_space.py): the same store, in its own slots
        if swap_slots:
            slot_shape = ((1, swap_slots, self.kv_pages[0].shape[2]) if states_only else
                          backend.kv_cache_shape(swap_slots, block_size, spec.num_kv_heads, width, spec.planes))
            self.swap = KVTierStore(slot_shape, len(self.kv_pages), self.kv_pages[0].dtype, device, tier_folder)
        self.kv_connectors = worker_connectors(self.tier, self.swap)
        self.graphs = None  # DecodeGraphs, once use_decode_graphs is called
        self.mixed_graphs = None  # MixedGraphs, when use_decode_graphs is given a token budget
        self.step_graphed = False  # whether the last forward pass replayed (or, uncaptured, ran) a graph
        # a vision-language model's image embeddings and prompts given as embeddings (worker/encoder_cache.py), at
        # the stage that embeds
        vision = getattr(model, "vision", None)
        self.encoder_cache = (EncoderCache(vision, device, encoder_cache_tokens)
                              if vision is not None or prompt_embeds else None)
        self.mrope = getattr(getattr(model, "arch", None), "mrope_section", None) is not None
        self.encoder_failures: dict[str, Exception] = {}  # the step's requests whose image failed to encode
        self.inputs = StepInputs(block_size)
        self.uploads = PinnedCopies(device)  # the step's inputs, copied without waiting for the step running
        # a batch-invariant model's logprobs come from a log-softmax as invariant as its products (logprobs.py)
        choice = getattr(model, "kernel_choice", None)
        self.invariant_logprobs = choice is not None and choice.batch_invariant
        # every live request's row (tokens, block tables), from the step contract; sized at first by
        # max_num_seqs x max_model_len, grown past them
        self.input_batch = InputBatch(block_size, len(layout.groups), max_num_seqs, max_model_len)
        self.generators: dict[str, torch.Generator] = {}
        self.request_seed = request_seed  # a seeded request's seed -> its generator's seed
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        # request id -> (the step's sampled ids on the device, its row there): this step's and the previous
        # step's, whose ids fill the placeholder chunks (async scheduling, core/scheduler.py)
        self._sampled: dict[str, tuple[torch.Tensor, int]] = {}
        self._previous_sampled: dict[str, tuple[torch.Tensor, int]] = {}
        self._reads: list[HostRead] = []  # the step's host reads of its sampled ids and logprobs
        # an EAGLE-3 / MTP draft's store of the target's hidden states (spec_decode/hidden_states.py): given every
        # forward pass's final hidden states, and the ids of the requests that ended
        self.hidden_tap: Any = None
        self.logits_processors: list = []  # third-party ones (sampling/logits_processors.py), after the built-ins

    def release_kv_pool(self) -> int:
        """Give the KV pool's memory back to the OS (sleep): every block reads as zeros again, and costs memory only
        as it is written anew. Returns the bytes of the pool's tensors released (CPU pools; 0 elsewhere)."""
        from tokenmill.kernels.zeroed_memory import release

        return sum(page.untyped_storage().nbytes() for page in self.kv_pages if release(page))

    def execute(self, schedule: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and read its output on the host."""
        return self.execute_async(schedule).result()

    @torch.inference_mode()
    def execute_async(self, schedule: SchedulerOutput) -> PendingOutput:
        """Run one step without waiting for the device: its sampled ids stay there (the next step's
        placeholders read them there) and are copied to the host on the way, to be read when the returned
        output's `result` is asked for. Steps must be executed in order (placeholders are the previous
        step's ids)."""
        self._previous_sampled, self._sampled, self._reads = self._sampled, {}, []
        for request_id in schedule.finished_request_ids:
            self.generators.pop(request_id, None)
        if self.hidden_tap is not None:
            self.hidden_tap.drop(schedule.finished_request_ids)
        for adapter_id in schedule.lora_unloads:
            self.model.lora.unload(adapter_id)
        batch = self.input_batch.apply(schedule)
        # every connector's copies out of the pool, then into it (core/kv_connector.py)
        run_phase(self.kv_connectors, self.kv_pages, schedule.kv_copies, "out")
        run_phase(self.kv_connectors, self.kv_pages, schedule.kv_copies, "into")
        result = ModelRunnerOutput()
        if schedule.is_empty:
            return PendingOutput(result, [], [], None)
        adapter_failures = self._select_adapters(batch)
        encoder = self.encoder_cache
        before = (encoder.images_encoded, encoder.encode_seconds) if encoder is not None else None
        self.encoder_failures = {}
        try:
            self._run(schedule, batch, result)
        finally:
            if self.model.lora is not None:
                self.model.lora.set_step({}, 0, self.device)
            if self.state_groups:  # a verification's states not kept are the page's already
                for cache, group in zip(self.kv_caches, self.layer_groups):
                    if group in self.state_groups:
                        cache.candidates.clear()
        # their rows ran without the adapter, or without the image: drop them
        failures = [*adapter_failures.items(), *self.encoder_failures.items()]
        result.graphed = self.step_graphed
        if before is not None:
            result.encoder_images = encoder.images_encoded - before[0]
            result.encoder_seconds = encoder.encode_seconds - before[1]
        return PendingOutput(result, self._reads, failures, step_event(self.device) if self._reads else None)

    def _select_adapters(self, batch: list[BatchItem]) -> dict[str, Exception]:
        """Group the step's rows by LoRA adapter for the model, loading adapters on first use; returns the
        requests whose adapter could not be loaded (their rows run without it, and they fail)."""
        lora = self.model.lora
        failures: dict[str, Exception] = {}
        if lora is None:
            return failures
        rows: dict[int, list[int]] = {}
        start = 0
        for item in batch:
            adapter = item.sampling_params.lora_request
            if adapter is not None:
                try:
                    lora.load(adapter.lora_int_id, adapter.lora_path)
                    rows.setdefault(adapter.lora_int_id, []).extend(range(start, start + item.num_tokens))
                except (OSError, ValueError) as exc:
                    failures[item.request_id] = exc
            start += item.num_tokens
        lora.set_step(rows, start, self.device, self._tensor)
        return failures

    def _run(self, schedule: SchedulerOutput, batch: list[BatchItem], result: ModelRunnerOutput) -> None:
        """The step's forward pass, sampling and transfers, into `result`."""
        hidden, chunks = self.forward(batch)
        # blocks computed now, which no later step has written yet
        run_phase(self.kv_connectors, self.kv_pages, schedule.kv_copies, "after")
        if hidden is None:  # a pipeline stage before the last: its output went to the next stage
            return
        if self.hidden_tap is not None:
            self.hidden_tap.record(batch, chunks, hidden)
        rows, sample_rows, prompt_rows = self._logit_rows(batch, chunks)
        if rows:  # else every chunk is a partial prefill: nothing to sample or score yet
            logits = self.model.compute_logits(self._rows(hidden, rows))
            if logits is None:  # a tensor-parallel rank other than the driver: it samples nothing
                return
            step = _StepExtras(schedule.spec_probs, schedule.grammar)
            self._sample(batch, logits, sample_rows, step, result)
            self._prompt_logprobs(batch, logits, prompt_rows, result)

    def forward(self, batch: list[BatchItem]) -> tuple[torch.Tensor, list[SequenceChunk]]:
        """One forward pass over the batch's chunks (writing their K/V): final hidden states [T, hidden],
        and the chunks (with the tables of the first group this stage uses). A step replays its CUDA graph
        where one is captured (`step_graphed` says whether it did)."""
        chunks, slots, tables = {}, {}, {}
        decode = is_decode_step(batch)
        for group in dict.fromkeys(self.layer_groups):  # each group's tables, once
            if group in self.state_groups:
                chunks[group], slots[group], tables[group] = state_chunks(batch, group), None, None
                continue
            chunks[group], slots[group], tables[group] = self.inputs.group_chunks(batch, group, decode)
        first = chunks[self.layer_groups[0]]
        images = None
        if self.encoder_cache is not None:
            images, self.encoder_failures = self.encoder_cache.step_rows(batch)
        lora_active = self.model.lora is not None and self.model.lora.active
        # the graphs compute positions from the sequence index: not M-RoPE's, which images shift
        plain_positions = images is None and not self.mrope
        fill = lambda ids: self._fill_placeholders(ids, batch)  # noqa: E731
        self.step_graphed = True
        bucket = self.graphs.bucket_for(batch, lora_active) if self.graphs is not None and plain_positions else None
        if bucket is not None:
            return self.graphs.run(batch, bucket, chunks, slots, fill, tables), first
        ids, positions = self.inputs.ids_and_positions(batch, decode)
        mixed = self.mixed_graphs
        bucket = mixed.bucket_for(batch, lora_active) if mixed is not None and plain_positions else None
        if bucket is not None:
            return mixed.run(bucket, ids, positions, chunks, slots, fill, tables), first
        self.step_graphed = False
        if self.mrope:
            positions = mrope_positions(batch, positions)
        input_ids, positions = self._tensor(ids), self.uploads.upload(positions)
        self._fill_placeholders(input_ids, batch)
        metadata = {group: state_metadata(chunks[group], batch) if group in self.state_groups else
                    self.backend.build_metadata(chunks[group], slots[group], self.block_size, self.device,
                                                tables=tables[group])
                    for group in chunks}
        per_layer = [metadata[group] for group in self.layer_groups]
        if images is not None:
            return self.model(input_ids, positions, self.kv_caches, per_layer, image_embeds=images), first
        return self.model(input_ids, positions, self.kv_caches, per_layer), first

    def _fill_placeholders(self, input_ids: torch.Tensor, batch: list[BatchItem]) -> None:
        """Write each placeholder chunk's token into the flat `input_ids`, on the device: the id the previous
        step sampled for its request (0 where that sampling failed: the request ends, and this step's
        output for it is dropped)."""
        flat, picks, offset = [], [], 0
        for item in batch:
            if item.placeholder:
                flat.append(offset)
                picks.append(self._previous_sampled.get(item.request_id))
            offset += item.num_tokens
        if not flat:
            return
        sources = {id(pick[0]): pick[0] for pick in picks if pick is not None}
        if len(sources) == 1 and all(pick is not None for pick in picks):  # the usual case: one gather
            values = next(iter(sources.values()))[self._tensor([row for _, row in picks])]
        else:
            zero = torch.zeros((), dtype=torch.long, device=self.device)
            values = torch.stack([zero if pick is None else pick[0][pick[1]] for pick in picks])
        input_ids[self._tensor(flat)] = values.clamp(min=0)  # NO_TOKEN (a row that allowed none) is -1

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True,
                          max_num_tokens: int = 0, sizes: Optional[Sequence[int]] = None) -> None:
        """Run steps through CUDA graphs of the model: decode-only steps by batch size (worker/cuda_graphs.py)
        and, with `max_num_tokens` (a step's token budget), steps with prefill chunks or proposals by token
        count (worker/mixed_graphs.py), over one memory pool; `sizes` replaces both kinds' default buckets.
        `capture` False runs their padded static buffers eagerly (CPU tests). Needs the Triton backend."""
        from tokenmill.worker.cuda_graphs import BUCKETS, LARGE_BUCKETS, DecodeGraphs
        from tokenmill.worker.mixed_graphs import MixedGraphs

        width = -(-max_model_len // self.block_size)
        pool = None
        if max_num_tokens:  # the larger graphs first: the decode graphs fit in their pool
            self.mixed_graphs = MixedGraphs(self.model, self.kv_caches, self.layer_groups, max_num_seqs,
                                            max_num_tokens, width, self.device, capture,
                                            sizes or BUCKETS + LARGE_BUCKETS)
            pool = self.mixed_graphs.static.pool
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.layer_groups, max_num_seqs, width, self.device,
                                   capture, sizes or BUCKETS, pool)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """int64 `values` on the device, copied without waiting for it (attention/host_copies.py)."""
        return self.uploads.indices(values)

    @staticmethod
    def _logit_rows(batch: list[BatchItem], chunks: list[SequenceChunk]):
        """Which hidden rows need logits: the last of each sampling chunk (its last 1 + proposals, when it
        carries speculative proposals), and every prompt row asked for.

        Returns (hidden row indices, {batch index: first logits row to sample from},
        {batch index: (first logits row, count)}).
        """
        rows: list[int] = []
        sample_rows: dict[int, int] = {}
        prompt_rows: dict[int, tuple[int, int]] = {}
        for i, (item, chunk) in enumerate(zip(batch, chunks)):
            if item.wants_prompt_logprobs:
                last_scored = min(item.start + item.num_tokens, len(item.prompt_token_ids) - 1)
                count = max(0, last_scored - item.start)
                prompt_rows[i] = (len(rows), count)
                rows.extend(range(chunk.query_start, chunk.query_start + count))
            if item.sample:
                sample_rows[i] = len(rows)
                end = chunk.query_start + chunk.query_len
                rows.extend(range(end - 1 - len(item.spec_token_ids), end))
        return rows, sample_rows, prompt_rows

    def _rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """x[rows]; x itself when rows are all of x's rows in order (a decode step), with no copy."""
        if rows == list(range(x.shape[0])):
            return x
        return x[self._tensor(rows)]

    def generator_for(self, item: BatchItem) -> Optional[torch.Generator]:
        """A seeded request's own generator (created at its first use), None for an unseeded one."""
        seed = item.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(item.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(self.request_seed(seed))
            self.generators[item.request_id] = gen
        return gen

    def sampling_row(self, item: BatchItem) -> SamplingRow:
        """What sampling needs of `item`: its controls, generator and tokens so far."""
        return SamplingRow(item.sampling_params, self.generator_for(item), item.prompt_token_ids,
                           item.output_token_ids, self.eos_token_ids)

    def _sample(self, batch, logits: torch.Tensor, sample_rows: dict[int, int], step: "_StepExtras",
                result: ModelRunnerOutput) -> None:
        """Sample (or verify proposals for) every sampling chunk. A request whose own work raises ends
        with an error (`result.failed`) and the others still get their tokens: a failed batch call is
        redone one request at a time, which for greedy and seeded rows picks the same tokens (a seeded
        row draws only from its own generator)."""
        plain = [i for i in sample_rows if not batch[i].spec_token_ids]
        speculative = [i for i in sample_rows if batch[i].spec_token_ids]
        for run, group in ((self._sample_plain, plain), (self._verify, speculative)):
            if not group:
                continue
            try:
                run(batch, logits, sample_rows, group, step, result)
            except Exception:
                for i in group:
                    try:
                        run(batch, logits, sample_rows, [i], step, result)
                    except Exception as exc:
                        fail_request(result, batch[i].request_id, exc)

    def _sample_plain(self, batch, logits: torch.Tensor, sample_rows: dict[int, int], plain: list[int],
                      step: "_StepExtras", result: ModelRunnerOutput) -> None:
        sample_logits = self._rows(logits, [sample_rows[i] for i in plain])
        constrained = self._masked(sample_logits, step.grammar, [(k, batch[i]) for k, i in enumerate(plain)])
        tokens = sample(constrained, [self.sampling_row(batch[i]) for i in plain], self.default_generator,
                        self.logits_processors)
        request_ids = [batch[i].request_id for i in plain]
        self._sampled.update((request_id, (tokens, k)) for k, request_id in enumerate(request_ids))
        wanted = [k for k, i in enumerate(plain) if batch[i].sampling_params.logprobs is not None]
        figures = None
        if wanted:
            picked = self._tensor(wanted)
            figures = logprob_tensors(sample_logits[picked], tokens[picked].clamp(min=0),
                                      max(batch[plain[k]].sampling_params.logprobs for k in wanted),
                                      self.invariant_logprobs)
        self._reads.append(_PlainSamples(request_ids, wanted, [batch[plain[k]].sampling_params.logprobs
                                                               for k in wanted], to_host(tokens), to_host(figures)
                                         if figures is not None else None))

    def _verify(self, batch, logits: torch.Tensor, sample_rows: dict[int, int], speculative: list[int],
                step: "_StepExtras", result: ModelRunnerOutput) -> None:
        """Accept or reject each request's proposals (rows sample_rows[i] .. + len(proposals))."""
        proposals = []
        for i in speculative:
            item = batch[i]
            q = step.spec_probs.get(item.request_id)
            proposals.append(Proposal(item.spec_token_ids, sample_rows[i], self.sampling_row(item),
                                      None if q is None else q[:len(item.spec_token_ids)].to(self.device)))
        constrained = self._masked(logits, step.grammar, [(sample_rows[i], batch[i]) for i in speculative])
        verified = verify(constrained, proposals, self.default_generator)
        for i, tokens in zip(speculative, verified):
            item = batch[i]
            if item.sampling_params.logprobs is not None:
                first = sample_rows[i]
                result.logprobs[item.request_id] = token_logprobs(
                    logits[first:first + len(tokens)], torch.tensor(tokens, device=self.device),
                    [item.sampling_params.logprobs] * len(tokens), self.invariant_logprobs)
        for i, tokens in zip(speculative, verified):
            result.sampled_token_ids[batch[i].request_id] = tokens
            if len(tokens) <= len(batch[i].spec_token_ids):  # a proposal was rejected
                self._keep_states(batch[i], len(tokens) - 1)

    def _keep_states(self, item: BatchItem, accepted: int) -> None:
        """Leave `item`'s recurrent states (every state layer's) where they were after `accepted` of its proposals:
        the layers stored the state after all of them (layers/mamba2_mixer.py's advance_request)."""
        for cache, group in zip(self.kv_caches, self.layer_groups):
            if group in self.state_groups:
                cache.candidates.keep(int(item.block_ids[group][0]), accepted, cache.store)

    @staticmethod
    def _masked(logits: torch.Tensor, grammar: Optional[GrammarMasks],
                rows: list[tuple[int, BatchItem]]) -> torch.Tensor:
        """`logits` with the step's grammar masks of the constrained requests among (first row, item)
        applied (to a copy: log-probabilities stay those of the model), or `logits` itself."""
        wanted = [(row, item.request_id) for row, item in rows if item.sampling_params.structured_output is not None]
        if not wanted:
            return logits
        if grammar is None:
            raise RuntimeError("a constrained request reached the runner without its grammar masks")
        from tokenmill.structured.matchers import apply_masks

        masked = logits.clone()
        apply_masks(masked, grammar, wanted)
        return masked

    def _prompt_logprobs(self, batch, logits: torch.Tensor, prompt_rows: dict[int, tuple[int, int]],
                         result: ModelRunnerOutput) -> None:
        for i, (first, count) in prompt_rows.items():
            item = batch[i]
            if count == 0:
                result.prompt_logprobs[item.request_id] = []
                continue
            targets = item.prompt_token_ids[item.start + 1:item.start + 1 + count]
            try:
                entries = token_logprobs(logits[first:first + count],
                                         torch.tensor(targets, device=self.device),
                                         [item.sampling_params.prompt_logprobs] * count, self.invariant_logprobs)
            except Exception as exc:
                fail_request(result, item.request_id, exc)
                continue
            result.prompt_logprobs[item.request_id] = entries


def state_chunks(batch: list[BatchItem], group: int) -> list[SequenceChunk]:
    """The batch's chunks over a recurrent-state group's tables (one page each: no slots per token)."""
    chunks, query_start = [], 0
    for item in batch:
        chunks.append(SequenceChunk(query_start, item.num_tokens, item.start + item.num_tokens, item.block_ids[group],
                                    False))
        query_start += item.num_tokens
    return chunks


def state_metadata(chunks: list[SequenceChunk], batch: list[BatchItem]) -> list[StateChunk]:
    """What a Mamba2 mixer reads of the step (layers/mamba2_mixer.py): each request's rows, its state page,
    whether its chunk starts the sequence (then its state starts at zero: a new or recomputed request), and how
    many of its rows are proposals to verify (`chunks` are the batch's, in its order: state_chunks)."""
    return [StateChunk(c.query_start, c.query_len, int(c.block_ids[0]), c.context_len == c.query_len,
                       tuple(int(b) for b in c.block_ids), len(item.spec_token_ids)) for c, item in zip(chunks, batch)]


def kv_cache_storage(layout: KVCacheLayout, dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(element dtype, row width) of the cache's rows: the compute dtype and head_dim, or a one-byte cache's
    rows of head_dim values and their scale's 4 bytes (attention/kv_quant.py: int8, or fp8 in uint8)."""
    spec = layout.attention_spec or layout.groups[0].spec
    return (STORAGE[spec.quantized], row_width(spec.head_dim)) if spec.quantized else (dtype, spec.head_dim)


class _StepExtras(NamedTuple):
    spec_probs: dict[str, torch.Tensor]
    grammar: Optional[GrammarMasks]


class _PlainSamples:
    """The host read of a group of plain rows' sampled ids and logprobs (copied with `to_host`)."""

    def __init__(self, request_ids: list[str], wanted: list[int], num_top: list[int], tokens: torch.Tensor,
                 figures: Optional[tuple]) -> None:
        self.request_ids, self.wanted, self.num_top = request_ids, wanted, num_top
        self.tokens, self.figures = tokens, figures

    def __call__(self, result: ModelRunnerOutput) -> None:
        picked_ids = self.tokens.tolist()
        entries = logprob_entries(self.figures, self.num_top) if self.figures is not None else []
        for k, entry in zip(self.wanted, entries):
            if picked_ids[k] != NO_TOKEN:
                result.logprobs[self.request_ids[k]] = [entry]
        for request_id, token in zip(self.request_ids, picked_ids):
            if token == NO_TOKEN:  # sampled on a GPU, which marks the row instead of raising
                fail_request(result, request_id, ValueError(f"no token is allowed: {NOTHING_ALLOWED}"))
                continue
            result.sampled_token_ids[request_id] = [token]
