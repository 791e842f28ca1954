"""What a prefill/decode transfer over TCP costs and buys, in one process on loopback.

`tokenmill bench kv-transfer` builds a prefill engine (TCPConnector producer, listening on loopback) and a
decode engine (consumer) from the same model. For each prompt length, with a fresh random prompt per
repetition (so no prefix cache helps):

- **local**: the decode engine prefills the prompt itself and samples one token (its TTFT without a
  transfer);
- **prefill**: the prefill engine does the same for the producer's side (the work a transfer moves away);
- **fetch**: the decode engine takes the finished prompt's blocks over TCP (bytes / time = GB/s);
- **remote**: the decode engine's TTFT given the fetched transfer (checks, import into the pool, and the
  one step over the last prompt token); fetch + remote is the TTFT a transfer gives the decode server.

It prints medians (ms) and writes them as JSON with --output-json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from typing import Any

from tqdm import tqdm

from tokenmill.bench.report import emit
from tokenmill.cli.engine_args import add_engine_args, engine_kwargs


def add_kv_transfer_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `tokenmill bench kv-transfer` (and every engine flag)."""
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 8000],
                        help="prompt lengths in tokens (default: 2048 8000)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per length; medians are shown (default: 3)")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    parser.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    add_engine_args(parser, skip=("kv_transfer_config",))


def run_kv_transfer(args: argparse.Namespace) -> int:
    """Run the measurement and print the medians."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    def engine(role: str, **extra: Any) -> LLM:
        config = {"kv_connector": "TCPConnector", "kv_role": role, "kv_port": 0, **extra}
        return LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args), kv_transfer_config=config)))

    producer = engine("kv_producer")
    consumer = engine("kv_consumer", kv_connector_extra_config={"fetch_timeout_s": 600})
    transfers = consumer.llm_engine.kv_transfers
    vocab = consumer.llm_engine.arch.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(args.prompt_seed)

    def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, Any]:
        start = time.perf_counter()
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return (time.perf_counter() - start) * 1000, out

    rows = []
    try:
        for llm in (producer, consumer):  # warm-up: first-call costs stay out of the figures
            timed(llm, [rng.randrange(vocab) for _ in range(64)], one)
        with tqdm(total=len(args.prompt_lens) * args.repeats, desc="kv-transfer", file=sys.stderr) as bar:
            for length in args.prompt_lens:
                runs: dict[str, list[float]] = {"local_ms": [], "prefill_ms": [], "fetch_ms": [], "remote_ms": []}
                size = 0
                for _ in range(args.repeats):
                    fresh = [[rng.randrange(vocab) for _ in range(length)] for _ in range(2)]
                    runs["local_ms"].append(timed(consumer, fresh[0], one)[0])
                    elapsed, out = timed(producer, fresh[1], dataclasses.replace(
                        one, kv_transfer_params={"do_remote_decode": True}))
                    runs["prefill_ms"].append(elapsed)
                    start = time.perf_counter()
                    fetched = transfers.fetch(out.kv_transfer_params, length)
                    runs["fetch_ms"].append((time.perf_counter() - start) * 1000)
                    if "remote_kv_path" not in fetched:
                        raise RuntimeError("the transfer could not be fetched (the log says why)")
                    size = os.path.getsize(fetched["remote_kv_path"])
                    elapsed, out = timed(consumer, fresh[1], dataclasses.replace(one, kv_transfer_params=fetched))
                    if out.metrics.num_cached_tokens == 0:
                        raise RuntimeError("the decode engine did not adopt the transfer (the log says why)")
                    runs["remote_ms"].append(elapsed)
                    bar.update()
                row: dict[str, Any] = {"prompt_tokens": length, "transfer_bytes": size}
                row.update({k: round(statistics.median(v), 2) for k, v in runs.items()})
                row["transfer_ttft_ms"] = round(row["fetch_ms"] + row["remote_ms"], 2)
                row["fetch_gb_s"] = round(size / (row["fetch_ms"] / 1000) / 1e9, 2)
                row["ttft_local_over_transfer"] = round(row["local_ms"] / row["transfer_ttft_ms"], 2)
                rows.append(row)
    finally:
        for llm in (producer, consumer):
            llm.llm_engine.shutdown()
    emit({"model": consumer.llm_engine.source.path, "repeats": args.repeats, "rows": rows}, args.output_json)
    return 0
