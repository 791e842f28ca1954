"""The executor interface: one step in, the last rank's output back; a dead rank is reported, never waited on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tokenmill.config import ParallelConfig
    from tokenmill.models.loader import ModelSource
    from tokenmill.worker.worker import WorkerSpec


class ExecutorDiedError(RuntimeError):
    """A worker process exited: the executor cannot run another step."""


class WorkerStepError(RuntimeError):
    """A step raised inside a worker process (which is still alive); the message carries its traceback."""


class Executor(ABC):
    """Runs steps on the model's ranks. `description` says what was loaded (dtype, attention, weights)."""

    description: str

    @abstractmethod
    def execute(self, schedule: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the output of the rank that samples."""

    def failure(self) -> Optional[str]:
        """Why the executor can no longer run steps (a worker died), or None while it can."""
        return None

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""


def make_executor(spec: "WorkerSpec", parallel: "ParallelConfig", source: Optional["ModelSource"] = None) -> Executor:
    """The executor `parallel.backend` names, its ranks built from `spec` (`source`, when given, is the
    engine's already opened checkpoint, which the in-process executor reuses)."""
    if parallel.backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec)
    from tokenmill.executor.in_process import InProcessExecutor

    return InProcessExecutor(spec, source)
