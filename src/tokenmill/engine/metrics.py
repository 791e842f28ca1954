"""Prometheus metrics, named like vLLM's with a `tokenmill:` prefix so dashboards port; the ones vLLM has
are also published under vLLM's own names (engine/vllm_metrics.py)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.llm_engine import EngineStats
from tokenmill.engine.telemetry import StepRecord
from tokenmill.engine.vllm_metrics import VllmAliases
from tokenmill.outputs import RequestOutput

logger = logging.getLogger("tokenmill.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    """Per-engine Prometheus collectors, fed by the engine loop after every step."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]
        r = self.registry
        families: list = []  # every tokenmill family, which VllmAliases may also publish under vLLM's name

        def family(metric: Any) -> Any:
            families.append(metric)
            return metric

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return family(Histogram(f"tokenmill:{name}", doc, label, buckets=buckets, registry=r)).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return family(Counter(f"tokenmill:{name}", doc, label, registry=r)).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return family(Gauge(f"tokenmill:{name}", doc, label, registry=r)).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.",
                                    _LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Requests preempted (KV blocks ran out).")
        self.rejections = counter("num_requests_rejected", "Requests refused with 429 (admission limits).")
        self.faults = counter("engine_faults", "Engine steps that failed as a whole (the requests in flight "
                              "failed with them).")
        self.worker_restarts = counter("worker_restarts", "Worker groups replaced after a rank died or hung (the "
                                       "requests in flight resumed by recompute).")
        self.worker_recovery = gauge("worker_recovery_seconds", "How long the last worker group replacement took, "
                                     "from the failure seen to the new group ready.")
        self._success = family(Counter("tokenmill:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finish_reason"], registry=r))
        self.model_name = model_name
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.evictions = counter("prefix_cache_evictions", "Cached KV blocks evicted to make room.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since start (0-1).")
        self.secondary_hits = counter("secondary_cache_hits", "Prompt tokens copied back from the second KV tier.")
        self.secondary_saves = counter("secondary_cache_saves", "KV blocks saved to the second tier on eviction.")
        self.spec_rounds = counter("spec_decode_num_drafts", "Speculative verification rounds (one per request "
                                   "and step with proposals).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.")
        self.spec_emitted_tokens = counter("spec_decode_num_emitted_tokens", "Tokens emitted by verification "
                                           "rounds (accepted proposals plus the token sampled after them).")
        self.spec_acceptance_rate = gauge("spec_decode_draft_acceptance_rate", "Accepted / proposed speculative "
                                          "tokens since start (0-1).")
        self.spec_mean_length = gauge("spec_decode_mean_acceptance_length", "Tokens gained per verification round "
                                      "since start: 1 + accepted / rounds (vLLM's definition).")
        self._last_totals = (0,) * 10
        self.encoder_images = counter("encoder_images", "Images the vision encoder encoded (encoder-cache misses; "
                                      "vision-language models).")
        self.encoder_seconds = counter("encoder_seconds", "Time the vision encoder spent encoding images.")
        self._last_encoder = (0, 0.0)
        self.structured = counter("structured_output_requests", "Requests admitted with an output constraint "
                                  "(JSON schema, regex, choice, grammar).")
        self.prefill_tokens = counter("iteration_prefill_tokens", "Tokens computed by engine steps as prefill "
                                      "(prompt chunks, and tokens recomputed after preemption).")
        self.decode_tokens = counter("iteration_decode_tokens", "Tokens computed by engine steps as decode (one "
                                     "new token per request and step, plus its speculative proposals).")
        self.step_time = histogram("engine_step_seconds", "Engine step time, from submission to results.",
                                   _ITL_BUCKETS)
        self._steps = family(Counter("tokenmill:engine_steps", "Engine steps by what they computed (step: decode, "
                                     "prefill, mixed, verify) and how they ran (path: graph, a CUDA graph replayed; "
                                     "eager).", ["model_name", "step", "path"], registry=r))
        self._last_step = 0
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0-1).")
        self._seen_tokens: dict[str, list[int]] = {}
        self._last_token_time: dict[str, float] = {}
        self.families = families
        r.register(VllmAliases(families))

    def observe_step(self, outputs: list[RequestOutput], stats: EngineStats,
                     steps: Sequence[StepRecord] = ()) -> None:
        """Record one engine step: its outputs, queue sizes, cache use and counters, and the steps the
        engine logged since the last call (`Telemetry.steps_after`)."""
        now = time.monotonic()
        for step in steps:
            if step.seq > self._last_step:
                self.prefill_tokens.inc(step.prefill_tokens)
                self.decode_tokens.inc(step.decode_tokens)
                self.step_time.observe(step.duration)
                self._steps.labels(self.model_name, step.kind, "graph" if step.graphed else "eager").inc()
                self._last_step = step.seq
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        spec = stats.spec
        totals = (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
                  stats.prefix_cache_evictions, stats.secondary_cache_hits, stats.secondary_cache_saves,
                  spec.num_rounds, spec.draft_tokens, spec.accepted_tokens, spec.emitted_tokens)
        counters = (self.preemptions, self.prefix_queries, self.prefix_hits, self.evictions, self.secondary_hits,
                    self.secondary_saves, self.spec_rounds, self.spec_draft_tokens, self.spec_accepted_tokens,
                    self.spec_emitted_tokens)
        for counter, total, last in zip(counters, totals, self._last_totals):
            if total > last:
                counter.inc(total - last)
        self._last_totals = totals
        images, seconds = stats.encoder_images, stats.encoder_seconds
        if images > self._last_encoder[0]:
            self.encoder_images.inc(images - self._last_encoder[0])
            self.encoder_seconds.inc(max(0.0, seconds - self._last_encoder[1]))
            self._last_encoder = (images, seconds)
        if stats.prefix_cache_queries:
            self.prefix_hit_rate.set(stats.prefix_cache_hits / stats.prefix_cache_queries)
        if spec.num_rounds:
            self.spec_acceptance_rate.set(spec.accepted_tokens / spec.draft_tokens)
            self.spec_mean_length.set(1 + spec.accepted_tokens / spec.num_rounds)
        for output in outputs:
            self._observe_output(output, now)

    def _observe_output(self, output: RequestOutput, now: float) -> None:
        seen = self._seen_tokens.setdefault(output.request_id, [0] * len(output.outputs))
        before = sum(seen)
        for completion in output.outputs:
            seen[completion.index] = (seen[completion.index] if output.delta else 0) + len(completion.token_ids)
        new_tokens = sum(seen) - before
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            last = self._last_token_time.get(output.request_id)
            if last is None:
                if output.metrics is not None:
                    self.ttft.observe(now - output.metrics.arrival_time)
            else:
                self.itl.observe(now - last)
            self._last_token_time[output.request_id] = now
        if output.finished:
            self._finish(output, now)

    def _finish(self, output: RequestOutput, now: float) -> None:
        self._last_token_time.pop(output.request_id, None)
        output_tokens = sum(self._seen_tokens.pop(output.request_id, [0]))
        metrics = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self._success.labels(self.model_name, completion.finish_reason or "abort").inc()
        if metrics is None:
            return
        self.e2e.observe(now - metrics.arrival_time)
        queue = None
        if metrics.first_scheduled_time is not None:
            queue = metrics.first_scheduled_time - metrics.arrival_time
            self.queue_time.observe(queue)
        ttft = None if metrics.first_token_time is None else metrics.first_token_time - metrics.arrival_time
        logger.info(json.dumps({
            "event": "request_finished", "request_id": output.request_id,
            "prompt_tokens": len(output.prompt_token_ids),
            "output_tokens": output_tokens,
            "finish_reason": [c.finish_reason for c in output.outputs],
            "queue_time_s": _round(queue), "ttft_s": _round(ttft), "total_s": _round(now - metrics.arrival_time),
        }))

    def record_abort(self, request_id: str) -> None:
        """Count an aborted request and drop its per-request state."""
        self._seen_tokens.pop(request_id, None)
        self._last_token_time.pop(request_id, None)
        self._success.labels(self.model_name, "abort").inc()
        logger.info(json.dumps({"event": "request_aborted", "request_id": request_id}))

    def record_structured(self) -> None:
        """Count a request admitted with an output constraint."""
        self.structured.inc()

    @property
    def last_step(self) -> int:
        """The sequence number of the last engine step counted."""
        return self._last_step

    def record_rejection(self) -> None:
        """Count a request refused for lack of room."""
        self.rejections.inc()

    def record_fault(self) -> None:
        """Count a failed engine step."""
        self.faults.inc()

    def record_worker_restart(self, seconds: float) -> None:
        """Count a replaced worker group, and how long replacing it took."""
        self.worker_restarts.inc()
        self.worker_recovery.set(seconds)

    def render(self) -> bytes:
        """The Prometheus exposition text."""
        return generate_latest(self.registry)


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 4)
