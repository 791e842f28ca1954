"""CUDA graphs for decode-only steps: the model's forward captured once per batch-size bucket over static
input buffers, then replayed with the step's inputs copied in (steps with prefill chunks or proposals:
worker/mixed_graphs.py).

A step of n decode rows runs in the smallest bucket b >= n. Rows n..b-1 are padding: token 0 at
position 0, slot -1 (the KV write skips it) and context length 0 (attention writes zeros), so they
touch no cache block and their outputs are dropped. Sampling stays outside the graph. Steps with
prefill or speculative proposals take the mixed graphs; steps with LoRA adapters, or more rows than the
largest bucket, run eagerly.

`capture=False` runs the same padded static-buffer path without capturing: on CPU (the Triton kernels
interpreted) it checks that a padded bucket computes what the unpadded eager step does.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from tokenmill.attention.base import SequenceChunk
from tokenmill.attention.triton_paged import TritonMetadata, decode_splits, host_metadata
from tokenmill.attention.host_copies import PinnedCopies
from tokenmill.worker.request_state import BatchItem

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# the token counts of the mixed steps' graphs past the decode buckets (--cuda-graph-sizes replaces both)
LARGE_BUCKETS = (384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def bucket_sizes(limit: int, sizes: Sequence[int] = BUCKETS) -> list[int]:
    """The buckets of `sizes` captured for steps of up to `limit` rows or tokens: every size below it, then
    the first that holds it (the largest size when none does: larger steps run eagerly)."""
    sizes = sorted(set(sizes))
    below = [b for b in sizes if b < limit]
    return below + [next((b for b in sizes if b >= limit), sizes[-1])]


def capture_graphs(sizes: Sequence[int], forward: Callable[[int], torch.Tensor], device: torch.device,
                   pool: Any = None) -> tuple[dict[int, Any], dict[int, torch.Tensor], Any]:
    """One CUDA graph of `forward(size)` per size, largest first, into one memory pool (`pool`, or a new one);
    each size runs once eagerly first, which compiles the kernels for its shapes. Returns (graphs, their
    static outputs, the pool)."""
    graphs, outputs = {}, {}
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            forward(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = forward(size)
            pool = graph.pool() if pool is None else pool
            graphs[size] = graph
    torch.cuda.synchronize(device)
    return graphs, outputs, pool


class StaticGraphs:
    """What both graph kinds own: static token ids and positions for `rows` tokens, the pinned copies that
    fill a step's buffers, and one captured graph of `forward(bucket)` per bucket, in a memory pool the
    kinds share (with `capture` off, the padded static buffers run eagerly: CPU tests)."""

    def __init__(self, rows: int, device: torch.device, capture: bool,
                 forward: Callable[[int], torch.Tensor]) -> None:
        self.device, self.capture, self.forward = device, capture, forward
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.staging = PinnedCopies(device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None

    def capture_all(self, sizes: Sequence[int], pool: Any, what: str) -> None:
        """Capture a graph per size into `pool` (a new one when None), when capturing; log `what` was."""
        self.pool = pool
        if self.capture:
            started = time.perf_counter()
            self.graphs, self.outputs, self.pool = capture_graphs(sizes, self.forward, self.device, pool)
            logger.info("CUDA graphs captured for %s %s in %.1fs", what, ", ".join(map(str, sizes)),
                        time.perf_counter() - started)

    def run(self, bucket: int, ids: np.ndarray, positions: np.ndarray,
            buffers: list[tuple[torch.Tensor, np.ndarray]], fill_ids: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """The first len(ids) rows of bucket `bucket`'s output: the step's ids and positions, then its other
        `buffers` (device tensor, host array) copied in, the padding rows' ids and positions zeroed and the
        device-side ids written (`fill_ids`), then the graph replayed."""
        n = len(ids)
        self.staging.copy([(self.input_ids[:n], ids), (self.positions[:n], positions), *buffers])
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        fill_ids(self.input_ids[:n])
        if self.capture:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self.forward(bucket)[:n]


def padded_slots(slots: torch.Tensor, bucket: int) -> np.ndarray:
    """The step's host `slots` followed by -1 (no KV write) up to `bucket` entries."""
    padded = np.full(bucket, -1, dtype=np.int32)
    padded[:len(slots)] = slots.numpy()
    return padded


class DecodeGraphs:
    """Static buffers and one graph per bucket; `run` replays the step's bucket (see module docstring).

    `kv_caches` and `layer_groups` are the runner's (one cache and KV group per layer); `width` block
    table entries per row cover max_model_len."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], layer_groups: list[int], max_num_seqs: int,
                 width: int, device: torch.device, capture: bool = True, sizes: Sequence[int] = BUCKETS,
                 pool: Any = None) -> None:
        self.model, self.kv_caches, self.layer_groups = model, kv_caches, layer_groups
        self.sizes = bucket_sizes(max_num_seqs, sizes)
        rows = self.sizes[-1]
        groups = sorted(set(layer_groups))
        self.static = StaticGraphs(rows, device, capture, self._forward)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one query per row
        self.seq_lens = {g: torch.zeros(rows, dtype=torch.int32, device=device) for g in groups}
        self.slots = {g: torch.full((rows,), -1, dtype=torch.int32, device=device) for g in groups}
        self.tables = {g: torch.zeros(rows, max(width, 1), dtype=torch.int32, device=device) for g in groups}
        self.static.capture_all(self.sizes, pool, "decode batch sizes (--enforce-eager turns them off)")

    def bucket_for(self, batch: list[BatchItem], lora_active: bool) -> Optional[int]:
        """The bucket of a decode-only step that fits, else None (the step runs eagerly)."""
        if lora_active or not batch or len(batch) > self.sizes[-1]:
            return None
        if any(item.num_tokens != 1 or item.spec_token_ids for item in batch):
            return None
        return next(b for b in self.sizes if b >= len(batch))

    def run(self, batch: list[BatchItem], bucket: int, chunks: dict[int, list[SequenceChunk]],
            slots: dict[int, torch.Tensor], fill_ids: Callable[[torch.Tensor], None],
            tables: Optional[dict[int, Optional[np.ndarray]]] = None) -> torch.Tensor:
        """Hidden states [len(batch), hidden] of a decode-only step: `chunks`, host `slots` and the step's
        block tables (None: gathered from the chunks) per KV group; `fill_ids` writes the device-side ids
        (placeholders) into the step's input ids."""
        n = len(batch)
        buffers = []
        for group, group_chunks in chunks.items():
            lens = np.zeros(bucket, dtype=np.int32)
            table = np.zeros((bucket, self.tables[group].shape[1]), dtype=np.int32)
            _, lens[:n], table[:n] = host_metadata(group_chunks, self.kv_caches[0].shape[3], table.shape[1],
                                                   (tables or {}).get(group))
            buffers += [(self.seq_lens[group][:bucket], lens), (self.tables[group][:bucket], table),
                        (self.slots[group][:bucket], padded_slots(slots[group], bucket))]
        return self.static.run(bucket, np.fromiter((item.token_ids[0] for item in batch), np.int64, n),
                               np.fromiter((item.start for item in batch), np.int64, n), buffers, fill_ids)

    def _metadata(self, bucket: int, group: int) -> TritonMetadata:
        return TritonMetadata(self.query_start[:bucket + 1], self.seq_lens[group][:bucket],
                              self.tables[group][:bucket], self.slots[group][:bucket], bucket, bucket, 1, 0,
                              graph_splits=decode_splits(bucket, self.kv_caches[0].shape[2]))

    def _forward(self, bucket: int) -> torch.Tensor:
        metadata = {g: self._metadata(bucket, g) for g in self.seq_lens}
        return self.model(self.static.input_ids[:bucket], self.static.positions[:bucket], self.kv_caches,
                          [metadata[g] for g in self.layer_groups])
