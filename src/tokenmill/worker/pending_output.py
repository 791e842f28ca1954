"""A step's output while the device may still be computing it: what the host reads of it is copied on the way
and read only when asked for (async scheduling overlaps that wait with building the next step)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from tokenmill.core.sched_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

# fills a step's output from host copies of its device tensors
HostRead = Callable[[ModelRunnerOutput], None]


def fail_request(result: ModelRunnerOutput, request_id: str, exc: Exception) -> None:
    """Mark `request_id` failed in `result`, and say so in the log."""
    logger.warning("request %s failed in the step: %s: %s", request_id, type(exc).__name__, exc)
    result.fail(request_id, exc)


def to_host(tensors: Any) -> Any:
    """A host copy of a tensor (or a tuple of them) started now: on CUDA into pinned memory without waiting
    (read it only after the step's event), elsewhere the tensor itself."""
    if isinstance(tensors, tuple):
        return tuple(to_host(t) for t in tensors)
    return tensors.to("cpu", non_blocking=True) if tensors.device.type == "cuda" else tensors


class PendingOutput:
    """One step's output: filled by its host reads once the device has reached the step's end (`event`),
    then its failures applied (a failed request keeps no tokens).

    Invariant: every tensor a read touches was copied with `to_host` before `event` was recorded."""

    def __init__(self, result: ModelRunnerOutput, reads: list[HostRead],
                 failures: list[tuple[str, Exception]], event: Optional[Any]) -> None:
        self._result, self._reads, self._failures, self._event = result, reads, failures, event

    def result(self) -> ModelRunnerOutput:
        """The output, waiting for the device where it has not finished the step."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        for read in self._reads:
            read(self._result)
        for request_id, exc in self._failures:
            fail_request(self._result, request_id, exc)
        self._reads, self._failures = [], []
        return self._result


def step_event(device: torch.device) -> Optional[Any]:
    """An event recorded now on `device`'s current stream (None off CUDA, where work is done when issued)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
