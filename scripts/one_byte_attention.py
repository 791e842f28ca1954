"""Time the native decode attention over a bfloat16, an int8 and an fp8 KV cache holding the same tokens
(docs/benchmarks.md, "Quantised checkpoints and an FP8 KV cache"): one layer, 64 sequences of 320 tokens,
9 query heads over 3 KV heads of 64 (SmolLM2's), bfloat16 queries; the median of 30 calls each.

    .venv/bin/python scripts/one_byte_attention.py            # the best level this CPU runs
    TOKENMILL_CPU_CAPABILITY=avx2 .venv/bin/python scripts/one_byte_attention.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from tokenmill.attention.kv_quant import STORAGE, row_width, write_tokens  # noqa: E402
from tokenmill.kernels.cpu_kernels import cpu_kernels  # noqa: E402

SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, LENGTH = 64, 9, 3, 64, 16, 320


def main() -> None:
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the native kernels did not build here (no C compiler?)")
    torch.manual_seed(0)
    blocks = SEQS * LENGTH // BLOCK
    q = torch.randn(SEQS, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    tables = torch.arange(blocks, dtype=torch.int32).view(SEQS, -1)
    lengths = torch.full((SEQS,), LENGTH, dtype=torch.int32)
    rows = torch.arange(SEQS)
    keys, values = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM), torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM)
    caches = {"bfloat16": torch.stack([x.view(blocks, BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
                                       for x in (keys, values)]).bfloat16().contiguous()}
    for fmt in ("int8", "fp8"):
        cache = torch.zeros(2, blocks, KV_HEADS, BLOCK, row_width(HEAD_DIM), dtype=STORAGE[fmt])
        write_tokens(cache, torch.arange(blocks).repeat_interleave(BLOCK), torch.arange(BLOCK).repeat(blocks),
                     keys, values)
        caches[fmt] = cache
    print(f"level {kernels.level.name}")
    for name, cache in caches.items():
        times = []
        for _ in range(30):
            start = time.perf_counter()
            kernels.decode_attention(out, q, cache, rows, tables, lengths, HEAD_DIM ** -0.5)
            times.append(time.perf_counter() - start)
        print(f"{name:>9} cache: {statistics.median(times) * 1e3:.3f} ms per layer")


if __name__ == "__main__":
    main()
