"""Executors: where the model runs — in the engine's process, or in one worker process per rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tokenmill.executor.base import Executor, ExecutorDiedError, WorkerStepError

if TYPE_CHECKING:
    from tokenmill.config import ParallelConfig
    from tokenmill.models.loader import ModelSource
    from tokenmill.worker.worker import WorkerSpec

__all__ = ["Executor", "ExecutorDiedError", "WorkerStepError", "make_executor"]


def make_executor(spec: "WorkerSpec", parallel: "ParallelConfig", source: Optional["ModelSource"] = None) -> Executor:
    """The executor `parallel.backend` names, its ranks built from `spec` (`source`, when given, is the
    engine's already opened checkpoint, which the in-process executor reuses)."""
    if parallel.backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec, parallel)
    from tokenmill.executor.in_process import InProcessExecutor

    return InProcessExecutor(spec, source)
