"""The instruction-set levels the native kernels are built for, and the one this process runs.

The C sources are compiled once per level with that level's target flags (never -march=native, so a
library runs on every CPU of its level) and the best level the host executes is chosen at run time,
the way PyTorch's ATen CPU capability dispatch does. `TOKENMILL_CPU_CAPABILITY` (read in
tokenmill/envs.py) caps the level, so any machine can run and test every level below its own.

x86-64 levels, lowest first (each includes the ones before it):
  x86-64-v2    SSE4.2 baseline: portable C, vectorised only where the compiler manages
  avx2         x86-64-v3: AVX2, FMA, F16C (llama.cpp's AVX2 class of machines)
  avx512       x86-64-v4: AVX-512 F/BW/DQ/VL/CD
  avx512_vnni  + AVX512-VNNI (int8 dot products)
  avx512_bf16  + AVX512-BF16 (bfloat16 dot products)
  amx          + AMX-TILE and AMX-BF16 tiles (AMX-INT8 too where CPUID has it: checked at run time)
Elsewhere (aarch64, ...) the one level `generic` compiles the portable C with the target's defaults.
No torch here: the level is a fact about the CPU, read from /proc/cpuinfo.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

from tokenmill import envs
from tokenmill.cpu_features import cpu_flags


@dataclass(frozen=True)
class IsaLevel:
    """One build target: its name, the compiler flags that select it and the CPU flags it needs."""

    name: str
    compiler_flags: tuple[str, ...]
    cpu_needs: tuple[str, ...]


_V4_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")
X86_LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("x86-64-v2", ("-march=x86-64-v2", "-mtune=generic"), ("sse4_2", "ssse3", "popcnt")),
    IsaLevel("avx2", ("-march=x86-64-v3", "-mtune=generic"), ("avx2", "fma", "f16c", "bmi2")),
    IsaLevel("avx512", ("-march=x86-64-v4", "-mtune=generic"), _V4_FLAGS),
    IsaLevel("avx512_vnni", ("-march=x86-64-v4", "-mtune=generic", "-mavx512vnni"), _V4_FLAGS + ("avx512_vnni",)),
    IsaLevel("avx512_bf16", ("-march=x86-64-v4", "-mtune=generic", "-mavx512vnni", "-mavx512bf16"),
             _V4_FLAGS + ("avx512_vnni", "avx512_bf16")),
    IsaLevel("amx", ("-march=x86-64-v4", "-mtune=generic", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
                     "-mamx-int8"),
             _V4_FLAGS + ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")),
)
GENERIC = IsaLevel("generic", (), ())


def is_x86() -> bool:
    """Whether this machine is x86-64."""
    return platform.machine().lower() in ("x86_64", "amd64")


def levels() -> tuple[IsaLevel, ...]:
    """Every level this machine's architecture has, lowest first (whether or not this CPU runs them)."""
    return X86_LEVELS if is_x86() else (GENERIC,)


def level_named(name: str) -> IsaLevel:
    """The level called `name`; ValueError naming the known ones otherwise."""
    for level in levels():
        if level.name == name:
            return level
    known = ", ".join(level.name for level in levels())
    raise ValueError(f"unknown CPU capability {name!r} (known on {platform.machine()}: {known})")


def host_levels() -> tuple[IsaLevel, ...]:
    """The levels this CPU executes, lowest first (on x86-64 at least x86-64-v2 is assumed)."""
    flags = set(cpu_flags())
    runnable = tuple(level for level in levels() if all(need in flags for need in level.cpu_needs))
    return runnable or levels()[:1]


def runnable_levels() -> tuple[IsaLevel, ...]:
    """The host's levels up to the `TOKENMILL_CPU_CAPABILITY` cap: what the tests exercise."""
    host = host_levels()
    cap = envs.cpu_capability_cap()
    if cap is None:
        return host
    limit = levels().index(level_named(cap))
    return tuple(level for level in host if levels().index(level) <= limit)


@functools.lru_cache(maxsize=None)
def chosen_level() -> IsaLevel:
    """The level this process runs: the best the host executes, capped by `TOKENMILL_CPU_CAPABILITY`."""
    return runnable_levels()[-1]


def level_has(level: IsaLevel, *features: str) -> bool:
    """Whether code built for `level` may use every one of `features` (cpuinfo flag names)."""
    return all(feature in level.cpu_needs for feature in features)


def native_bf16() -> bool:
    """Whether this process's level multiplies bfloat16 natively (AVX512-BF16, which AMX machines also
    have): where the default dtype is bfloat16 rather than float32."""
    return level_has(chosen_level(), "avx512_bf16")


def onednn_bf16_packing() -> bool:
    """Whether oneDNN can reorder bfloat16 weights into its packed layout here: it needs AVX-512 BW, VL
    and DQ (within this process's level) or AVX-NE-CONVERT, and fails at load time elsewhere."""
    if not is_x86():
        return False
    flags = set(cpu_flags())
    return level_has(chosen_level(), "avx512bw", "avx512vl", "avx512dq") or "avx_ne_convert" in flags
