"""The default executor: the one rank runs in the engine's own process, with no copy of the step."""

from __future__ import annotations

from collections import deque
from typing import Optional

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.models.loader import ModelSource
from tokenmill.worker.pending_output import PendingOutput
from tokenmill.worker.worker import Worker, WorkerSpec


class InProcessExecutor(Executor):
    """Calls its worker directly: the step is handed over by reference, and issued to the device at once.

    With async scheduling the engine submits step n+1 before it collects step n: the device runs them in
    order, and collecting n waits only for n (its pending output's event)."""

    steps_ahead = 1  # steps that may be submitted beyond the one collected next (async scheduling)

    def __init__(self, spec: WorkerSpec, source: Optional[ModelSource] = None) -> None:
        self.worker = Worker(spec, source)
        self.description = self.worker.description
        self.num_blocks = self.worker.num_blocks
        self._outputs: deque[PendingOutput] = deque()

    def submit(self, schedule: SchedulerOutput) -> None:
        """Issue the step now, in this process; its output waits to be collected."""
        if len(self._outputs) > self.steps_ahead:
            raise RuntimeError("a step was submitted with two uncollected before it")
        self._outputs.append(self.worker.execute_async(schedule))

    def collect(self) -> ModelRunnerOutput:
        """The oldest uncollected step's output (waiting for the device where it has not finished it)."""
        return self._outputs.popleft().result()

    def call(self, name: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """The one worker's Worker.control."""
        return [self.worker.control(name, tuple(args), dict(kwargs or {}))]
