"""`tokenmill bench throughput`: offline generation speed on a seeded random dataset.

`--backend hf` runs Hugging Face transformers' `generate` on the same batch, so both figures come
from one run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from tokenmill.cli.bench_serve import add_bench_serve_parser
from tokenmill.cli.engine_args import add_engine_args, engine_kwargs


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench throughput`."""
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(kinds)
    p = kinds.add_parser("throughput", help="offline throughput on a seeded random dataset",
                         description="Generate for NUM_PROMPTS random prompts of INPUT_LEN tokens, "
                                     "OUTPUT_LEN tokens each (greedy, ignore_eos), and report tokens/s.")
    p.add_argument("--num-prompts", type=int, default=64, help="number of requests (default: 64)")
    p.add_argument("--input-len", type=int, default=256, help="prompt length in tokens (default: 256)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: 128)")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.add_argument("--backend", choices=("tokenmill", "hf"), default="tokenmill",
                   help="tokenmill, or HF transformers generate() as a baseline (default: tokenmill)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="batch size of the hf backend (default: 64)")
    p.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run_throughput)


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded random token-id prompts of exactly `length` tokens (ids kept clear of special tokens)."""
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]


def run_throughput(args: argparse.Namespace) -> int:
    """Run the benchmark and print (and optionally save) the figures."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args))))
    prompts = random_prompts(args.num_prompts, args.input_len, llm.llm_engine.arch.vocab_size, args.dataset_seed)
    if args.backend == "hf":
        elapsed = _run_hf(llm.llm_engine, prompts, args.output_len, args.hf_batch_size)
    else:
        elapsed = _run_tokenmill(llm, prompts, args.output_len)
    result = _figures(args, elapsed)
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _run_tokenmill(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    from tokenmill.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def _run_hf(engine: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> float:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    path = engine.source.path
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=engine.dtype)
    else:
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=engine.dtype)
    model.eval()
    started = time.perf_counter()
    with torch.inference_mode():
        for i in tqdm(range(0, len(prompts), batch_size), desc="hf generate", file=sys.stderr):
            ids = torch.tensor(prompts[i:i + batch_size])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + output_len
    return time.perf_counter() - started


def _figures(args: argparse.Namespace, elapsed: float) -> dict[str, Any]:
    n, inp, out = args.num_prompts, args.input_len, args.output_len
    return {
        "backend": args.backend, "num_prompts": n, "input_len": inp, "output_len": out,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(n / elapsed, 3),
        "output_tokens_per_s": round(n * out / elapsed, 1),
        "total_tokens_per_s": round(n * (inp + out) / elapsed, 1),
    }
