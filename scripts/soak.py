"""Soak: run `tokenmill serve` (the default model) under mixed, partly hostile load for N minutes and
report whether its memory and KV blocks stay flat.

Load, in a loop from several concurrent clients: streamed and whole completions and chats, structured
output, n > 1, streams dropped mid-answer, requests cancelled during admission, invalid requests, and
bursts past the admission limits (429s). Every `--sample-every` seconds it records the server's RSS and
its running / waiting / KV-usage gauges; at the end it lets the server go idle and checks that nothing is
running and no KV block is held.

    .venv/bin/python scripts/soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from e2e.server_harness import ServerProcess, metric, metric_samples, wait_for_metrics  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "Explain how a bicycle works.", "List three prime numbers.",
           "Tell me a story about a fox and a crow.", "What is the capital of France?"]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def client_loop(client: httpx.AsyncClient, rng: random.Random, deadline: float, counts: dict) -> None:
    """One client: pick a kind of request at random until the deadline."""
    while time.monotonic() < deadline:
        kind = rng.choice(["stream", "whole", "chat", "json", "n", "drop", "cancel", "bad", "burst"])
        prompt = rng.choice(PROMPTS)
        body = {"prompt": prompt, "max_tokens": rng.randint(8, 64), "temperature": rng.choice([0, 0.8])}
        try:
            if kind == "stream":
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    await r.aread()
            elif kind == "whole":
                await client.post("/v1/completions", json=body)
            elif kind == "chat":
                await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": body["max_tokens"]})
            elif kind == "json":
                await client.post("/v1/completions", json={**body, "guided_json": {
                    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}})
            elif kind == "n":
                await client.post("/v1/completions", json={**body, "n": 2, "temperature": 0.8})
            elif kind == "drop":
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        break
            elif kind == "cancel":
                task = asyncio.ensure_future(client.post("/v1/completions", json=body))
                await asyncio.sleep(rng.uniform(0, 0.05))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            elif kind == "bad":
                await client.post("/v1/completions", content='{"prompt": "x", "temperature": Infinity}',
                                  headers={"content-type": "application/json"})
            else:
                await asyncio.gather(*(client.post("/v1/completions", json={**body, "max_tokens": 4})
                                       for _ in range(12)))
            counts[kind] = counts.get(kind, 0) + 1
        except httpx.HTTPError as exc:
            counts[f"{kind}: {type(exc).__name__}"] = counts.get(f"{kind}: {type(exc).__name__}", 0) + 1


async def soak(url: str, pid: int, minutes: float, clients: int, sample_every: float) -> dict:
    deadline = time.monotonic() + minutes * 60
    rng = random.Random(2026)
    counts: dict = {}
    samples = []
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=httpx.Limits(max_connections=64)) as client:
        async def sampler() -> None:
            started = time.monotonic()
            while time.monotonic() < deadline:
                m = metric_samples(url)
                samples.append({"t_min": round((time.monotonic() - started) / 60, 2), "rss_mib": round(rss_mib(pid), 1),
                                "running": metric(m, "tokenmill:num_requests_running"),
                                "waiting": metric(m, "tokenmill:num_requests_waiting"),
                                "kv_usage": round(metric(m, "tokenmill:kv_cache_usage_perc"), 3)})
                print(json.dumps(samples[-1]), flush=True)
                await asyncio.sleep(sample_every)

        await asyncio.gather(sampler(), *(client_loop(client, random.Random(rng.random()), deadline, counts)
                                          for _ in range(clients)))
    idle = wait_for_metrics(url, lambda m: metric(m, "tokenmill:num_requests_running") == 0
                            and metric(m, "tokenmill:kv_cache_usage_perc") == 0, timeout=120)
    return {"requests": counts, "samples": samples, "idle_rss_mib": round(rss_mib(pid), 1),
            "idle_kv_usage": metric(idle, "tokenmill:kv_cache_usage_perc"),
            "rejected_429": metric(idle, "tokenmill:num_requests_rejected_total"),
            "engine_faults": metric(idle, "tokenmill:engine_faults_total")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to load the server")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients")
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between memory samples")
    parser.add_argument("--out", default=None, help="write the report as JSON here too")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="tokenmill-soak-")) / "server.log"
    server = ServerProcess(None, "--max-num-seqs", "8", "--max-waiting-requests", "16", log_path=log)
    server.start().wait_ready()
    try:
        report = asyncio.run(soak(server.url, server.proc.pid, args.minutes, args.clients, args.sample_every))
    finally:
        code = server.stop()
    report["server_exit_code"] = code
    rss = [s["rss_mib"] for s in report["samples"]]
    report["rss_mib_first_last_max"] = [rss[0], rss[-1], max(rss)] if rss else None
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["idle_kv_usage"] == 0 and report["engine_faults"] == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
