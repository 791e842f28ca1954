"""Train a small EAGLE-3 draft head for a target model on this repository's own text, on CPU, in minutes, and
measure what it achieves in tokenmill's engine on held-out text.

Steps (each shows its progress):
  1. the repository's README, docs/*.md and src/**/*.py, split by file into training and held-out files
     (a fixed hash of each path; --held-out-fraction of them held out);
  2. the target (in tokenmill's own engine, as it runs when serving) reads windows of training text and
     continues each greedily; every position's residual stream entering the three layers EAGLE-3 taps
     (tokenmill's default: 2, L/2, L-3), final hidden state and greedy next token are kept;
  3. the draft vocabulary: the --draft-vocab tokens the target predicts most often there (d2t/t2d maps);
  4. the head (one Llama layer, the target's layer shape, reading the target's embedding table, its lm_head
     started from the target's rows) is trained (float32 weights, bfloat16 products) against the target's
     next-token distributions and greedy tokens, with SpecForge's training-time test: each position is
     unrolled --ttt-steps times, each step fed the head's own previous output, as it proposes when serving;
  5. the head is written to --out (default: tokenmill's cache folder, never the repository) in the layout
     vLLM and SpecForge use (config.json LlamaForCausalLMEagle3 + model.safetensors), with
     held_out_prompts.jsonl and training_report.json beside it;
  6. on held-out windows, tokenmill's engine runs greedy continuations with the head (eagle3) and without
     speculation: whether they are identical, the mean acceptance length and the acceptance per position,
     beside the same figures predicted by replaying the rounds with the training-time head.

    .venv/bin/python scripts/train_eagle3.py     # the default model: minutes on 2 cores (19 under load)
    .venv/bin/tokenmill bench throughput --dataset jsonl --dataset-path HEAD/held_out_prompts.jsonl \\
        --num-prompts 8 --output-len 128 --max-num-seqs 1 \\
        --speculative-config '{"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3_training.collect import collect_target_states
from eagle3_training.corpus import split_files, token_windows
from eagle3_training.head import HeadShape, TrainableEagle3Head
from eagle3_training.measure import measure_acceptance
from eagle3_training.train import train_head

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (every flag has its default in its help)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="the target: an alias, GGUF file or HF folder (default: tokenmill's default model)")
    p.add_argument("--dtype", default="auto", help="the target's compute dtype in tokenmill (default: auto)")
    p.add_argument("--quantization", default="auto", help="the target's quantization in tokenmill (default: auto)")
    p.add_argument("--repo", type=Path, default=REPO,
                   help="the repository whose text is read (default: the one holding this script)")
    p.add_argument("--out", type=Path, default=None,
                   help="the folder the head is written to (default: <tokenmill cache>/eagle3/<model name>)")
    p.add_argument("--layers", type=int, nargs=3, default=None, metavar="LAYER",
                   help="the three target layers whose entering residual stream the head reads (default: "
                        "tokenmill's and vLLM's default for a head without eagle_aux_hidden_state_layer_ids: "
                        "2, L // 2, L - 3 of a target of L layers)")
    p.add_argument("--held-out-fraction", type=float, default=0.2,
                   help="the share of the files held out for measuring (default: 0.2)")
    p.add_argument("--window", type=int, default=192, help="tokens of text per sequence (default: 192)")
    p.add_argument("--continuation", type=int, default=32,
                   help="greedy tokens the target adds after each training window (its own text, which a draft "
                        "meets when serving); 0: the text alone (default: 32)")
    p.add_argument("--train-sequences", type=int, default=192, help="training windows (default: 192)")
    p.add_argument("--collect-batch", type=int, default=64,
                   help="windows the target runs together while collecting (default: 64)")
    p.add_argument("--draft-vocab", type=int, default=4096,
                   help="tokens the head can propose: the target's most frequent predictions on the training "
                        "text; 0: the whole vocabulary (default: 4096)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: the target's)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time test: steps each position is unrolled, feeding the head its own outputs "
                        "(1: step-1 training only) (default: 3)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training sequences (default: 3)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per update (default: 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam's peak learning rate (default: 0.002)")
    p.add_argument("--greedy-weight", type=float, default=1.0,
                   help="weight of the cross-entropy of the target's greedy token beside the soft cross-entropy "
                        "against its distribution (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seeds the windows' draw, the head and the order (default: 0)")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own choice)")
    p.add_argument("--eval-sequences", type=int, default=16,
                   help="held-out windows the acceptance is measured on (default: 16)")
    p.add_argument("--eval-output-len", type=int, default=128,
                   help="greedy tokens generated after each held-out window (default: 128)")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="proposals per round when measuring (default: 3)")
    p.add_argument("--no-measure", action="store_true", help="write the head without measuring it")
    return p.parse_args(argv)


def log(message: str) -> None:
    """A progress line, shown at once."""
    print(message, flush=True)


def default_out(model: Optional[str]) -> Path:
    """<tokenmill cache>/eagle3/<the model's file or folder name, or the default model's alias>."""
    from tokenmill.envs import cache_root
    from tokenmill.models.loader.resolve import DEFAULT_MODEL

    name = Path(model).stem if model else DEFAULT_MODEL
    return cache_root() / "eagle3" / name


def draft_vocabulary(states, vocab: int, size: int) -> torch.Tensor:
    """The draft vocabulary (target ids, ascending): the `size` tokens the target predicts most often in
    `states` (ties: the lower id); the whole vocabulary when `size` is 0 or covers it."""
    if size <= 0 or size >= vocab:
        return torch.arange(vocab)
    counts = torch.bincount(torch.cat([s.greedy for s in states]), minlength=vocab).float()
    counts -= torch.arange(vocab) / vocab  # ties broken by id, deterministically
    return torch.topk(counts, size).indices.sort().values


@torch.inference_mode()
def target_tables(model: Any, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding table [vocab, hidden] and LM-head rows [vocab, hidden] in float32 on the CPU, as the
    engine computes them (a quantised table is read through its own kernels: the rows are the logits of the
    identity's rows); ValueError for logits that are not a linear function of the final state (a soft cap)."""
    if model.arch.final_logit_softcap is not None:
        raise ValueError("targets whose logits are soft-capped are not supported by this script")
    embedding = model.embed(torch.arange(vocab, device=device)).float().cpu()
    rows = model.compute_logits(torch.eye(hidden, dtype=dtype, device=device)).T.float().cpu().contiguous()
    return embedding, rows


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Train, write and measure a head; returns the report written beside it."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill import LLM
    from tokenmill.models.eagle3 import aux_layer_ids

    started = time.perf_counter()
    out = args.out or default_out(args.model)
    if out.resolve().is_relative_to(args.repo.resolve()):
        raise ValueError(f"--out {out} lies inside the repository {args.repo}: heads are never committed")
    max_len = args.window + max(args.continuation, args.eval_output_len) + args.num_speculative_tokens + 8
    engine_options = dict(dtype=args.dtype, quantization=args.quantization, max_model_len=max_len, seed=args.seed)
    log(f"target {args.model or 'the default model'}: loading")
    plain = LLM(args.model, **engine_options, prefix_caching=False)
    engine = plain.llm_engine
    arch, tokenizer = engine.arch, engine.tokenizer
    layers = aux_layer_ids({"eagle_aux_hidden_state_layer_ids": args.layers}, arch.num_hidden_layers)
    train_files, held_out_files = split_files(args.repo, args.held_out_fraction)
    log(f"text: {len(train_files)} training files, {len(held_out_files)} held out; taps of layers {list(layers)}")
    windows = token_windows(train_files, tokenizer, args.window, args.train_sequences, args.seed)
    states = collect_target_states(plain, layers, windows, args.continuation, args.collect_batch, log)
    draft_ids = draft_vocabulary(states, arch.vocab_size, args.draft_vocab)
    target_to_draft = torch.full((arch.vocab_size,), -1, dtype=torch.long)
    target_to_draft[draft_ids] = torch.arange(len(draft_ids))
    coverage = float((target_to_draft[torch.cat([s.greedy for s in states])] >= 0).float().mean())
    log(f"draft vocabulary: {len(draft_ids)} tokens, covering {coverage:.1%} of the target's training predictions")
    embedding, rows = target_tables(engine.runner.model, arch.vocab_size, arch.hidden_size, engine.dtype,
                                     engine.device)
    shape = HeadShape(arch.hidden_size, args.intermediate_size or arch.intermediate_size, arch.num_attention_heads,
                      arch.num_key_value_heads, arch.head_dim, arch.vocab_size, len(draft_ids), arch.hidden_size,
                      layers, arch.rope_theta, arch.rms_norm_eps, max(arch.max_position_embeddings, max_len))
    torch.manual_seed(args.seed)
    head = TrainableEagle3Head(shape, draft_ids)
    with torch.no_grad():  # the head starts from the target's own LM head over its vocabulary
        head.lm_head.weight.copy_(rows[draft_ids])
    log(f"training: {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters, {len(states)} sequences, "
        f"{args.ttt_steps} training-time-test steps, {args.epochs} epochs")
    train_started = time.perf_counter()
    accuracy = train_head(head, states, embedding, rows[draft_ids], target_to_draft, args.ttt_steps, args.epochs,
                          args.batch_size, args.lr, args.greedy_weight, args.seed, log)
    train_seconds = time.perf_counter() - train_started
    head.save(out)
    held_out = token_windows(held_out_files, tokenizer, args.window, args.eval_sequences, args.seed)
    with open(out / "held_out_prompts.jsonl", "w", encoding="utf-8") as f:
        for window in held_out:
            f.write(json.dumps({"prompt": tokenizer.decode(window)}) + "\n")
    log(f"head written to {out}")
    report: dict[str, Any] = {
        "model": args.model or "default", "layers": list(layers), "draft_vocab": len(draft_ids),
        "draft_vocab_coverage": round(coverage, 4), "train_sequences": len(states),
        "train_positions": sum(len(s.taps) for s in states), "ttt_steps": args.ttt_steps, "epochs": args.epochs,
        "train_seconds": round(train_seconds, 1),
        "train_accuracy_per_step": [round(a, 4) for a in accuracy]}
    if not args.no_measure:
        log(f"measuring on {len(held_out)} held-out windows, {args.eval_output_len} tokens each, "
            f"k = {args.num_speculative_tokens}")
        figures = measure_acceptance(plain, args.model, out, head, layers, held_out, args.eval_output_len,
                                     args.num_speculative_tokens, engine_options, embedding, target_to_draft, log)
        engine_rounds, predicted = figures.engine, figures.predicted
        report.update({"held_out_windows": len(held_out), "eval_output_len": args.eval_output_len,
                       "num_speculative_tokens": args.num_speculative_tokens,
                       "identical_to_no_speculation": figures.identical, "rounds": engine_rounds.count,
                       "mean_acceptance_length": round(engine_rounds.mean_acceptance_length, 3),
                       "acceptance_per_position": [round(a, 4) for a in engine_rounds.per_position],
                       "predicted_rounds": predicted.count,
                       "predicted_mean_acceptance_length": round(predicted.mean_acceptance_length, 3),
                       "predicted_acceptance_per_position": [round(a, 4) for a in predicted.per_position],
                       "seconds_plain": round(figures.seconds_plain, 2),
                       "seconds_speculative": round(figures.seconds_speculative, 2)})
        log(f"held out: mean acceptance length {engine_rounds.mean_acceptance_length:.2f} over "
            f"{engine_rounds.count} rounds (predicted from training: {predicted.mean_acceptance_length:.2f}), "
            f"per position {[round(a, 3) for a in engine_rounds.per_position]}, greedy output identical to no "
            f"speculation: {figures.identical}")
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
