"""Paired timing of streamed chat completions on two running servers (e.g. two commits of tokenmill).

Each round sends the same burst to both, alternating which goes first: `--concurrency` streamed chats of
`--max-tokens` tokens (greedy, ignore_eos). Prints each run, the medians and B / A.

    .venv/bin/python scripts/chat_stream_pair.py http://127.0.0.1:8201 http://127.0.0.1:8202 --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx


async def burst(url: str, concurrency: int, max_tokens: int) -> tuple[float, int]:
    """(seconds for the whole burst, SSE chunks received)."""
    async def one(client: httpx.AsyncClient, index: int) -> int:
        body = {"messages": [{"role": "user", "content": f"Tell me story number {index} about a lighthouse."}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        chunks = 0
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                chunks += line.startswith("data: {")
        return chunks

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(client, i) for i in range(concurrency)))
        return time.perf_counter() - started, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="base URL of server A (the baseline)")
    parser.add_argument("b", help="base URL of server B")
    parser.add_argument("--rounds", type=int, default=8, help="runs on each server, alternating the order")
    parser.add_argument("--concurrency", type=int, default=16, help="streamed requests at once")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens each request generates")
    args = parser.parse_args()
    for url in (args.a, args.b):  # warm-up: first requests build caches
        asyncio.run(burst(url, args.concurrency, args.max_tokens))
    times: dict[str, list[float]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        order = [("A", args.a), ("B", args.b)] if round_ % 2 == 0 else [("B", args.b), ("A", args.a)]
        for name, url in order:
            seconds, chunks = asyncio.run(burst(url, args.concurrency, args.max_tokens))
            times[name].append(seconds)
            print(f"{name}: {seconds:.3f} s ({chunks} chunks)", flush=True)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    tokens = args.concurrency * args.max_tokens
    print(f"median A {a:.3f} s ({tokens / a:.0f} tok/s), B {b:.3f} s ({tokens / b:.0f} tok/s); B / A = {b / a:.3f}")


if __name__ == "__main__":
    main()
