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
# int4 is not a row of its own: the shipped Q4_1 blocks are int4 already, and stay as they are
CONFIGS = {"Q4_1 (shipped, default)": {}, "int8 (requantised from Q4_1)": dict(quantization="int8"),
           "float32 weights": dict(quantization="none", dtype="float32"),
           "bfloat16 weights": dict(quantization="none", dtype="bfloat16")}
TOKENS = 32


def hf_greedy(source, prompt_ids: list[list[int]]) -> list[list[int]]:
    """HF's argmax continuations of the same prompt token ids, never stopping at the end-of-sequence token
    (as `ignore_eos` does)."""
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(source.path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    out = []
    for ids in prompt_ids:
        tokens = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(TOKENS):
                tokens = torch.cat([tokens, model(tokens).logits[:, -1:].argmax(-1)], dim=1)
        out.append(tokens[0, len(ids):].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-batch-invariant", action="store_true")
    args = parser.parse_args()
    source = load_model_source(None)
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    rows, reference = [], None
    for label, options in CONFIGS.items():
        llm = LLM(batch_invariant=not args.no_batch_invariant, **options)
        outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        if reference is None:
            reference = hf_greedy(source, [o.prompt_token_ids for o in outputs])
        ours = [o.outputs[0].token_ids for o in outputs]
        common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), TOKENS) for x, y in zip(reference, ours)]
        rows.append(f"| {label} | {sum(common)} ({sum(common) / (TOKENS * len(PROMPTS)):.0%}) | {common} |")
        del llm
    print(f"| configuration | greedy tokens agreeing with HF float32 (of {TOKENS * len(PROMPTS)}) | per prompt |")
    print("|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
