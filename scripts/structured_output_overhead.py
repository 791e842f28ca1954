"""The runner's per-step grammar work (mask + advance) at batch 1 and 16: what constrained decoding adds per token.

Run: .venv/bin/python scripts/structured_output_overhead.py
"""
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the SmolLM2 tokenizer helper
from helpers.tiny_models import smollm2_tokenizer
from tokenmill.structured.compiler import GrammarCache
from tokenmill.structured.matchers import GrammarMatchers
from tokenmill.structured.spec import StructuredOutput
from tokenmill.sampling.sampler import sample
from tokenmill.sampling.batch import SamplingRow
from tokenmill.sampling_params import SamplingParams
tok = smollm2_tokenizer()
cache = GrammarCache(tok, 49152, (2,))
spec = StructuredOutput.json_schema({"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]})
word = tok(" dragon", add_special_tokens=False).input_ids
for batch in (1, 16):
    gm = GrammarMatchers(cache)
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        gm._matcher(rid, spec); gm.advance(rid, tok('{"story": "Once', add_special_tokens=False).input_ids)
    logits = torch.randn(batch, 49152)
    rows = [SamplingRow(SamplingParams(temperature=0), None, [1], [], (2,)) for _ in ids]

    def plain():
        return sample(logits, rows)

    def masked():
        m = logits.clone()
        gm.mask(m, [(i, rid, spec, []) for i, rid in enumerate(ids)])
        tokens = sample(m, rows)
        for rid in ids:
            gm.advance(rid, word)  # a token inside the string, as decoding a long story would
        return tokens
    res = []
    for _ in range(5):
        for f in (plain, masked):
            f(); t = time.perf_counter()
            for _ in range(200): f()
            res.append((f.__name__, (time.perf_counter() - t) / 200 * 1e6))
    p = statistics.median(v for n, v in res if n == "plain"); m = statistics.median(v for n, v in res if n == "masked")
    print(f"batch {batch}: sampling {p:.0f} us/step, with grammar {m:.0f} us/step: +{m - p:.0f} us/step, +{(m - p) / batch:.0f} us per token")
