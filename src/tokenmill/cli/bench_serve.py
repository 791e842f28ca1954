"""`tokenmill bench serve`: load an OpenAI-compatible server (tokenmill, vLLM, llama.cpp) and measure it.

Prompts are sent as token ids (exact lengths, no tokenizer round trip), streamed, greedy, with
ignore_eos so every request generates exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional


def add_bench_serve_parser(kinds: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench serve`."""
    p = kinds.add_parser("serve", help="load a running OpenAI-compatible server and report latency and throughput",
                         description="Send seeded prompts to /v1/completions of a running server (streaming, "
                                     "greedy, ignore_eos) and report throughput and TTFT/TPOT/ITL/E2E latency.")
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--api-key", default=None, help="API key, sent as a Bearer token")
    p.add_argument("--dataset", choices=("random", "shared-prefix", "multi-turn", "jsonl"), default="random",
                   help="random: --input-len random tokens; shared-prefix: one --prefix-len prefix shared by "
                        "all + --input-len unique tokens each; multi-turn: --num-prompts conversations of "
                        "--turns turns, each turn resending the whole history plus --input-len new tokens; "
                        "jsonl: one {\"prompt\": ...} per line of --dataset-path")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation for multi-turn (default: 4)")
    p.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=64, help="number of requests (default: 64)")
    p.add_argument("--input-len", type=int, default=256, help="random / unique tokens per prompt (default: 256)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens (default: 512)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: 128)")
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids are drawn below this (default: 49152)")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at once (default: 16)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default: inf = all at once, bounded by concurrency)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals; vary it for cold caches")
    p.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run_bench_serve)


def build_prompts(args: argparse.Namespace) -> list[Any]:
    """The dataset: token-id lists (random, shared-prefix) or strings (jsonl)."""
    rng = random.Random(args.seed)
    low = min(1000, args.vocab_size // 2)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, args.vocab_size) for _ in range(n)]

    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        with open(args.dataset_path, encoding="utf-8") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        return prompts[:args.num_prompts]
    if args.dataset == "multi-turn":
        # one list of turns per conversation; turn k's prompt extends turn k-1's prompt and a reply
        conversations = []
        for _ in range(args.num_prompts):
            history: list[int] = tokens(args.prefix_len) if args.prefix_len else []
            turns = []
            for _ in range(args.turns):
                history = history + tokens(args.input_len)
                turns.append(history)
                history = history + tokens(args.output_len)  # stands for the assistant's reply
            conversations.append(turns)
        return conversations
    if args.dataset == "shared-prefix":
        prefix = tokens(args.prefix_len)
        return [prefix + tokens(args.input_len) for _ in range(args.num_prompts)]
    return [tokens(args.input_len) for _ in range(args.num_prompts)]


@dataclass
class RequestResult:
    """What one request measured."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: Optional[float] = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client: Any, url: str, headers: dict[str, str], body: dict[str, Any]) -> RequestResult:
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
            result = await _one(client, url, headers, body)
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


def _percentiles(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
    return {"mean": round(statistics.fmean(ordered) * 1000, 2), "p50": round(pick(0.5) * 1000, 2),
            "p90": round(pick(0.9) * 1000, 2), "p99": round(pick(0.99) * 1000, 2)}


def summarise(args: argparse.Namespace, results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    """Throughput and latency figures (latencies in milliseconds)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    total_tokens = output_tokens + sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "dataset": args.dataset, "num_prompts": len(results), "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "input_len": args.input_len, "prefix_len": args.prefix_len if args.dataset != "random" else 0,
        "turns": args.turns if args.dataset == "multi-turn" else 1,
        "output_len": args.output_len, "seed": args.seed,
        "completed": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None),
        "elapsed_s": round(elapsed, 3),
        "request_throughput": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "total_tokens_per_s": round(total_tokens / elapsed, 1),
        "ttft_ms": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
    }


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run the load and print (and optionally save) the summary."""
    prompts = build_prompts(args)
    results, elapsed = asyncio.run(_run(args, prompts))
    summary = summarise(args, results, elapsed)
    print(json.dumps(summary, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["errors"] == 0 else 1
