"""Perplexity of models served by tokenmill on the shipped passages (tests/data/perplexity.txt and the
bench's quote passages), each against the first: the real-size checks of quantised checkpoints
(docs/benchmarks.md, "GPTQ and compressed-tensors checkpoints").

    .venv/bin/python scripts/checkpoint_perplexity.py MODEL[@OPTION=VALUE,...] ...

e.g. `smollm2-135m-instruct@quantization=none,dtype=float32 /tmp/gptq`: the first model is the baseline.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

from tokenmill import LLM  # noqa: E402
from tokenmill.bench.datasets import quote_passages  # noqa: E402
from tokenmill.bench.teacher_forced import teacher_forced  # noqa: E402


def perplexity(llm: LLM, text: str) -> float:
    """exp of the mean negative log-probability of the text's tokens after their prefixes."""
    return teacher_forced(llm, [llm.get_tokenizer().encode(text)])[0]


def main() -> None:
    texts = [(ROOT / "tests" / "data" / "perplexity.txt").read_text(), " ".join(quote_passages())]
    baseline = None
    for spec in sys.argv[1:]:
        model, _, options_text = spec.partition("@")
        options = dict(item.split("=", 1) for item in options_text.split(",") if item)
        llm = LLM(model, max_model_len=2048, **options)
        values = [perplexity(llm, text) for text in texts]
        baseline = baseline or values
        ratios = " ".join(f"{v / b:.4f}" for v, b in zip(values, baseline))
        print(f"{spec}: perplexity {' '.join(f'{v:.3f}' for v in values)}  ratio to the first {ratios}", flush=True)
        del llm


if __name__ == "__main__":
    main()
