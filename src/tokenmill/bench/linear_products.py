"""How fast each way of multiplying a model's projections is, by number of input rows.

`tokenmill bench linears` times, for every row count asked, the projections of all layers of a
model shaped like SmolLM2-135M, with distinct random weights, so that each pass
reads them from memory as a decode step does: float weights as the engine multiplies them in the
chosen dtype (float32: dense; bfloat16: packed for oneDNN where the CPU allows, and in AMX tiles on
CPUs with AMX); int8 and int4 weights through the int8 dot-product kernel, AMX tiles over
dequantised panels, and the dequantise-then-matmul path. It prints the median of the repetitions in
milliseconds. This is where `DEQUANTIZE_FROM_ROWS`, `AMX_FROM_ROWS` and `AMX_BELOW_ROWS` come from
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch
# torch and the kernels are imported where they run: the CLI registers this command's flags, and
# `tokenmill bench serve` (an HTTP client) or `tokenmill chat` should not pay torch's import to start

# SmolLM2-135M: qkv, o, gate_up, down as (out_features, in_features)
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
_NEVER = 1 << 30
# the thresholds (DEQUANTIZE_FROM_ROWS, AMX_FROM_ROWS, AMX_BELOW_ROWS) that force each product path
_FORCED_PATHS = {"dot": (_NEVER, _NEVER, 1), "amx": (_NEVER, 1, _NEVER), "dequant": (1, 1, 1)}


def _time_passes(layers: list[list[Callable]], rows: int, repeats: int, dtype: torch.dtype) -> float:
    import torch

    inputs = [torch.randn(rows, shape[1]).to(dtype) for shape in SMOLLM2_SHAPES]
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
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the inputs' dtype, and the float weights' (default: auto, the engine's default "
                        "dtype on this CPU: bfloat16 with AVX512-BF16, else float32)")


def run_linear_products(args: argparse.Namespace) -> int:
    """Build the weights and print one line of milliseconds per row count."""
    import torch
    from tqdm import tqdm

    from tokenmill.kernels import quantized
    from tokenmill.kernels.cpu_kernels import ALWAYS_INT8, cpu_kernels, int8_rows_below
    from tokenmill.layers.linear_kernels import (AmxPackedKernel, DenseKernel, Float32ComputeKernel,
                                                 OneDnnPackedKernel, onednn_packing_available)
    from tokenmill.worker.model_setup import resolve_dtype

    kernels = cpu_kernels()
    if kernels is None:
        print("the native kernels could not be built (see the warning above)", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    floats = [[torch.randn(shape) * 0.02 for shape in SMOLLM2_SHAPES]
              for _ in tqdm(range(args.layers), desc="weights", file=sys.stderr)]
    dtype = resolve_dtype(args.dtype, torch.device("cpu"), "float32")
    if dtype == torch.float32:
        bf16 = {"f32 dense": [[DenseKernel(w, None) for w in layer] for layer in floats]}
    elif onednn_packing_available(torch.bfloat16, torch.device("cpu")):
        bf16 = {"bf16 onednn": [[OneDnnPackedKernel(w.bfloat16(), None) for w in layer] for layer in floats]}
    else:  # what bfloat16 weights run on here (isa.onednn_bf16_packing)
        bf16 = {"bf16 in f32": [[Float32ComputeKernel(w.bfloat16(), None) for w in layer] for layer in floats]}
    if kernels.amx and dtype == torch.bfloat16:
        bf16["bf16 amx"] = [[AmxPackedKernel(w.bfloat16(), None, kernels) for w in layer] for layer in floats]
    ops = {fmt: [[kernels.qlinear_op(quantized.quantize(w, fmt), None) for w in layer] for layer in floats]
           for fmt in quantized.FORMATS}
    paths = [p for p in _FORCED_PATHS if p != "amx" or (kernels.amx and dtype == torch.bfloat16)]
    if int8_rows_below(kernels.level, kernels.amx, dtype) == ALWAYS_INT8:
        paths.remove("dequant")  # every row count takes the int8 products here: nothing to force
    columns = list(bf16) + [f"{fmt} {path}" for fmt in ops for path in paths]
    thresholds = (quantized.DEQUANTIZE_FROM_ROWS, quantized.AMX_FROM_ROWS, quantized.AMX_BELOW_ROWS)
    print(f"{kernels.level.name} kernels, {str(dtype).removeprefix('torch.')} inputs")
    print(f"{'rows':>5} " + " ".join(f"{c:>12}" for c in columns))
    try:
        for rows in args.rows:
            quantized.AMX_BELOW_ROWS = _NEVER  # bfloat16 AMX at every row count
            cells = [_time_passes(layers, rows, args.repeats, dtype) for layers in bf16.values()]
            for fmt_ops in ops.values():
                for path in paths:
                    quantized.DEQUANTIZE_FROM_ROWS, quantized.AMX_FROM_ROWS, quantized.AMX_BELOW_ROWS = _FORCED_PATHS[path]
                    cells.append(_time_passes(fmt_ops, rows, args.repeats, dtype))
            print(f"{rows:>5} " + " ".join(f"{c:>12.2f}" for c in cells), flush=True)
    finally:
        quantized.DEQUANTIZE_FROM_ROWS, quantized.AMX_FROM_ROWS, quantized.AMX_BELOW_ROWS = thresholds
    return 0
