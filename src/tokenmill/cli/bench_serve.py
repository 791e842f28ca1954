"""`tokenmill bench serve`: load an OpenAI-compatible server (tokenmill, vLLM, llama.cpp) and measure it.

Prompts are sent as token ids (exact lengths, no tokenizer round trip), streamed, greedy, with
ignore_eos so every request generates exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from typing import Any, Optional

from tokenmill.bench.datasets import add_dataset_args, build_prompts, describe_dataset
from tokenmill.bench.report import (RequestResult, TreeRssSampler, emit, goodput, parse_goodput, summarise,
                                    write_plots)


def add_bench_serve_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench serve`."""
    p = kinds.add_parser("serve", help="load a running OpenAI-compatible server and report latency and throughput",
                         description="Send seeded prompts to /v1/completions of a running server (streaming, "
                                     "greedy, ignore_eos) and report throughput and TTFT/TPOT/ITL/E2E latency.")
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--api-key", default=None, help="API key, sent as a Bearer token")
    add_dataset_args(p, datasets=("random", "shared-prefix", "multi-turn", "jsonl"))
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids are drawn below this (default: 49152)")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at once (default: 16)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default: inf = all at once, bounded by concurrency)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="also report the peak resident memory of this process and its children (Linux)")
    p.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    p.add_argument("--plot-dir", default=None,
                   help="write latency_cdf.png and tokens_over_time.png here (needs matplotlib)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="service-level objectives, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds; NAME is ttft, "
                        "tpot or e2el): also report the requests per second that met all of them (vLLM's goodput)")
    p.set_defaults(func=run_bench_serve)


async def _one(client: Any, url: str, headers: dict[str, str], body: dict[str, Any], t0: float) -> RequestResult:
    started = time.perf_counter()
    result = RequestResult(ok=False)
    last = started
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    result.chunk_times.append(now - t0)
                    last = now
        result.ok = True
    except Exception as exc:  # a benchmark reports failures, it does not stop on them
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - started
    return result


async def _run(args: argparse.Namespace, prompts: list[Any]) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm

    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency)
    total = len(prompts) * (args.turns if args.dataset == "multi-turn" else 1)
    bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr)

    async def bounded(prompt: Any) -> RequestResult:
        async with limit:
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            result = await _one(client, url, headers, body, started)
            bar.update(1)
            return result

    async def conversation(turns: list[list[int]]) -> list[RequestResult]:
        return [await bounded(turn) for turn in turns]  # each turn waits for the previous reply

    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=args.max_concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            work = conversation(prompt) if args.dataset == "multi-turn" else bounded(prompt)
            tasks.append(asyncio.ensure_future(work))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    bar.close()
    if args.dataset == "multi-turn":
        results = [r for turns in results for r in turns]
    return list(results), elapsed


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run the load and print (and optionally save) the summary."""
    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (inf sends everything at once)")
    slos = parse_goodput(args.goodput) if args.goodput else None
    prompts = build_prompts(args, args.vocab_size)
    sampler: Optional[TreeRssSampler] = TreeRssSampler(args.server_pid) if args.server_pid else None
    with sampler or contextlib.nullcontext():
        results, elapsed = asyncio.run(_run(args, prompts))
    summary = {
        "base_url": args.base_url, **describe_dataset(args, len(results)),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        **summarise(results, elapsed),
    }
    if slos:
        summary["goodput"] = goodput(results, elapsed, slos)
    if sampler:
        summary["server_peak_rss_gib"] = round(sampler.peak_gib, 3)
    if args.plot_dir:
        title = f"{args.base_url} {args.dataset} x{len(results)}, concurrency {args.max_concurrency}"
        summary["plots"] = write_plots(results, args.plot_dir, title)
    emit(summary, args.output_json)
    return 0 if summary["errors"] == 0 else 1
