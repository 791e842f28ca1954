"""Seeded benchmark datasets: the same prompts for `bench serve` and `bench throughput`.

random: exact-length random token ids; shared-prefix: one common prefix + unique tails;
multi-turn: conversations whose turn k resends turn k-1 plus a reply and new tokens (serve only);
jsonl: one {"prompt": ...} object per line; quote: chat requests to repeat a shipped passage word for word
(a workload whose answers repeat their prompts, where speculative prompt lookup pays; throughput only).
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources
from typing import Any, Optional

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl", "quote")
QUOTE_INSTRUCTION = "Repeat the following text exactly, word for word.\n\n"


def add_dataset_args(p: argparse.ArgumentParser, datasets: tuple[str, ...] = DATASETS,
                     seed_flag: str = "--seed") -> None:
    """The dataset flags both benchmarks take (`seed_flag` names the seed where --seed means the engine's)."""
    p.add_argument("--dataset", choices=datasets, default="random",
                   help="random: --input-len random tokens; shared-prefix: one --prefix-len prefix shared by "
                        "all + --input-len unique tokens each; "
                        + ("multi-turn: --num-prompts conversations of --turns turns, each turn resending the "
                           "whole history plus --input-len new tokens; " if "multi-turn" in datasets else "")
                        + "jsonl: one {\"prompt\": ...} per line of --dataset-path"
                        + ("; quote: chat requests to repeat one of the shipped passages (ignores --input-len)"
                           if "quote" in datasets else "") + " (default: random)")
    if "multi-turn" in datasets:
        p.add_argument("--turns", type=int, default=4, help="turns per conversation for multi-turn (default: 4)")
    p.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=64, help="number of requests (default: 64)")
    p.add_argument("--input-len", type=int, default=256, help="random / unique tokens per prompt (default: 256)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens (default: 512)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: 128)")
    p.add_argument(seed_flag, dest="seed", type=int, default=0,
                   help="seed of the prompts (and arrivals); vary it for cold caches (default: 0)")


def quote_passages() -> list[str]:
    """The passages of the quote dataset (bench/quote_passages.txt, one per paragraph)."""
    text = resources.files("tokenmill.bench").joinpath("quote_passages.txt").read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def build_prompts(args: argparse.Namespace, vocab_size: int, tokenizer: Optional[Any] = None) -> list[Any]:
    """Token-id lists (random, shared-prefix), lists of turns (multi-turn) or strings (jsonl, quote).

    Ids are drawn from [min(1000, vocab/2), vocab) to stay clear of special tokens. quote formats its
    requests with `tokenizer`'s chat template (plain text when it has none).
    """
    rng = random.Random(args.seed)
    low = min(1000, vocab_size // 2)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        with open(args.dataset_path, encoding="utf-8") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        return prompts[:args.num_prompts]
    if args.dataset == "quote":
        passages = quote_passages()
        start = rng.randrange(len(passages))
        return [_chat_prompt(tokenizer, QUOTE_INSTRUCTION + passages[(start + i) % len(passages)])
                for i in range(args.num_prompts)]
    if args.dataset == "multi-turn":
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


def describe_dataset(args: argparse.Namespace, num_requests: int) -> dict[str, Any]:
    """The dataset settings a benchmark summary starts with."""
    return {"dataset": args.dataset, "num_prompts": num_requests, "input_len": args.input_len,
            "prefix_len": args.prefix_len if args.dataset != "random" else 0,
            "turns": args.turns if args.dataset == "multi-turn" else 1,
            "output_len": args.output_len, "seed": args.seed}


def _chat_prompt(tokenizer: Optional[Any], content: str) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return content + "\n\n"
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
