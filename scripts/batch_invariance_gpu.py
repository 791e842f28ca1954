"""Issue 59 item 5 on a GPU: `--batch-invariant` on CUDA. Writes OUT_DIR/batch-invariance.json:

- identity: on a Llama-3.2-1B-shaped random-weight model in bfloat16, the greedy ids and logprobs of four
  target prompts run alone (batch 1), among 7 and among 64 prompts of mixed lengths, with batch invariance
  on (they must be equal bit for bit) and off (how many differ: what invariance fixes);
- cost: a burst of 256 prompts (512 tokens in, 128 out) through `LLM.generate`, tokens per second with
  invariance on and off in the order A B B A, their ratio (the issue defaults it on for CUDA only if it
  costs <= 10% of the burst throughput), and the decode step at batch 1 and 64 and a 2,048-token TTFT for both.

  python scripts/batch_invariance_gpu.py OUT_DIR [--tokenizer DIR]      (on the GPU machine)
  python scripts/batch_invariance_gpu.py OUT_DIR --dry-run               (CPU, Triton's interpreter, tiny shapes)

Reuses scripts/gpu_check.py's model writer, engine options and timers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import (LLAMA32_1B, TINY, decode_step_seconds, free_memory, log, make_llm,  # noqa: E402
                       random_prompts, save_default_tokenizer, timed_generate, write_model)

# the dry run's model: TINY with a 256-token vocabulary (the interpreter runs every LM-head tile in Python)
DRY = {**TINY, "vocab_size": 256}


def engine(path: Path, device: str, dry: bool, invariant: bool) -> Any:
    """The 1B engine in bfloat16 (float32 in a dry run) with batch invariance `invariant`."""
    return make_llm(path, device, dry, dtype="float32" if dry else "bfloat16", batch_invariant=invariant,
                    max_num_seqs=64 if not dry else 8, **({"block_size": 8} if dry else {}))


def records(llm: Any, prompts: list[list[int]], tokens: int) -> list[tuple]:
    """Each prompt's greedy ids and per-token (id, logprob) of its chosen token and top alternative."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    out = []
    for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        c = o.outputs[0]
        out.append((tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in s.items()))
                                               for s in c.logprobs)))
    return out


def identity(path: Path, device: str, dry: bool, vocab: int) -> dict[str, Any]:
    """For invariance on and off: how many of the targets' records differ from alone in a batch of 7 and 64."""
    sizes = (3, 7) if dry else (7, 64)
    tokens = 3 if dry else 32
    lengths = [5, 17, 2, 11] if dry else [37, 512, 3, 1200]
    targets = [random_prompts(1, n, 10 + i, vocab)[0] for i, n in enumerate(lengths)]
    others = [random_prompts(1, 3 + (97 * i) % (40 if dry else 1500), 100 + i, vocab)[0] for i in range(max(sizes))]
    result: dict[str, Any] = {}
    for invariant in (True, False):
        llm = engine(path, device, dry, invariant)
        alone = [records(llm, [t], tokens)[0] for t in targets]
        differ = {}
        for size in sizes:
            count = 0
            for k, target in enumerate(targets):  # the target at a different place in each batch
                batch = others[:size - 1]
                place = (k * 5) % size
                got = records(llm, batch[:place] + [target] + batch[place:], tokens)[place]
                count += got != alone[k]
            differ[f"batch_{size}"] = count
        result["invariant" if invariant else "not_invariant"] = {"targets": len(targets), "differing": differ}
        llm.shutdown()
        del llm
        free_memory()
    result["invariant_identical"] = all(v == 0 for v in result["invariant"]["differing"].values())
    return result


def cost(path: Path, device: str, dry: bool, vocab: int) -> dict[str, Any]:
    """Burst tok/s invariant and not (A B B A), their ratio, decode steps and TTFT of both."""
    count, length, out_len = (4, 12, 3) if dry else (256, 512, 128)
    burst = random_prompts(count, length, 7, vocab)
    runs: dict[bool, list[float]] = {True: [], False: []}
    details: dict[str, Any] = {}
    for invariant in (True, False, False, True):
        llm = engine(path, device, dry, invariant)
        timed_generate(llm, random_prompts(4, length, 99, vocab), 4, device)  # warm-up (compiles); no shared prefix
        seconds = timed_generate(llm, burst, out_len, device)
        runs[invariant].append(count * out_len / seconds)
        name = "invariant" if invariant else "not_invariant"
        if name not in details:
            steps, ctx = (2, 8) if dry else (32, 512)
            details[name] = {
                "decode_bs1_step_ms": round(decode_step_seconds(llm, random_prompts(1, ctx, 2, vocab), steps, device,
                                                                1 if dry else 3) * 1e3, 3),
                "decode_bs64_step_ms": round(decode_step_seconds(llm, random_prompts(8 if dry else 64, ctx, 3, vocab),
                                                                 steps, device, 1 if dry else 3) * 1e3, 3),
                "ttft_2048_ms": round(timed_generate(llm, random_prompts(1, 16 if dry else 2048, 4, vocab), 1,
                                                     device) * 1e3, 2)}
        llm.shutdown()
        del llm
        free_memory()
    on, off = statistics.mean(runs[True]), statistics.mean(runs[False])
    return {"burst": f"{count} x {length} in / {out_len} out", "tok_s_invariant": [round(r, 1) for r in runs[True]],
            "tok_s_not_invariant": [round(r, 1) for r in runs[False]], "ratio_invariant_over_not": round(on / off, 3),
            "within_10_percent": on >= 0.9 * off, **details}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    parser.add_argument("--tokenizer", default=None, help="folder of tokenizer files (default: SmolLM2's)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["identity", "cost"])
    args = parser.parse_args()
    if args.dry_run:
        from tokenmill import envs
        envs.interpret_triton()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.dry_run else "cuda"
    work = out_dir / "work"
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else save_default_tokenizer(work / "tokenizer")
    config = DRY if args.dry_run else LLAMA32_1B
    path = write_model(work / "m1b", config, tokenizer_dir, device)
    result: dict[str, Any] = {"dry_run": args.dry_run}
    for name, step in (("identity", identity), ("cost", cost)):
        if name in args.skip:
            continue
        log(f"{name} ...")
        result[name] = step(path, device, args.dry_run, config["vocab_size"])
        log(f"{name}: {json.dumps(result[name])}")
        (out_dir / "batch-invariance.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
