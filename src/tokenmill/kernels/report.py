"""What runs where: the kernel level and the product / attention paths a model will take (logged once
at start-up), and the machine facts `tokenmill env` prints. Nothing here decides a path: it reads the
decisions the loaders made (layers/linear_kernels.py, attention/, models/fused_decode.py)."""

from __future__ import annotations

import os
import platform
from typing import Any, Optional

import torch

from tokenmill import envs
from tokenmill.cpu_features import cpu_flags
from tokenmill.kernels import build, isa
from tokenmill.kernels.cpu_kernels import ALWAYS_INT8, cpu_kernels, int8_rows_below
from tokenmill.kernels import quantized

# the cpuinfo flags that decide a level or a library path
INTERESTING_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx_ne_convert", "avx512f", "avx512bw",
                     "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def kernels_line(kernels: Any) -> str:
    """One phrase on the native kernels: their level, or why there are none."""
    mode = envs.kernels_mode()
    if mode == "off":
        return "native kernels off (TOKENMILL_KERNELS=off): PyTorch ops only"
    if kernels is None:
        return f"native kernels unavailable for {isa.chosen_level().name} (see the warning): PyTorch ops only"
    best = isa.host_levels()[-1].name
    capped = f", capped from {best} by TOKENMILL_CPU_CAPABILITY" if kernels.level.name != best else ""
    return f"native kernels {kernels.level.name}{capped}"


def _vector_path(kernels: Any) -> str:
    features = kernels.compiled_features
    if "avx512_vnni" in features:
        # kernels/amx_int8.c: the same bits, its integer dots on tiles (CPUID checked again in C)
        tiles = kernels.amx and kernels.level.name == "amx" and "amx_int8" in cpu_flags()
        return "AVX512-VNNI" + ("; integer dots on AMX-INT8 tiles from 16 rows" if tiles else "")
    if "avx512f" in features:
        return "AVX-512 without VNNI (vpmaddubsw, 16 outputs a vector)"
    if "avx2" in features:
        return "AVX2"
    return "portable C"


def product_paths(kernels: Any, dtype: torch.dtype, quantized_weights: bool, float_kernel: Optional[str],
                  batch_invariant: bool = False, device: str = "cpu") -> str:
    """How the projections multiply: quantised weights by row count, float weights by their kernel."""
    if quantized_weights:
        if device != "cpu":
            return f"quantised products: dequantised once to {str(dtype).removeprefix('torch.')}, then {device} matmuls"
        if kernels is None:
            return "quantised products: PyTorch reference, the weight dequantised per call"
        amx = kernels.amx and dtype == torch.bfloat16
        text = f"quantised products: int8 dot products ({_vector_path(kernels)})"
        if batch_invariant:
            return text + " at every row count (batch-invariant)"
        below = int8_rows_below(kernels.level, kernels.amx, dtype)
        if below == ALWAYS_INT8:
            return text + " at every row count (no native bfloat16 matmul to dequantise for)"
        text += f" below {below} rows"
        if amx:
            text += f", AMX tiles {quantized.AMX_FROM_ROWS}-{quantized.AMX_BELOW_ROWS - 1} rows"
            below = quantized.AMX_BELOW_ROWS
        return text + f", dequantised weight x {str(dtype).removeprefix('torch.')} matmul from {below}"
    return f"float products: {float_kernel or 'F.linear'}"


def triton_product_paths(quantized_weights: bool, float_kernel: Optional[str], batch_invariant: bool) -> str:
    """How the projections multiply on Triton's products."""
    parts = ["quantised products: Triton weight-only product on the packed weights"] if quantized_weights else []
    if batch_invariant:
        parts.append("float products: Triton batch-invariant matmul")
    else:
        parts.append(f"float products: {float_kernel or 'F.linear'}")
    return ", ".join(parts)


def attention_paths(kernels: Any, dtype: torch.dtype, backend: Any) -> str:
    """How decode and prefill attention run."""
    name = type(backend).__name__
    if backend.on_triton:
        return ("attention: Triton paged kernels, one unified kernel for every query" +
                (" (batch-invariant)" if backend.batch_invariant else ", split-KV decode for few long sequences"))
    if kernels is None or name == "TorchReferenceBackend":
        return "attention: PyTorch reference (gather + SDPA)"
    features = kernels.compiled_features
    level = "AVX-512" if "avx512f" in features else "AVX2" if "avx2" in features else None
    decode = f"native paged attention in query tiles ({level})" if level else "native paged decode (portable C)"
    if getattr(backend, "batch_invariant", False):
        if kernels.amx and dtype == torch.bfloat16:  # attention/cpu_paged.py: CpuPagedBackend.tiles_take
            return ("attention: AMX flash attention for every query, decodes included (batch-invariant; "
                    f"{decode} for layers with a sliding window or a soft cap, or an int8/fp8 cache)")
        return f"attention: {decode} for every query, prefill included (batch-invariant)"
    prefill = ("AMX flash attention" if kernels.amx and dtype == torch.bfloat16 else
               "PyTorch SDPA over gathered blocks")
    return f"attention: {decode}, prefill {prefill}"


def describe_model_paths(model: Any, kernels: Any, dtype: torch.dtype, backend: Any,
                         batch_invariant: bool = False, device: str = "cpu", triton_products: bool = False) -> str:
    """The start-up line: level, products, attention and whether the fused step runs. `triton_products`:
    the projections run on Triton's products (layers/triton_products.py), not on `kernels`."""
    kernels_used = [getattr(m, "kernel", None) for m in model.modules() if hasattr(m, "use_kernel")]
    kernel_names = {type(kernel).__name__ for kernel in kernels_used}
    kernel_names -= {"NoneType", "QuantizedKernel", "W8A8Kernel"}
    float_kernel = ", ".join(sorted(kernel_names)) or None
    w8a8_paths = sorted({kernel.path for kernel in kernels_used if type(kernel).__name__ == "W8A8Kernel"})
    # W8A8 projections (FP8, int8) say their own paths; the int8/int4 line is for the packed int weights
    int_weights = model.has_quantized_weights() and (not w8a8_paths or any(
        getattr(m, "quantized_format", None) in quantized.FORMATS for m in model.modules())
        or getattr(model, "embed_quantized", None) is not None or getattr(model, "head_quantized", None) is not None)
    parts = [kernels_line(kernels) if device == "cpu" else f"device {device}",
             triton_product_paths(int_weights, float_kernel, batch_invariant) if triton_products
             else product_paths(kernels, dtype, int_weights, float_kernel, batch_invariant, device),
             attention_paths(kernels, dtype, backend),
             "fused step on" if getattr(model, "fused_decode", None) is not None else "fused step off"]
    if w8a8_paths:
        parts.insert(2, f"W8A8 products: {', '.join(w8a8_paths)}")
    return "; ".join(parts)


def environment() -> list[tuple[str, str]]:
    """The facts `tokenmill env` prints, as (name, value) rows; building the kernels if need be."""
    flags = set(cpu_flags())
    rows = [("machine", platform.machine()), ("cpu", _cpu_model()),
            ("cpu flags", " ".join(f for f in INTERESTING_FLAGS if f in flags) or "(none of interest)"),
            ("levels this CPU runs", " ".join(level.name for level in isa.host_levels())),
            ("TOKENMILL_CPU_CAPABILITY", envs.cpu_capability_cap() or "(unset)"),
            ("level chosen", isa.chosen_level().name),
            ("TOKENMILL_KERNELS", envs.kernels_mode()),
            ("compiler", build.find_compiler() or "(none found)"),
            ("kernel cache", str(build.cache_dirs()[0]))]
    try:
        kernels = cpu_kernels()
        error = None
    except RuntimeError as exc:  # TOKENMILL_KERNELS=required
        kernels, error = None, str(exc)
    if kernels is not None:
        rows.append(("kernels", f"loaded {kernels.level.name}: compiled with "
                     f"{' '.join(kernels.compiled_features) or 'no vector extensions'}; AMX tiles "
                     f"{'usable' if kernels.amx else 'not used'}"))
    else:
        rows.append(("kernels", error or kernels_line(None)))
    rows += [("default dtype", "bfloat16" if isa.native_bf16() else "float32"),
             ("oneDNN bf16 packing", "yes" if isa.onednn_bf16_packing() else
              "no (bfloat16 weights: PyTorch's emulated product for few rows, widened to float32 for many)"),
             ("torch", f"{torch.__version__} (ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                       f"oneDNN {'on' if torch.backends.mkldnn.is_available() else 'off'})"),
             ("threads", f"torch {torch.get_num_threads()}, OMP_NUM_THREADS "
                         f"{envs.omp_num_threads() or '(unset)'}, cores {os.cpu_count()}")]
    return rows


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
