"""The executor interface: one step in, the last rank's output back; a dead rank is reported, never waited on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class ExecutorDiedError(RuntimeError):
    """A worker process exited: the executor cannot run another step."""


class WorkerStepError(RuntimeError):
    """A step raised inside a worker process (which is still alive); the message carries its traceback."""


class Executor(ABC):
    """Runs steps on the model's ranks. `description` says what was loaded (dtype, attention, weights).

    Steps are submitted and collected in order. Up to `max_steps_in_flight` may be submitted before the
    oldest is collected: more than one only where the ranks form pipeline stages, so that stage s can
    run a step while stage s + 1 runs the one before it.
    """

    description: str
    num_blocks: int  # KV blocks every rank's pool holds (sized by the ranks themselves when asked)
    max_steps_in_flight: int = 1

    @abstractmethod
    def submit(self, schedule: SchedulerOutput) -> None:
        """Start a step on every rank; its output comes from `collect`."""

    @abstractmethod
    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step not yet collected (from the rank that samples)."""

    def execute(self, schedule: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step with none other in flight; the output of the rank that samples."""
        self.submit(schedule)
        return self.collect()

    @abstractmethod
    def call(self, name: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """Worker.control(`name`, ...) on every rank between steps (none in flight), each rank's result in rank
        order; ValueError with a rank's own message when it refuses."""

    def failure(self) -> Optional[str]:
        """Why the executor can no longer run steps (a worker died), or None while it can."""
        return None

    def replacement_refused(self) -> Optional[str]:
        """Why this executor's ranks cannot be replaced by a new group after a failure (LLMEngine.replace_workers),
        or None when they can."""
        return "the model runs in the engine's process: there is no worker group to replace"

    def shutdown(self, grace: Optional[float] = None) -> None:
        """Stop every worker (idempotent); `grace`: how long each may take to stop by itself (None: the
        executor's default)."""
