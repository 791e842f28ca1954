"""`tokenmill bench throughput`: engine-only speed, in-process, on the same seeded datasets as `bench serve`.

`--backend hf` runs Hugging Face transformers' `generate` on the same batch, so both figures come
from one run on the same machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

from tokenmill.bench import linear_products
from tokenmill.bench.datasets import add_dataset_args, build_prompts, describe_dataset
from tokenmill.bench.linear_products import add_linear_products_args, run_linear_products
from tokenmill.bench.report import RequestResult, emit, own_peak_rss_gib, summarise
from tokenmill.cli import bench_images as images
from tokenmill.cli import bench_kv_transfer as kv_transfer
from tokenmill.cli.bench_serve import add_bench_serve_parser
from tokenmill.cli.engine_args import add_engine_args, engine_kwargs


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench throughput`, `bench serve`, `bench linears`, `bench kv-transfer` and
    `bench images`."""
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(kinds)
    linears = kinds.add_parser("linears", help="time the ways to multiply a model's projections, by input rows",
                               description=linear_products.__doc__)
    add_linear_products_args(linears)
    linears.set_defaults(func=run_linear_products)
    transfer = kinds.add_parser("kv-transfer", help="a prefill/decode transfer over TCP on loopback: GB/s, and "
                                "the decode server's TTFT with it against a local prefill",
                                description=kv_transfer.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kv_transfer.add_kv_transfer_args(transfer)
    transfer.set_defaults(func=kv_transfer.run_kv_transfer)
    vision = kinds.add_parser("images", help="a vision-language model's one-image prompts: TTFT cold, cached and "
                              "against text of the same length, and images/s through the vision encoder",
                              description=images.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    images.add_bench_images_args(vision)
    vision.set_defaults(func=images.run_bench_images)
    p = kinds.add_parser("throughput", help="offline, in-process throughput on a seeded dataset",
                         description="Generate OUTPUT_LEN tokens (greedy, ignore_eos) for every prompt of the "
                                     "dataset, all submitted at once, and report tokens/s and latencies.")
    add_dataset_args(p, datasets=("random", "shared-prefix", "jsonl", "quote"), seed_flag="--dataset-seed")
    p.add_argument("--backend", choices=("tokenmill", "hf"), default="tokenmill",
                   help="tokenmill, or HF transformers generate() as a baseline (default: tokenmill)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="batch size of the hf backend (default: 64)")
    p.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    p.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure this machine's read bandwidth and arithmetic peak (about a second) and report "
                        "how near the decode and prefill steps came to them: peak_read_gbps, achieved_read_gbps, "
                        "peak_gflops, achieved_gflops (tokenmill/bench/roofline.py says how each is counted; CPU "
                        "runs only) (default: on)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (with --enable-lora) the prompts take in turn, round robin; the cost of "
                        "serving them is this run against one without (scripts/random_loras.py writes some)")
    add_engine_args(p)
    p.set_defaults(func=run_throughput)


def run_throughput(args: argparse.Namespace) -> int:
    """Run the benchmark and print (and optionally save) the figures."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args))))
    engine = llm.llm_engine
    prompts = build_prompts(args, engine.arch.vocab_size, engine.tokenizer)
    prompts = [engine.tokenize(p) if isinstance(p, str) else p for p in prompts]
    if args.backend == "hf":
        elapsed = _run_hf(engine, prompts, args.output_len, args.hf_batch_size)
        results = [RequestResult(ok=True, prompt_tokens=len(p), output_tokens=args.output_len) for p in prompts]
    else:
        adapters = _adapters(args.lora_modules)
        steps = None
        if args.roofline:
            from tokenmill.bench.roofline import StepLog
            steps = StepLog.attach(engine)
        results, elapsed = _run_tokenmill(llm, prompts, args.output_len,
                                          [adapters[i % len(adapters)] for i in range(len(prompts))] if adapters else None)
    summary = {"backend": args.backend, **describe_dataset(args, len(prompts)),
               "dtype": str(engine.dtype).replace("torch.", ""),
               **({"lora_adapters": len(args.lora_modules)} if args.lora_modules else {}),
               **summarise(results, elapsed), "peak_rss_gib": round(own_peak_rss_gib(), 3)}
    if args.backend == "tokenmill" and steps is not None:
        from tokenmill.bench.roofline import roofline
        summary.update(roofline(engine, steps))
    if engine.speculation is not None:
        summary["speculative"] = describe_speculation(engine)
    if args.backend == "hf":
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            summary.pop(key)  # one batched generate() call has no per-request latencies
    emit(summary, args.output_json)
    return 0


def describe_speculation(engine: Any) -> dict[str, Any]:
    """The speculative settings and what they achieved: rounds, proposed and accepted tokens, rates."""
    spec, totals = engine.config.speculative, engine.stats().spec
    rounds = max(1, totals.num_rounds)
    return {"method": spec.speculative_method, "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_model": spec.draft_model, "draft_num_layers": spec.draft_num_layers,
            "rounds": totals.num_rounds, "draft_tokens": totals.draft_tokens,
            "accepted_tokens": totals.accepted_tokens,
            "acceptance_rate": round(totals.accepted_tokens / max(1, totals.draft_tokens), 4),
            "mean_acceptance_length": round(1 + totals.accepted_tokens / rounds, 3),
            # of the rounds that proposed a j-th token, the share that accepted it
            "acceptance_per_position": [round(accepted / drafted, 4) for accepted, drafted in
                                        zip(totals.accepted_per_position, totals.drafted_per_position)]}


def _adapters(modules: Optional[list[str]]) -> list[Any]:
    """LoRARequests of `--lora-modules` entries."""
    from tokenmill.lora.request import LoRARequest
    from tokenmill.server.lora_routes import parse_lora_modules
    return [LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(parse_lora_modules(modules))]


def _run_tokenmill(llm: Any, prompts: list[list[int]], output_len: int,
                   adapters: Optional[list[Any]] = None) -> tuple[list[RequestResult], float]:
    from tokenmill.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True, lora_request=adapters)
    elapsed = time.perf_counter() - started
    results = []
    for output in outputs:
        m = output.metrics
        tokens = len(output.outputs[0].token_ids)
        assert tokens == output_len, f"a request produced {tokens} of {output_len} tokens"
        results.append(RequestResult(ok=True, prompt_tokens=len(output.prompt_token_ids), output_tokens=tokens,
                                     ttft=m.first_token_time - m.arrival_time,
                                     e2e=m.finished_time - m.arrival_time))
    return results, elapsed


def _run_hf(engine: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> float:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("--backend hf needs prompts of one length (the random or shared-prefix dataset)")
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
