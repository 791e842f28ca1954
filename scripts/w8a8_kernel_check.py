"""Check and time the W8A8 products on a device: every path of `W8A8Kernel` (layers/w8a8_linear.py) for
FP8 (per channel, 128 x 128 blocks) and int8 (per channel) weights against `w8a8.reference_linear`, the
Triton activation quantisers bit for bit against the torch references, batch invariance of the invariant
tiling, and the product times at a 1B model's shapes (Llama-3.2-1B: hidden 2048, q/k/v 3072 rows, gate/up
16384, down 2048 x 8192) against bfloat16 `F.linear`.

    python scripts/w8a8_kernel_check.py            # CUDA; prints one JSON object
    TRITON_INTERPRET=1 python scripts/w8a8_kernel_check.py --dry   # CPU tensors, tiny shapes: the script's own check
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from tokenmill.kernels import w8a8
from tokenmill.layers import triton_w8a8
from tokenmill.layers.w8a8_linear import W8A8Kernel


class _OnDevice:
    on_device = True


def _time(fn, device: str, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry", action="store_true", help="CPU tensors (Triton interpreter), tiny shapes")
    args = parser.parse_args()
    device = "cpu" if args.dry else "cuda"
    torch.manual_seed(0)
    shapes = [(192, 96)] if args.dry else [(2048, 3072), (2048, 16384), (8192, 2048), (2048, 2048)]  # (K, N)
    rows = [1, 17] if args.dry else [1, 64, 2048]
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "errors": {}, "ms": {}}
    x_all = torch.randn(max(rows), max(k for k, _ in shapes), device=device, dtype=torch.bfloat16)
    for values in (w8a8.FP8, w8a8.INT8):
        q, s = triton_w8a8.quantize_activations(x_all, None, values)
        q_ref, s_ref = w8a8.quantize_activations(x_all, None, values)
        out[f"{values.format}_quantiser_bit_exact"] = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                                                           and torch.equal(s, s_ref))
    for k, n in shapes:
        w = torch.randn(n, k, device=device) * 0.02
        int8_scale = w.abs().amax(1, keepdim=True) / 127
        weights = {"channel": w8a8.quantize_fp8(w),
                   "block": w8a8.from_checkpoint(w.to(torch.float8_e4m3fn), torch.rand(-(-n // 128), -(-k // 128),
                                                 device=device) * 1e-2, (128, 128)),
                   "int8": w8a8.from_checkpoint(torch.round(w / int8_scale).to(torch.int8), int8_scale)}
        dense = w.bfloat16()
        for m in rows:
            x = x_all[:m, :k].contiguous()
            key = f"{m}x{k}x{n}"
            out["ms"][f"bf16 {key}"] = _time(lambda: F.linear(x, dense), device, 3 if args.dry else 50)
            for name, weight in weights.items():
                for invariant in (False, True):
                    kernel = W8A8Kernel(weight, None, _OnDevice(), batch_invariant=invariant)
                    label = f"{name} {kernel.path}{' invariant' if invariant else ''} {key}"
                    y = kernel(x)
                    ref = w8a8.reference_linear(x, weight, None)
                    out["errors"][label] = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                    out["ms"][label] = _time(lambda: kernel(x), device, 3 if args.dry else 50)
                    if invariant and m > 1:
                        out.setdefault("invariant_rows_equal", []).append(bool(torch.equal(kernel(x[:1]), y[:1])))
                if weight.values is w8a8.INT8:
                    continue  # the weight-only product decodes e4m3
                only = triton_w8a8.weight_only_product(x, weight, None, False)
                ref = w8a8.reference_linear(x, weight, None, quantize_inputs=False)
                out["errors"][f"{name} weight-only {key}"] = float((only.float() - ref.float()).abs().max()
                                                                    / ref.float().abs().max())
                out["ms"][f"{name} weight-only {key}"] = _time(
                    lambda: triton_w8a8.weight_only_product(x, weight, None, False), device, 3 if args.dry else 50)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry and TRITON_INTERPRET=1 on CPU")
    main()
