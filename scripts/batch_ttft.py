"""Interactive time to first token while a Batch API batch runs, against the same server idle (issue 62: within
1.5x at the default --batch-max-concurrency).

Against a running server (started with an API key): rounds alternate idle and busy. An idle round streams
`--requests` completions one after another and times each one's first token; a busy round uploads a batch of
`--lines` completions lines, waits until it is in progress, times the same interactive requests, then cancels the
batch and waits for it to settle. Every prompt starts with a fresh nonce, so no prefix cache hit helps. Prints
each round's median TTFT, the medians over rounds, and busy / idle.

    tokenmill serve --api-key k --port 8300 &
    .venv/bin/python scripts/batch_ttft.py http://127.0.0.1:8300 --api-key k --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
import uuid

import httpx

TEXT = ("The lighthouse keeper wrote in the log every evening: the wind, the ships that passed, the colour of the "
        "sea at dusk, and what the gulls were doing on the rocks below the lamp room. ")


def first_token_seconds(client: httpx.Client, max_tokens: int) -> float:
    """One streamed completion's time to its first token."""
    body = {"prompt": f"{uuid.uuid4().hex} {TEXT * 2}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                seconds = time.perf_counter() - started
                break
        for _ in lines:  # (the rest of the stream)
            pass
    return seconds


def interactive_round(client: httpx.Client, requests: int, max_tokens: int) -> float:
    """The median time to first token of `requests` completions sent one after another."""
    return statistics.median(first_token_seconds(client, max_tokens) for _ in range(requests))


def start_batch(client: httpx.Client, lines: int, max_tokens: int) -> str:
    """Upload `lines` completions lines, create their batch and wait until it runs; its id."""
    rows = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": f"{uuid.uuid4().hex} {TEXT * 3}", "max_tokens": max_tokens,
                                 "temperature": 0, "ignore_eos": True}}) for i in range(lines)]
    upload = client.post("/v1/files", files={"file": ("lines.jsonl", io.BytesIO("\n".join(rows).encode()))},
                         data={"purpose": "batch"})
    upload.raise_for_status()
    batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()
    while batch["status"] in ("validating",) or not batch["request_counts"]["completed"]:
        time.sleep(0.2)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return batch["id"]


def stop_batch(client: httpx.Client, batch_id: str) -> None:
    """Cancel the batch and wait until it has settled."""
    client.post(f"/v1/batches/{batch_id}/cancel")
    while client.get(f"/v1/batches/{batch_id}").json()["status"] == "cancelling":
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="base URL of the running server")
    parser.add_argument("--api-key", required=True, help="the server's API key (the Batch API needs it)")
    parser.add_argument("--rounds", type=int, default=3, help="idle and busy rounds, alternating")
    parser.add_argument("--requests", type=int, default=8, help="interactive requests per round")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens each interactive request generates")
    parser.add_argument("--lines", type=int, default=400, help="lines of each busy round's batch")
    parser.add_argument("--line-tokens", type=int, default=64, help="tokens each batch line generates")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        interactive_round(client, 2, args.max_tokens)  # warm-up
        medians: dict[str, list[float]] = {"idle": [], "busy": []}
        for round_ in range(args.rounds):
            for kind in ("idle", "busy") if round_ % 2 == 0 else ("busy", "idle"):
                batch_id = start_batch(client, args.lines, args.line_tokens) if kind == "busy" else None
                medians[kind].append(interactive_round(client, args.requests, args.max_tokens))
                if batch_id is not None:
                    stop_batch(client, batch_id)
                print(f"round {round_} {kind}: median TTFT {medians[kind][-1] * 1000:.1f} ms", flush=True)
    idle, busy = statistics.median(medians["idle"]), statistics.median(medians["busy"])
    print(f"median TTFT idle {idle * 1000:.1f} ms, during a batch {busy * 1000:.1f} ms: busy / idle {busy / idle:.2f}x")


if __name__ == "__main__":
    main()
