"""Greedy agreement with HF transformers in float32, per weight format, on the default model.

For each configuration, 8 prompts decode 32 greedy tokens; the figure is how many of the first 32
agree with HF's before the texts part, summed over the prompts (of 256). Usage: .venv/bin/python scripts/greedy_agreement.py [--no-batch-invariant]
"""

from __future__ import annotations

import argparse
import os

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models.loader import load_model_source

PROMPTS = ["Write a short poem about the sea.", "The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "Explain how a bicycle works.", "1, 2, 3, 4,", "The best way to learn a language is",
           "Q: What is 12 * 7?\nA:"]
CONFIGS = {"Q4_1 (shipped, default)": {}, "int8 (requantised)": dict(quantization="int8"),
           "int4 (requantised)": dict(quantization="int4"), "float32 weights": dict(quantization="none", dtype="float32"),
           "bfloat16 weights": dict(quantization="none", dtype="bfloat16")}
TOKENS = 32


def hf_greedy(source) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(source.path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-batch-invariant", action="store_true")
    args = parser.parse_args()
    source = load_model_source(None)
    reference = hf_greedy(source)
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    print(f"| configuration | greedy tokens agreeing with HF float32 (of {TOKENS * len(PROMPTS)}) | per prompt |")
    print("|---|---|---|")
    for label, options in CONFIGS.items():
        llm = LLM(batch_invariant=not args.no_batch_invariant, **options)
        ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), TOKENS) for x, y in zip(reference, ours)]
        print(f"| {label} | {sum(common)} ({sum(common) / (TOKENS * len(PROMPTS)):.0%}) | {common} |", flush=True)
        del llm


if __name__ == "__main__":
    main()
