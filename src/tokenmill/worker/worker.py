"""A worker: one rank's device, model (its shard) and KV pool, built from a plain-data spec."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.config import ModelConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.models.loader import ModelSource, load_model_source
from tokenmill.worker.model_runner import ModelRunner

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
    rank: int = 0
    world_size: int = 1


class Worker:
    """Loads its model and KV pool, then runs steps: `execute(SchedulerOutput) -> ModelRunnerOutput`."""

    def __init__(self, spec: WorkerSpec, source: Optional[ModelSource] = None) -> None:
        from tokenmill.engine.model_setup import load_model

        self.spec = spec
        self.device = torch.device(spec.device)
        dtype = DTYPES[spec.dtype]
        source = source or load_model_source(spec.model_path, with_tokenizer=False)
        arch = source.arch
        self.model, backend = load_model(source, spec.model, self.device, dtype, spec.max_model_len)
        self.runner = ModelRunner(self.model, backend, spec.num_blocks, spec.block_size, arch.num_key_value_heads,
                                  arch.head_dim, dtype, self.device, spec.eos_token_ids, spec.model.seed,
                                  spec.tier_slots, spec.tier_folder)
        self.description = (f"{dtype}, {type(backend).__name__} attention; {self.model.describe_weights()}")

    def execute(self, schedule: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on this rank."""
        return self.runner.execute(schedule)
