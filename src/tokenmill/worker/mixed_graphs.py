"""CUDA graphs for steps with prefill chunks or speculative proposals: the model's forward captured once per
token-count bucket over static buffers for up to `max_num_seqs` sequences, then replayed with the step's
inputs copied in (decode-only steps: worker/cuda_graphs.py).

A step of T tokens in S sequences runs in the smallest bucket b >= T, over max_num_seqs + 1 sequence slots:

    sequences  0 .. S-1            the step's chunks, as the eager step lays them out
    sequence   S                   the padding tokens T .. b-1: token 0 at position 0, slot -1 (the KV write
                                   skips them), context length 0 (attention writes zeros)
    sequences  S+1 .. max_num_seqs  empty (no queries)

The unified attention kernel's grid depends only on b and the number of sequence slots, so one graph serves
every step of its bucket. Every query runs on the unified kernel: the metadata's max_query_len 0 rules out
the split-KV decode and the wide prefill tiling, and the unified kernel computes a row the same way
whatever else shares the step, so a graphed step gives the eager step's values. Steps with LoRA adapters
or images, steps of more tokens than the largest bucket or more sequences than max_num_seqs run eagerly.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from tokenmill.attention.base import SequenceChunk
from tokenmill.attention.triton_paged import TritonMetadata, host_metadata
from tokenmill.worker.cuda_graphs import BUCKETS, LARGE_BUCKETS, StaticGraphs, bucket_sizes, padded_slots
from tokenmill.worker.request_state import BatchItem


class MixedGraphs:
    """Static buffers and one graph per token-count bucket; `run` replays the step's bucket (see the module
    docstring). `kv_caches` and `layer_groups` are the runner's; `width` block-table entries cover
    max_model_len."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], layer_groups: list[int], max_num_seqs: int,
                 max_num_tokens: int, width: int, device: torch.device, capture: bool = True,
                 sizes: Sequence[int] = BUCKETS + LARGE_BUCKETS, pool: Any = None) -> None:
        self.model, self.kv_caches, self.layer_groups = model, kv_caches, layer_groups
        self.sizes = bucket_sizes(max_num_tokens, sizes)
        self.max_num_seqs = max_num_seqs
        tokens, seqs = self.sizes[-1], max_num_seqs + 1
        groups = sorted(set(layer_groups))
        self.static = StaticGraphs(tokens, device, capture, self._forward)
        self.query_start = {g: torch.zeros(seqs + 1, dtype=torch.int32, device=device) for g in groups}
        self.seq_lens = {g: torch.zeros(seqs, dtype=torch.int32, device=device) for g in groups}
        self.tables = {g: torch.zeros(seqs, max(width, 1), dtype=torch.int32, device=device) for g in groups}
        self.slots = {g: torch.full((tokens,), -1, dtype=torch.int32, device=device) for g in groups}
        self.static.capture_all(self.sizes, pool, "steps with prefill or proposals of token counts")

    def bucket_for(self, batch: list[BatchItem], lora_active: bool) -> Optional[int]:
        """The token bucket of a step that fits, else None (the step runs eagerly)."""
        if lora_active or not batch or len(batch) > self.max_num_seqs:
            return None
        tokens = sum(item.num_tokens for item in batch)
        return next((b for b in self.sizes if b >= tokens), None)

    def run(self, bucket: int, ids: list[int], positions: np.ndarray, chunks: dict[int, list[SequenceChunk]],
            slots: dict[int, torch.Tensor], fill_ids: Callable[[torch.Tensor], None],
            tables: Optional[dict[int, Optional[np.ndarray]]] = None) -> torch.Tensor:
        """Hidden states [T, hidden] of a step of T tokens (`ids` at `positions`, flat): `chunks`, host `slots`
        and the step's block tables (None: gathered from the chunks) per KV group; `fill_ids` writes the
        device-side ids (placeholders) into the input ids."""
        seqs = self.max_num_seqs + 1
        buffers = []
        for group, group_chunks in chunks.items():
            starts = np.full(seqs + 1, bucket, dtype=np.int32)
            lens = np.zeros(seqs, dtype=np.int32)
            table = np.zeros((seqs, self.tables[group].shape[1]), dtype=np.int32)
            count = len(group_chunks)
            starts[:count + 1], lens[:count], table[:count] = host_metadata(
                group_chunks, self.kv_caches[0].shape[3], table.shape[1], (tables or {}).get(group))
            buffers += [(self.query_start[group], starts), (self.seq_lens[group], lens), (self.tables[group], table),
                        (self.slots[group][:bucket], padded_slots(slots[group], bucket))]
        return self.static.run(bucket, np.asarray(ids, dtype=np.int64), positions, buffers, fill_ids)

    def _metadata(self, bucket: int, group: int) -> TritonMetadata:
        seqs = self.max_num_seqs + 1
        return TritonMetadata(self.query_start[group], self.seq_lens[group], self.tables[group],
                              self.slots[group][:bucket], seqs, bucket, 0, 0)

    def _forward(self, bucket: int) -> torch.Tensor:
        metadata = {g: self._metadata(bucket, g) for g in self.seq_lens}
        return self.model(self.static.input_ids[:bucket], self.static.positions[:bucket], self.kv_caches,
                          [metadata[g] for g in self.layer_groups])
