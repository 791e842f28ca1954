"""How fast each way of multiplying a model's projections is, by number of input rows.

`tokenmill bench linears` times, for every row count asked, the projections of all layers of a
model shaped like SmolLM2-135M, with distinct random weights, so that each pass
reads them from memory as a decode step does: oneDNN-packed bfloat16, the quantised int8 dot-product
kernel and the dequantise-then-matmul path, for int8 and int4 weights. It prints the median of the
repetitions in milliseconds. This is where `DEQUANTIZE_FROM_ROWS` comes from (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
from tqdm import tqdm

from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.layers import quantized
from tokenmill.layers.linear_kernels import OneDnnPackedKernel

# SmolLM2-135M: qkv, o, gate_up, down as (out_features, in_features)
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _time_passes(layers: list[list[Callable]], rows: int, repeats: int) -> float:
    inputs = [torch.randn(rows, shape[1]).bfloat16() for shape in SMOLLM2_SHAPES]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for products in layers:
            for product, x in zip(products, inputs):
                product(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def add_linear_products_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `tokenmill bench linears`."""
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256],
                        help="input row counts to time (default: 1 4 16 64 256)")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of weights (default: 30)")
    parser.add_argument("--repeats", type=int, default=10, help="passes per measurement; the median is shown "
                        "(default: 10)")


def run_linear_products(args: argparse.Namespace) -> int:
    """Build the weights and print one line of milliseconds per row count."""
    kernels = cpu_kernels()
    if kernels is None:
        print("the native kernels could not be built (see the warning above)", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    floats = [[torch.randn(shape) * 0.02 for shape in SMOLLM2_SHAPES]
              for _ in tqdm(range(args.layers), desc="weights", file=sys.stderr)]
    packed = [[OneDnnPackedKernel(w.bfloat16(), None) for w in layer] for layer in floats]
    ops = {fmt: [[kernels.qlinear_op(quantized.quantize(w, fmt), None) for w in layer] for layer in floats]
           for fmt in quantized.FORMATS}
    threshold = quantized.DEQUANTIZE_FROM_ROWS
    print(f"{'rows':>5} {'bf16 packed':>12} " + " ".join(f"{f + ' ' + p:>16}" for f in ops for p in ("dot", "dequant")))
    try:
        for rows in args.rows:
            cells = [_time_passes(packed, rows, args.repeats)]
            for fmt_ops in ops.values():
                for forced in (1 << 30, 1):  # the dot-product kernel, then dequantise-and-matmul
                    quantized.DEQUANTIZE_FROM_ROWS = forced
                    cells.append(_time_passes(fmt_ops, rows, args.repeats))
            print(f"{rows:>5} " + f"{cells[0]:>12.2f} " + " ".join(f"{c:>16.2f}" for c in cells[1:]), flush=True)
    finally:
        quantized.DEQUANTIZE_FROM_ROWS = threshold
    return 0
