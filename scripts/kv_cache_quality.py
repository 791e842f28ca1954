"""Perplexity and top-1 agreement of the default model served with one-byte KV caches against the bfloat16
(compute dtype) cache, teacher-forced (prompt logprobs) over a larger text than the test's: the quote
passages, tests/data/perplexity.txt and the paragraphs of docs/*.md (over 200 characters, at most 512
tokens each, 400 in all). docs/benchmarks.md, "Quantised checkpoints and an FP8 KV cache", quotes it.

    .venv/bin/python scripts/kv_cache_quality.py            # auto int8 fp8
    .venv/bin/python scripts/kv_cache_quality.py auto fp8
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tokenmill import LLM  # noqa: E402
from tokenmill.bench.teacher_forced import teacher_forced  # noqa: E402


def passages() -> list[str]:
    texts = (ROOT / "src" / "tokenmill" / "bench" / "quote_passages.txt").read_text().split("\n\n")
    texts += (ROOT / "tests" / "data" / "perplexity.txt").read_text().split("\n\n")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        texts += doc.read_text().split("\n\n")
    return [text for text in texts if len(text) > 200][:400]


def score(kv_cache_dtype: str, texts: list[str]) -> tuple[float, list[int]]:
    """(perplexity, each position's top-1 token) of the texts with this cache."""
    llm = LLM(None, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=2048)
    tokenizer = llm.get_tokenizer()
    scores = teacher_forced(llm, [tokenizer(text).input_ids[:512] for text in texts])
    llm.shutdown()
    return scores


def main() -> None:
    formats = sys.argv[1:] or ["auto", "int8", "fp8"]
    texts = passages()
    results = {}
    for kv_cache_dtype in formats:
        results[kv_cache_dtype] = score(kv_cache_dtype, texts)
        print(f"scored --kv-cache-dtype {kv_cache_dtype}", file=sys.stderr, flush=True)
    base, base_best = results[formats[0]]
    for kv_cache_dtype, (ppl, best) in results.items():
        agreement = sum(a == b for a, b in zip(best, base_best)) / len(best)
        print(f"{kv_cache_dtype:>9}: perplexity {ppl:.4f} ({ppl / base - 1:+.2%} against {formats[0]}), "
              f"top-1 agreement {agreement:.1%}, {len(best)} tokens")


if __name__ == "__main__":
    main()
