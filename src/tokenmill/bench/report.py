"""What a benchmark measured: per-request results, the summary (throughput and latency percentiles),
PNG plots, and peak resident memory."""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class RequestResult:
    """One request: durations in seconds; `chunk_times` are seconds since the benchmark started."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: Optional[float] = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk with text
    error: str = ""


def percentiles(values: list[float]) -> dict[str, Optional[float]]:
    """Mean, p50, p90, p99 of durations in seconds, reported in milliseconds."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
    return {"mean": round(statistics.fmean(ordered) * 1000, 2), "p50": round(pick(0.5) * 1000, 2),
            "p90": round(pick(0.9) * 1000, 2), "p99": round(pick(0.99) * 1000, 2)}


def tpot(r: RequestResult) -> Optional[float]:
    """Time per output token after the first."""
    if r.ttft is None or r.output_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """`--goodput` values NAME:MILLISECONDS (NAME in GOODPUT_METRICS, vLLM's flag) -> {NAME: seconds}."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        try:
            milliseconds = float(value)
        except ValueError:
            milliseconds = math.nan
        if not sep or name not in GOODPUT_METRICS or not 0 < milliseconds < math.inf:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME one of {', '.join(GOODPUT_METRICS)} "
                             f"and a positive number of milliseconds; got {spec!r}")
        if name in slos:
            raise ValueError(f"--goodput names {name} twice")
        slos[name] = milliseconds / 1000
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (a request of one output token has a TPOT of 0)."""
    observed = {"ttft": r.ttft, "tpot": tpot(r) if r.output_tokens >= 2 else 0.0, "e2el": r.e2e}
    return r.ok and all(observed[name] is not None and observed[name] <= limit for name, limit in slos.items())


def goodput(results: list[RequestResult], elapsed: float, slos: dict[str, float]) -> dict[str, Any]:
    """Requests per second that met every SLO, and the share of all requests that did."""
    good = sum(1 for r in results if meets_slos(r, slos))
    return {"slos_ms": {name: round(limit * 1000, 3) for name, limit in slos.items()}, "good_requests": good,
            "request_goodput": round(good / elapsed, 3) if elapsed > 0 else None,
            "slo_attainment": round(good / len(results), 4) if results else None}


def summarise(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    """Throughput and TTFT/TPOT/ITL/E2E percentiles (milliseconds) of a finished run."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    total_tokens = output_tokens + sum(r.prompt_tokens for r in ok)
    per_token = [t for t in map(tpot, ok) if t is not None]
    return {
        "completed": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None),
        "elapsed_s": round(elapsed, 3),
        "input_tokens": total_tokens - output_tokens, "output_tokens": output_tokens,
        "request_throughput": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "total_tokens_per_s": round(total_tokens / elapsed, 1),
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles(per_token),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
    }


def emit(summary: dict[str, Any], output_json: Optional[str]) -> None:
    """Print the summary as JSON, and write it to `output_json` too when given."""
    print(json.dumps(summary, indent=2))
    if output_json:
        with open(output_json, "w") as f:
            json.dump(summary, f, indent=2)


def write_plots(results: list[RequestResult], folder: str, title: str) -> list[str]:
    """latency_cdf.png (TTFT, TPOT, ITL, E2E) and tokens_over_time.png (output tokens/s per second)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot-dir needs matplotlib: pip install 'tokenmill[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    ok = [r for r in results if r.ok]
    series = {"TTFT": [r.ttft for r in ok if r.ttft is not None],
              "TPOT": [t for t in map(tpot, ok) if t is not None],
              "ITL": [x for r in ok for x in r.itl], "E2E": [r.e2e for r in ok]}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, series.items()):
        ordered = sorted(v * 1000 for v in values)
        if ordered:
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples")
    fig.suptitle(title)
    fig.tight_layout()
    cdf = os.path.join(folder, "latency_cdf.png")
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    # Streamed chunks may carry several tokens: spread each request's tokens evenly over its chunks.
    counts: dict[int, float] = {}
    for r in ok:
        if r.chunk_times:
            weight = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                counts[int(t)] = counts.get(int(t), 0.0) + weight
    fig, ax = plt.subplots(figsize=(8, 3.6))
    if counts:
        seconds = range(max(counts) + 1)
        ax.step(list(seconds), [counts.get(s, 0.0) for s in seconds], where="post")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    over_time = os.path.join(folder, "tokens_over_time.png")
    fig.savefig(over_time, dpi=100)
    plt.close(fig)
    return [cdf, over_time]


def own_peak_rss_gib() -> float:
    """This process's peak resident set size so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


class TreeRssSampler:
    """Samples the resident memory of a process and all its descendants every `interval` seconds
    (Linux /proc) and keeps the peak of their sum — a server's front end plus its workers."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        if not os.path.exists(f"/proc/{pid}/status"):
            raise ValueError(f"no process with pid {pid} to measure (--server-pid); /proc is needed")
        self.pid, self.interval = pid, interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def __enter__(self) -> "TreeRssSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def peak_gib(self) -> float:
        """Peak summed RSS seen, in GiB."""
        return self.peak_bytes / (1 << 30)

    def sample(self) -> None:
        """Take one reading now."""
        self.peak_bytes = max(self.peak_bytes, sum(_rss_bytes(p) for p in _tree(self.pid)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, frontier = [root], [root]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found.extend(frontier)
    return found


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0
