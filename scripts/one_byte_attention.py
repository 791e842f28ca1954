"""Time the native attention and cache writes over a bfloat16, an int8 and an fp8 KV cache holding the same
tokens (docs/benchmarks.md, "Quantised checkpoints and an FP8 KV cache"), one layer of SmolLM2's shape
(9 query heads over 3 KV heads of 64), bfloat16 queries, the median of 30 calls each:

- decode: 64 sequences of 320 tokens, one query each;
- prefill: 16 sequences whose 256 prompt tokens attend as one chunk each (every query as the kernels take
  it: on AMX with a bfloat16 cache the prefill tiles, else the query tiles);
- writes: 4096 tokens' K and V stored at scattered slots.

    .venv/bin/python scripts/one_byte_attention.py            # the best level this CPU runs
    TOKENMILL_CPU_CAPABILITY=avx2 .venv/bin/python scripts/one_byte_attention.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from tokenmill.attention.kv_quant import STORAGE, row_width, write_tokens  # noqa: E402
from tokenmill.kernels.cpu_kernels import cpu_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
FORMATS = ("bfloat16", "int8", "fp8")


def median_ms(call: Callable[[], object], runs: int = 30) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def caches(seqs: int, length: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same random K/V of `seqs` sequences of `length` tokens in each cache format, and the block tables."""
    blocks = seqs * length // BLOCK
    keys, values = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM), torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM)
    out = {"bfloat16": torch.stack([x.view(blocks, BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
                                    for x in (keys, values)]).bfloat16().contiguous()}
    for fmt in FORMATS[1:]:
        cache = torch.zeros(2, blocks, KV_HEADS, BLOCK, row_width(HEAD_DIM), dtype=STORAGE[fmt])
        write_tokens(cache, torch.arange(blocks).repeat_interleave(BLOCK), torch.arange(BLOCK).repeat(blocks),
                     keys, values)
        out[fmt] = cache
    return out, torch.arange(blocks, dtype=torch.int32).view(seqs, -1)


def main() -> None:
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the native kernels did not build here (no C compiler?)")
    torch.manual_seed(0)
    scale = HEAD_DIM ** -0.5
    print(f"level {kernels.level.name}")

    seqs, length = 64, 320
    decode_caches, tables = caches(seqs, length)
    q = torch.randn(seqs, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    rows, lengths = torch.arange(seqs), torch.full((seqs,), length, dtype=torch.int32)
    chunks = torch.tensor([list(range(seqs)), [1] * seqs, [length] * seqs])
    for name, cache in decode_caches.items():
        ms = median_ms(lambda: kernels.decode_attention(out, q, cache, rows, tables, lengths, scale))
        line = f"decode  {name:>8} cache: {ms:.3f} ms per layer"
        if name == "bfloat16" and kernels.amx:
            amx = median_ms(lambda: kernels.prefill_attention(out, q, cache, chunks, tables, scale))
            line += f" (AMX prefill tiles, as the engine runs it: {amx:.3f} ms)"
        print(line)

    seqs, length = 16, 256
    prefill_caches, tables = caches(seqs, length)
    q = torch.randn(seqs * length, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    rows = torch.arange(seqs * length)
    query_tables = tables.repeat_interleave(length, 0).contiguous()
    positions = (torch.arange(length, dtype=torch.int32) + 1).repeat(seqs)
    chunks = torch.tensor([[s * length for s in range(seqs)], [length] * seqs, [length] * seqs])
    for name, cache in prefill_caches.items():
        if name == "bfloat16" and kernels.amx:
            ms = median_ms(lambda: kernels.prefill_attention(out, q, cache, chunks, tables, scale))
            print(f"prefill {name:>8} cache: {ms:.3f} ms per layer (AMX prefill tiles)")
            continue
        ms = median_ms(lambda: kernels.decode_attention(out, q, cache, rows, query_tables, positions, scale))
        print(f"prefill {name:>8} cache: {ms:.3f} ms per layer")

    tokens = 4096
    k, v = torch.randn(tokens, KV_HEADS, HEAD_DIM).bfloat16(), torch.randn(tokens, KV_HEADS, HEAD_DIM).bfloat16()
    slots = torch.randperm(tokens)
    for name, cache in caches(1, tokens)[0].items():
        print(f"writes  {name:>8} cache: {median_ms(lambda: kernels.cache_write(cache, k, v, slots)):.3f} ms per layer")


if __name__ == "__main__":
    main()
