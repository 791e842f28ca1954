"""Continuous batching for embedding requests: one thread encodes steps of whole sequences.

A request is a list of inputs (token-id sequences). Waiting inputs join the next step in arrival order
while the step has room (`max_num_batched_tokens`, `max_num_seqs`); a request is answered when its
last input is encoded, so a large request's inputs spread over steps that others' inputs share.
The queue is bounded: past `max_waiting_sequences` inputs, `embed` raises QueueFullError (HTTP 429).
A step that fails is run again one request at a time, so only the request that fails gets the error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.engine.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from tokenmill.pooling.model import EmbeddingModel

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    sequences: list[list[int]]
    dimensions: Optional[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)
    vectors: list[Optional[torch.Tensor]] = field(default_factory=list)
    next_input: int = 0  # inputs before this one are in a step already
    done: int = 0
    failed: bool = False

    def settle(self, result: object = None, error: Optional[BaseException] = None) -> None:
        def apply() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)
        self.loop.call_soon_threadsafe(apply)


@dataclass(frozen=True)
class PoolingStats:
    """Totals since start, and the current queue."""

    requests: int
    prompt_tokens: int
    steps: int
    waiting_sequences: int
    rejected: int


class PoolingEngine:
    """Encodes requests' inputs in shared steps on a background thread; `await embed(...)` from asyncio."""

    def __init__(self, model: EmbeddingModel, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 max_waiting_sequences: int = 4096) -> None:
        if max_num_batched_tokens < model.max_model_len:
            max_num_batched_tokens = model.max_model_len  # a step must fit the longest input
        self.model = model
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_waiting_sequences = max_waiting_sequences
        self._jobs: deque[_Job] = deque()
        self._waiting = 0  # inputs not yet in a step
        self._wake = threading.Condition()
        self._stopped = False
        self._closing = False  # no new requests; the queued ones still run
        self._requests = self._prompt_tokens = self._steps = self._rejected = 0
        self._thread = threading.Thread(target=self._loop, name="tokenmill-pooling", daemon=True)
        self._thread.start()

    async def embed(self, sequences: list[list[int]], dimensions: Optional[int] = None) -> list[torch.Tensor]:
        """The vectors of `sequences` (checked with `model.check_tokens` first), in order."""
        for tokens in sequences:
            self.model.check_tokens(tokens)
        self.model.check_dimensions(dimensions)
        loop = asyncio.get_running_loop()
        job = _Job(sequences, dimensions, loop, loop.create_future(), vectors=[None] * len(sequences))
        with self._wake:
            if self._stopped or self._closing:
                raise EngineDeadError("the server is shutting down")
            if self._waiting + len(sequences) > self.max_waiting_sequences:
                self._rejected += 1
                raise QueueFullError(f"the server has {self._waiting} inputs waiting (limit "
                                     f"{self.max_waiting_sequences}); retry later")
            self._jobs.append(job)
            self._waiting += len(sequences)
            self._wake.notify()
        return await job.future

    def stats(self) -> PoolingStats:
        """Counters and queue length now."""
        with self._wake:
            return PoolingStats(self._requests, self._prompt_tokens, self._steps, self._waiting, self._rejected)

    def stop_accepting(self) -> None:
        """Refuse new requests (EngineDeadError, HTTP 503); those queued still get their vectors."""
        with self._wake:
            self._closing = True

    def shutdown(self) -> None:
        """Stop the thread; waiting requests fail with EngineDeadError."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _take_step(self) -> list[tuple[_Job, int]]:
        """(job, input index) pairs for the next step, in arrival order, within the step's limits."""
        taken: list[tuple[_Job, int]] = []
        tokens = 0
        for job in [j for j in self._jobs if j.future.cancelled()]:  # its client went away: drop what is left
            self._waiting -= len(job.sequences) - job.next_input
            job.next_input = len(job.sequences)
            if job.done == job.next_input:  # none of its inputs is in a step
                self._jobs.remove(job)
        for job in self._jobs:
            while job.next_input < len(job.sequences) and len(taken) < self.max_num_seqs:
                length = len(job.sequences[job.next_input])
                if taken and tokens + length > self.max_num_batched_tokens:
                    return taken
                taken.append((job, job.next_input))
                tokens += length
                job.next_input += 1
            if len(taken) >= self.max_num_seqs:
                break
        return taken

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and self._waiting == 0:
                    self._wake.wait()
                if self._stopped:
                    for job in self._jobs:
                        job.settle(error=EngineDeadError("the server is shutting down"))
                    self._jobs.clear()
                    return
                step = self._take_step()
                self._waiting -= len(step)
            self._run(step)

    def _run(self, step: list[tuple[_Job, int]]) -> None:
        by_dimensions: dict[Optional[int], list[tuple[_Job, int]]] = {}
        for job, index in step:
            by_dimensions.setdefault(job.dimensions, []).append((job, index))
        for dimensions, items in by_dimensions.items():
            try:
                self._encode(items, dimensions)
            except Exception as exc:  # noqa: BLE001 - find the request it belongs to
                if len({id(job) for job, _ in items}) == 1:
                    self._fail(items[0][0], exc)
                    continue
                for job in dict.fromkeys(job for job, _ in items):
                    mine = [(j, i) for j, i in items if j is job]
                    try:
                        self._encode(mine, dimensions)
                    except Exception as own:  # noqa: BLE001
                        self._fail(job, own)
        with self._wake:
            self._steps += 1
            for job in dict.fromkeys(job for job, _ in step):
                if job.failed:
                    continue
                if job.done == len(job.sequences) or job.future.cancelled():
                    self._finish(job)

    def _encode(self, items: list[tuple[_Job, int]], dimensions: Optional[int]) -> None:
        vectors = self.model.encode([job.sequences[index] for job, index in items], dimensions)
        for (job, index), vector in zip(items, vectors):
            if job.vectors[index] is None:
                job.vectors[index] = vector
                job.done += 1

    def _finish(self, job: _Job) -> None:
        self._jobs.remove(job)
        self._requests += 1
        self._prompt_tokens += sum(len(s) for s in job.sequences)
        job.settle(list(job.vectors))

    def _fail(self, job: _Job, exc: Exception) -> None:
        logger.exception("encoding a request failed", exc_info=exc)
        with self._wake:
            job.failed = True
            self._jobs.remove(job)
            self._waiting -= len(job.sequences) - job.next_input
            job.next_input = len(job.sequences)
        job.settle(error=RequestFailedError(f"encoding failed: {exc}"))
