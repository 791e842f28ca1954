"""What the engine thread records for the live dashboard (`/v1/engine/stream`): its recent steps and,
while someone watches, a timeline of each request's prefill chunks, decode runs and preemptions.

Only the engine thread writes here. Steps are always recorded (a few integers per step; they also feed
the step counters of /metrics); the per-request timeline costs a dictionary lookup per scheduled
request, so it is recorded only while `watchers` > 0. Everything is bounded: the step log keeps the
last `max_steps`, the timeline the last `max_requests` finished requests (plus those in flight) with at
most `max_spans` spans each (the oldest are dropped).
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

PREFILL, DECODE = "prefill", "decode"
# what a step computed: decode tokens only, prompt chunks only, both, or speculative proposals to verify
STEP_KINDS = ("decode", "prefill", "mixed", "verify")


@dataclass(slots=True)
class StepRecord:
    """One engine step: when it ended (time.monotonic()), how long it took from submission to results,
    and its tokens split into prefill (prompt or recomputed tokens) and decode (one new token per
    request, plus its speculative proposals)."""

    seq: int
    end: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    num_requests: int
    kind: str = "decode"  # one of STEP_KINDS
    graphed: bool = False  # it replayed a CUDA graph (else it ran eagerly)


@dataclass(slots=True)
class ChunkInfo:
    """What the timeline needs of one scheduled chunk."""

    request_id: str
    num_tokens: int
    kind: str  # PREFILL | DECODE
    num_preemptions: int  # the request's preemptions so far
    arrival: float
    samples: bool = False  # the chunk reaches the sequence's end: a token is sampled after it


@dataclass
class RequestTrace:
    """One request's life on the timeline (time.monotonic() seconds). Spans are [kind, start, end,
    tokens]: consecutive decode steps merge into one span, each prefill chunk is its own."""

    request_id: str
    arrival: float
    first_scheduled: Optional[float] = None
    spans: list[list] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    first_token: Optional[float] = None  # the end of the first step that sampled a token
    finished: Optional[float] = None
    finish_reason: Optional[str] = None
    output_tokens: Optional[int] = None  # set when it finishes
    num_preemptions: int = 0


class Telemetry:
    """The step log and request timeline of one engine (see the module docstring)."""

    def __init__(self, max_steps: int = 2048, max_requests: int = 64, max_spans: int = 64) -> None:
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._seq = itertools.count(1)
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self.watchers = 0
        self.max_spans = max_spans
        self.active: dict[str, RequestTrace] = {}
        self.finished: collections.deque[RequestTrace] = collections.deque(maxlen=max_requests)

    def record_step(self, started: float, chunks: Iterable[ChunkInfo],
                    ended: Optional[float] = None, graphed: bool = False) -> Optional[StepRecord]:
        """Log a finished step whose chunks were submitted at `started` (`graphed`: it replayed a CUDA graph);
        a step that computed nothing (it only released finished requests' blocks) is not logged."""
        end = time.monotonic() if ended is None else ended
        prefill = decode = count = 0
        verifies = False
        watched = self.watchers > 0
        for chunk in chunks:
            count += 1
            if chunk.kind == DECODE:
                decode += chunk.num_tokens
                verifies = verifies or chunk.num_tokens > 1
            else:
                prefill += chunk.num_tokens
            if watched:
                self._trace(chunk, started, end)
        if not count:
            return None
        self.prefill_tokens_total += prefill
        self.decode_tokens_total += decode
        kind = "verify" if verifies else "mixed" if prefill and decode else "prefill" if prefill else "decode"
        record = StepRecord(next(self._seq), end, end - started, prefill, decode, count, kind, graphed)
        self.steps.append(record)
        return record

    def _trace(self, chunk: ChunkInfo, started: float, end: float) -> None:
        trace = self.active.get(chunk.request_id)
        if trace is None:
            trace = self.active[chunk.request_id] = RequestTrace(chunk.request_id, chunk.arrival,
                                                                 num_preemptions=chunk.num_preemptions)
        if trace.first_scheduled is None:
            trace.first_scheduled = started
        if chunk.samples and trace.first_token is None:
            trace.first_token = end
        if chunk.num_preemptions > trace.num_preemptions:
            trace.preemptions.append(started)
            trace.num_preemptions = chunk.num_preemptions
        last = trace.spans[-1] if trace.spans else None
        preempted_since = last is not None and bool(trace.preemptions) and trace.preemptions[-1] >= last[2]
        if chunk.kind == DECODE and last is not None and last[0] == DECODE and not preempted_since:
            last[2], last[3] = end, last[3] + chunk.num_tokens
            return
        trace.spans.append([chunk.kind, started, end, chunk.num_tokens])
        if len(trace.spans) > self.max_spans:
            del trace.spans[0]

    def record_finished(self, request_id: str, reason: Optional[str], output_tokens: Optional[int] = None,
                        arrival: Optional[float] = None) -> None:
        """A request ended (`reason`: its finish reason, or "abort") with `output_tokens` generated. Kept
        only when it was traced, or when `arrival` is given while someone watches (a request that ended
        before it was scheduled)."""
        trace = self.active.pop(request_id, None)
        if trace is None:
            if self.watchers <= 0 or arrival is None:
                return
            trace = RequestTrace(request_id, arrival)
        trace.finished, trace.finish_reason, trace.output_tokens = time.monotonic(), reason, output_tokens
        self.finished.append(trace)

    def steps_after(self, seq: int) -> list[StepRecord]:
        """The logged steps with a sequence number above `seq` (oldest first)."""
        newer = []
        for step in reversed(self.steps):
            if step.seq <= seq:
                break
            newer.append(step)
        return newer[::-1]

    def traces(self) -> list[RequestTrace]:
        """The finished traces kept, oldest first, then those in flight."""
        return list(self.finished) + list(self.active.values())

    def stop_tracing(self) -> None:
        """The last watcher left: forget the traces in flight, which no longer get their steps."""
        self.active.clear()
