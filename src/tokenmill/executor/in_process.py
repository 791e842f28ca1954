"""The default executor: the one rank runs in the engine's own process, with no copy of the step."""

from __future__ import annotations

from collections import deque
from typing import Optional

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.models.loader import ModelSource
from tokenmill.worker.worker import Worker, WorkerSpec


class InProcessExecutor(Executor):
    """Calls its worker directly: the step is handed over by reference."""

    def __init__(self, spec: WorkerSpec, source: Optional[ModelSource] = None) -> None:
        self.worker = Worker(spec, source)
        self.description = self.worker.description
        self.num_blocks = self.worker.num_blocks
        self._outputs: deque[ModelRunnerOutput] = deque(maxlen=self.max_steps_in_flight)

    def submit(self, schedule: SchedulerOutput) -> None:
        """Run the step now, in this process (one rank: nothing to overlap)."""
        if len(self._outputs) >= self.max_steps_in_flight:
            raise RuntimeError("a step was submitted before the previous one was collected")
        self._outputs.append(self.worker.execute(schedule))

    def collect(self) -> ModelRunnerOutput:
        """The step's output."""
        return self._outputs.popleft()
