"""One sample of the live engine stream (`/v1/engine/stream`; schema in docs/dashboard.md).

Built on the engine thread, which alone touches the scheduler and the KV pool, so a sample is one
consistent moment. Counters and histograms are read back, in one pass, from the Prometheus collectors
that /metrics renders, so the stream and /metrics never disagree.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

from tokenmill.engine.telemetry import RequestTrace, StepRecord

SCHEMA_VERSION = 1
MAX_MAP_CELLS = 4096  # a larger pool shows several blocks per cell (the highest state code among them)
_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
               "e2e": "e2e_request_latency_seconds", "queue": "request_queue_time_seconds"}


def build_sample(engine: Any, families: Iterable[Any], model_name: str, after_step: int) -> dict[str, Any]:
    """The stream sample now: the steps logged after step `after_step` and everything else as it stands;
    `families` are the metric collectors /metrics renders (`EngineMetrics.families`)."""
    now_wall, now = time.time(), time.monotonic()

    def wall(t: Optional[float]) -> Optional[float]:
        return None if t is None else round(now_wall - (now - t), 4)

    collected = [family for collector in families for family in collector.collect()]
    values = {(s.name, frozenset(s.labels.items())): s.value for family in collected for s in family.samples}

    def total(name: str, **extra: str) -> float:
        return values.get((f"tokenmill:{name}", frozenset({"model_name": model_name, **extra}.items())), 0.0)

    scheduler, kv, telemetry = engine.scheduler, engine.kv_cache, engine.telemetry
    queries, hits = total("prefix_cache_queries_total"), total("prefix_cache_hits_total")
    drafts, accepted = total("spec_decode_num_draft_tokens_total"), total("spec_decode_num_accepted_tokens_total")
    reasons = ("stop", "length", "abort", "error")
    return {
        "version": SCHEMA_VERSION,
        "time": round(now_wall, 4),
        "model": model_name,
        "scheduler": {
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "preempted": sum(1 for r in scheduler.waiting if r.num_preemptions),
            "preemptions_total": total("num_preemptions_total"),
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
            "steps": [_step(step, wall) for step in telemetry.steps_after(after_step)],
        },
        "kv": {
            **_block_map(kv.pool),
            "block_size": kv.block_size,
            "usage": kv.usage,
            "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None},
            "secondary": None if kv.tier is None else {"used": kv.tier.num_used, "capacity": kv.tier.num_slots},
        },
        "tokens": {
            "prompt_total": total("prompt_tokens_total"),
            "generation_total": total("generation_tokens_total"),
            "prefill_total": total("iteration_prefill_tokens_total"),
            "decode_total": total("iteration_decode_tokens_total"),
        },
        "latency": {key: _histogram(collected, f"tokenmill:{name}", model_name) for key, name in _HISTOGRAMS.items()},
        "requests": {
            "finished": {reason: total("request_success_total", finish_reason=reason) for reason in reasons},
            "rejected": total("num_requests_rejected_total"),
            "structured": total("structured_output_requests_total"),
            "engine_faults": total("engine_faults_total"),
        },
        "encoder": {"images_total": total("encoder_images_total"), "seconds_total": total("encoder_seconds_total")},
        "spec": {"drafts": total("spec_decode_num_drafts_total"), "draft_tokens": drafts, "accepted_tokens": accepted,
                 "acceptance_rate": accepted / drafts if drafts else None},
        "timeline": [_trace(trace, wall) for trace in telemetry.traces()],
    }


def _step(step: StepRecord, wall: Any) -> dict[str, Any]:
    return {"seq": step.seq, "time": wall(step.end), "duration_ms": round(step.duration * 1000, 3),
            "prefill_tokens": step.prefill_tokens, "decode_tokens": step.decode_tokens,
            "requests": step.num_requests}


def _trace(trace: RequestTrace, wall: Any) -> dict[str, Any]:
    return {"id": trace.request_id, "arrival": wall(trace.arrival), "first_scheduled": wall(trace.first_scheduled),
            "first_token": wall(trace.first_token), "finished": wall(trace.finished),
            "finish_reason": trace.finish_reason, "output_tokens": trace.output_tokens,
            "spans": [[kind, wall(start), wall(end), tokens] for kind, start, end, tokens in trace.spans],
            "preemptions": [wall(t) for t in trace.preemptions]}


def _block_map(pool: Any) -> dict[str, Any]:
    """The pool as a string of state codes, one per cell: 0 free, 1 held by requests, 2 cached and free
    (evictable), 3 cached and held (a shared prefix); and how many blocks are in each state."""
    codes = [(ref > 0) | ((key is not None) << 1) for ref, key in zip(pool.ref_counts, pool.keys)]
    counts = {state: codes.count(code) for code, state in enumerate(("free", "in_use", "evictable", "shared"))}
    per_cell = -(-len(codes) // MAX_MAP_CELLS)
    if per_cell > 1:
        codes = [max(codes[i:i + per_cell]) for i in range(0, len(codes), per_cell)]
    return {"num_blocks": pool.num_blocks, "blocks_per_cell": per_cell, "map": "".join(map(str, codes)),
            "counts": counts}


def _histogram(collected: list[Any], name: str, model_name: str) -> dict[str, Any]:
    """A histogram's upper bounds and per-bucket (not cumulative) counts, with its count and sum."""
    bounds, cumulative, count, total = [], [], 0.0, 0.0
    for family in collected:
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.labels.get("model_name") != model_name:
                continue
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                bounds.append(float(sample.labels["le"]))
                cumulative.append(sample.value)
            elif sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    counts = [c - p for c, p in zip(cumulative, [0.0] + cumulative[:-1])]
    return {"le": bounds, "counts": counts + [count - (cumulative[-1] if cumulative else 0.0)],
            "count": count, "sum": total}
