"""The environment variables tokenmill reads, each in one function (docs/architecture.md lists them).

TOKENMILL_KERNELS          auto (default): build and load the native kernels, warn and run on the
                           PyTorch ops when that fails; required: such a failure is an error; off: never
                           load them.
TOKENMILL_CPU_CAPABILITY   cap the kernels' instruction-set level (kernels/isa.py: x86-64-v2, avx2,
                           avx512, avx512_vnni, avx512_bf16, amx; generic off x86), as PyTorch's
                           ATEN_CPU_CAPABILITY caps ATen's. Also decides what the level implies
                           elsewhere: bfloat16 as the default dtype, oneDNN's packed bfloat16 weights,
                           and oneDNN's and MKL's own caps (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS,
                           each unless it is set). PyTorch's CPU flash attention keeps the host's speed.
TOKENMILL_CACHE_DIR        where built kernels and converted tokenizers are kept (default ~/.cache/tokenmill);
                           scripts/train_eagle3.py writes its EAGLE-3 heads under eagle3/ there.
TOKENMILL_KERNEL_CFLAGS    extra compiler flags for the kernels (e.g. -fsanitize=address; they enter
                           the build's cache key).
CC                         the C compiler (default: gcc, else cc, on PATH).
OMP_NUM_THREADS            read only to report it (`tokenmill env`); OpenMP and PyTorch act on it.
TOKENMILL_DIST_KEY         the shared secret of a multi-node run (--nnodes > 1): the engine and the other
                           nodes' workers authenticate each other with it before any step crosses.
TOKENMILL_API_KEY          the server's API key when --api-key / --api-key-file give none.
PYTHONHASHSEED             the prefix cache's hash seed when none is configured (vLLM's rule).
XDG_CACHE_HOME             where the all-MiniLM-L6-v2 alias unpacks its model (default ~/.cache).
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_SERVICE_NAME
                           OpenTelemetry's own: the traces' protocol (only http/protobuf) and service name.
TOKENMILL_FP8_WEIGHT_ONLY  1: FP8 weights multiply unquantised activations on the weight-only product (the
                           path of GPUs below sm89) instead of quantising them per token (W8A8).
TRITON_INTERPRET           Triton's: 1 runs its kernels in the interpreter (set for a CPU triton_paged run).
TIKTOKEN_ENCODINGS_BASE    openai-harmony's: the folder holding o200k_base.tiktoken (GPT-OSS's chat format); unset,
                           tokenmill builds that file from the model's own tokenizer into the cache folder
                           and sets it (server/harmony_vocab.py), so harmony never downloads it.
THP_MEM_ALLOC_ENABLE       PyTorch's: 1 puts CPU tensors of 2 MB and more on transparent huge pages;
                           importing tokenmill sets it to 1 unless it is set.
Set for others: the oneDNN and MKL caps below, and a data-parallel replica's OMP_NUM_THREADS.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional

KERNEL_MODES = ("auto", "required", "off")


def kernels_mode() -> str:
    """TOKENMILL_KERNELS: auto, required or off (ValueError otherwise)."""
    mode = os.environ.get("TOKENMILL_KERNELS", "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"TOKENMILL_KERNELS must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    return mode


def cpu_capability_cap() -> Optional[str]:
    """TOKENMILL_CPU_CAPABILITY, or None when unset."""
    value = os.environ.get("TOKENMILL_CPU_CAPABILITY", "").strip().lower()
    return value or None


def cache_root() -> Path:
    """The tokenmill cache folder (kernels, converted tokenizers): TOKENMILL_CACHE_DIR, else
    ~/.cache/tokenmill."""
    configured = os.environ.get("TOKENMILL_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tokenmill"


def extra_kernel_cflags() -> list[str]:
    """TOKENMILL_KERNEL_CFLAGS, split as a shell would."""
    return shlex.split(os.environ.get("TOKENMILL_KERNEL_CFLAGS", ""))


def c_compiler() -> Optional[str]:
    """CC, or None when unset."""
    return os.environ.get("CC") or None


def omp_num_threads() -> Optional[str]:
    """OMP_NUM_THREADS, or None when unset."""
    return os.environ.get("OMP_NUM_THREADS") or None


def distributed_key() -> bytes:
    """TOKENMILL_DIST_KEY as bytes; ValueError when unset (steps cross between hosts only authenticated)."""
    key = os.environ.get("TOKENMILL_DIST_KEY", "")
    if not key:
        raise ValueError("a multi-node run (nnodes > 1) needs TOKENMILL_DIST_KEY: the same secret on every node "
                         "(e.g. export TOKENMILL_DIST_KEY=$(openssl rand -hex 16) and copy it to the others)")
    return key.encode()


def api_key() -> Optional[str]:
    """TOKENMILL_API_KEY, or None when unset or empty."""
    return os.environ.get("TOKENMILL_API_KEY") or None


def python_hash_seed() -> Optional[str]:
    """PYTHONHASHSEED, or None when unset."""
    return os.environ.get("PYTHONHASHSEED")


def xdg_cache_home() -> Path:
    """XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))


def otlp_traces_protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (default http/protobuf)."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")


def otel_service_name() -> str:
    """OTEL_SERVICE_NAME (default tokenmill)."""
    return os.environ.get("OTEL_SERVICE_NAME", "tokenmill")


def fp8_weight_only() -> bool:
    """TOKENMILL_FP8_WEIGHT_ONLY: 1 (or true/yes/on) forces the FP8 weight-only product; unset or 0 does not
    (ValueError for anything else)."""
    value = os.environ.get("TOKENMILL_FP8_WEIGHT_ONLY", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"TOKENMILL_FP8_WEIGHT_ONLY must be 0 or 1, got {value!r}")


def triton_interpreted() -> bool:
    """Whether TRITON_INTERPRET is 1 (Triton reads it when first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpret_triton() -> None:
    """Set TRITON_INTERPRET=1, for a Triton not yet imported."""
    os.environ["TRITON_INTERPRET"] = "1"


def tiktoken_encodings_base() -> Optional[Path]:
    """TIKTOKEN_ENCODINGS_BASE (openai-harmony's vocabulary folder), or None when unset."""
    value = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    return Path(value) if value else None


def set_tiktoken_encodings_base(folder: Path) -> None:
    """Point openai-harmony at `folder` for its vocabulary files (it reads the variable when it loads one)."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)


def prefer_huge_pages() -> None:
    """THP_MEM_ALLOC_ENABLE=1 unless set: PyTorch's CPU allocator reads it once, at its first allocation."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def environment() -> dict[str, str]:
    """A copy of this process's whole environment (for a process that starts later to take on: take_on)."""
    return dict(os.environ)


def take_on(environment: dict[str, str]) -> None:
    """Make `environment` this process's whole environment (a rank forked from a server that started earlier,
    under another environment, takes on its engine's)."""
    os.environ.clear()
    os.environ.update(environment)


def environment_with(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides`: a child process's."""
    return {**os.environ, **overrides}


# oneDNN's ONEDNN_MAX_CPU_ISA for each capped level (amx and generic: no cap)
_ONEDNN_ISA = {"x86-64-v2": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_vnni": "AVX512_CORE_VNNI",
               "avx512_bf16": "AVX512_CORE_BF16"}
# MKL's MKL_ENABLE_INSTRUCTIONS (PyTorch's float32 BLAS) for each capped level: its float32 kernels use
# none of VNNI, BF16 or AMX, so the AVX-512 levels share one value
_MKL_ISA = {"x86-64-v2": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512", "avx512_vnni": "AVX512", "avx512_bf16": "AVX512"}


def cap_libraries_to_capability() -> None:
    """Set ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS to match TOKENMILL_CPU_CAPABILITY, each unless it is
    set already (both libraries read them at their first use)."""
    cap = cpu_capability_cap() or ""
    for variable, table in (("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA), ("MKL_ENABLE_INSTRUCTIONS", _MKL_ISA)):
        if cap in table:
            os.environ.setdefault(variable, table[cap])
