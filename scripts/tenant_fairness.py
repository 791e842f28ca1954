"""Tenant B's time to first token while tenant A floods the server, against B alone on the idle server (issue 63:
A sends 200 concurrent long requests, B then 10 short ones; B's TTFT p50 within 2x of B alone).

Writes a tenants file of two tenants (a, b) with new keys, or reads one written before; against a server started
with it, rounds alternate idle and busy. An idle round sends B's 10 streamed completions at once and takes the
median time to their first tokens; a busy round first starts A's 200 streamed long completions, waits until the
batch is full of them (A's first `--wait-started` tokens came back), sends B's 10, then closes A's streams (the
server aborts them) and waits for the server to drain. Every prompt starts with a fresh nonce (no prefix hits).
Prints each round's median, the medians over rounds, busy / idle, and how many of A's and B's requests got a 429.

    .venv/bin/python scripts/tenant_fairness.py --write-tenants /tmp/tenants.json
    tokenmill serve --tenants-file /tmp/tenants.json --port 8300 &
    .venv/bin/python scripts/tenant_fairness.py --tenants /tmp/tenants.json http://127.0.0.1:8300 --rounds 2

With `--one-queue`, the same file is served as one tenant (both keys are tenant a's): the baseline without fair
sharing, to compare. With `--in-process` (no server, no file), the same flood on an LLMEngine of the default model
in this process, B's requests added between two steps: the scheduler's share of the figure, without the wait for
the step in flight that a request arriving over HTTP has.

    .venv/bin/python scripts/tenant_fairness.py --in-process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import time
import uuid

import httpx

from tokenmill.server.tenants import hash_key

TEXT = ("The lighthouse keeper wrote in the log every evening: the wind, the ships that passed, the colour of the "
        "sea at dusk, and what the gulls were doing on the rocks below the lamp room. ")


def write_tenants(path: str, one_queue: bool) -> None:
    """A tenants file of a and b with new keys, and the keys beside it (<path>.keys)."""
    keys = {"a": f"tm-{secrets.token_urlsafe(24)}", "b": f"tm-{secrets.token_urlsafe(24)}"}
    if one_queue:
        keys["b"] = keys["a"]
        tenants = [{"name": "a", "key_hash": hash_key(keys["a"])}]
    else:
        tenants = [{"name": name, "key_hash": hash_key(key)} for name, key in keys.items()]
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"tenants": tenants}, handle)
    with open(path + ".keys", "w", encoding="utf-8") as handle:
        json.dump(keys, handle)


async def first_token(client: httpx.AsyncClient, key: str, repeats: int, max_tokens: int,
                      started_event: asyncio.Event | None = None) -> float | None:
    """One streamed completion's time to its first token (None when it was refused with 429)."""
    body = {"prompt": f"{uuid.uuid4().hex} {TEXT * repeats}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code == 429:
            return None
        response.raise_for_status()
        seconds = None
        async for line in response.aiter_lines():
            if seconds is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                seconds = time.perf_counter() - started
                if started_event is not None:
                    started_event.set()
    return seconds


B_REFUSED = [0]  # B's requests refused with 429 (none should be: B stays within its share)


async def b_round(client: httpx.AsyncClient, key: str, requests: int, max_tokens: int) -> float:
    """The median first-token time of B's `requests` completions sent at once (their refusals counted)."""
    times = await asyncio.gather(*(first_token(client, key, 2, max_tokens) for _ in range(requests)))
    B_REFUSED[0] += sum(t is None for t in times)
    return statistics.median(t for t in times if t is not None)


async def running(client: httpx.AsyncClient) -> float:
    """The engine's running requests (its /metrics gauge)."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("tokenmill:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def busy_round(client: httpx.AsyncClient, keys: dict, args: argparse.Namespace) -> tuple[float, int]:
    """B's median first-token time while A's flood runs, and how many of A's requests were refused."""
    events = [asyncio.Event() for _ in range(args.a_requests)]
    flood = [asyncio.create_task(first_token(client, keys["a"], args.a_repeats, args.a_tokens, event))
             for event in events]
    while sum(event.is_set() for event in events) < args.wait_started:
        await asyncio.sleep(0.05)
    median = await b_round(client, keys["b"], args.b_requests, args.b_tokens)
    refused = sum(1 for task in flood if task.done() and not task.cancelled() and task.result() is None)
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    while await running(client) > 0:
        await asyncio.sleep(0.2)
    return median, refused


async def measure(args: argparse.Namespace) -> None:
    with open(args.tenants + ".keys", encoding="utf-8") as handle:
        keys = json.load(handle)
    limits = httpx.Limits(max_connections=args.a_requests + args.b_requests + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=1800, limits=limits) as client:
        await b_round(client, keys["b"], 2, args.b_tokens)  # warm-up
        medians: dict[str, list[float]] = {"idle": [], "busy": []}
        refused = 0
        for round_ in range(args.rounds):
            for kind in ("idle", "busy") if round_ % 2 == 0 else ("busy", "idle"):
                if kind == "idle":
                    medians[kind].append(await b_round(client, keys["b"], args.b_requests, args.b_tokens))
                else:
                    median, count = await busy_round(client, keys, args)
                    medians[kind].append(median)
                    refused += count
                print(f"round {round_} {kind}: B's median TTFT {medians[kind][-1] * 1000:.1f} ms", flush=True)
    idle, busy = statistics.median(medians["idle"]), statistics.median(medians["busy"])
    print(f"B's median TTFT alone {idle * 1000:.1f} ms, during A's flood {busy * 1000:.1f} ms: busy / idle "
          f"{busy / idle:.2f}x; refused with 429: {refused} of A's, {B_REFUSED[0]} of B's")


def in_process(args: argparse.Namespace) -> None:
    """B's median first-token time alone and during A's flood on an LLMEngine in this process (one round each)."""
    from tokenmill import SamplingParams
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.request import TenantShare

    engine = LLMEngine(EngineConfig.from_kwargs())
    a_share, b_share = (None, None) if args.one_queue else (TenantShare("a"), TenantShare("b"))

    def ids(repeats: int) -> list[int]:
        return engine.tokenizer(f"{uuid.uuid4().hex} {TEXT * repeats}").input_ids

    def b_median(prefix: str) -> float:
        params = SamplingParams(max_tokens=args.b_tokens, temperature=0, ignore_eos=True)
        started, first = time.perf_counter(), {}
        for i in range(args.b_requests):
            engine.add_request(f"{prefix}{i}", None, params, prompt_token_ids=ids(2), tenant=b_share)
        while len(first) < args.b_requests:
            for output in engine.step():
                if output.request_id.startswith(prefix) and output.outputs[0].token_ids:
                    first.setdefault(output.request_id, time.perf_counter() - started)
        return statistics.median(first.values())

    alone = b_median("alone-")
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(max_tokens=args.a_tokens, temperature=0, ignore_eos=True)
    for i in range(args.a_requests):
        engine.add_request(f"a{i}", None, params, prompt_token_ids=ids(args.a_repeats), tenant=a_share)
    started: set[str] = set()
    while len(started) < args.wait_started:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    busy = b_median("busy-")
    engine.shutdown()
    print(f"in process: B's median TTFT alone {alone * 1000:.1f} ms, during A's flood {busy * 1000:.1f} ms: "
          f"busy / idle {busy / alone:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", nargs="?", help="base URL of the running server")
    parser.add_argument("--write-tenants", metavar="PATH", help="write a tenants file (and PATH.keys) and stop")
    parser.add_argument("--one-queue", action="store_true", help="with --write-tenants (or --in-process): a and b share "
                                                                 "one tenant")
    parser.add_argument("--in-process", action="store_true", help="run the flood on an engine in this process")
    parser.add_argument("--tenants", metavar="PATH", help="the tenants file the server runs (its .keys beside it)")
    parser.add_argument("--rounds", type=int, default=2, help="idle and busy rounds, alternating")
    parser.add_argument("--a-requests", type=int, default=200, help="A's concurrent requests")
    parser.add_argument("--a-repeats", type=int, default=10, help="A's prompt: the text this many times (~40 "
                                                                   "tokens each)")
    parser.add_argument("--a-tokens", type=int, default=128, help="tokens each of A's requests generates")
    parser.add_argument("--b-requests", type=int, default=10, help="B's requests, sent at once")
    parser.add_argument("--b-tokens", type=int, default=8, help="tokens each of B's requests generates")
    parser.add_argument("--wait-started", type=int, default=16, help="A's requests with a first token before B sends")
    args = parser.parse_args()
    if args.write_tenants:
        write_tenants(args.write_tenants, args.one_queue)
        return
    if args.in_process:
        in_process(args)
        return
    if not args.url or not args.tenants:
        parser.error("give the server's URL and --tenants")
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
