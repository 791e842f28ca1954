"""Which instruction-set level a CPU gets, what the cap does, and what the level implies elsewhere —
for the CPUs users have, described by their /proc/cpuinfo flags (no torch, no compiler)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.kernels import isa

V3 = "sse4_2 ssse3 popcnt avx avx2 fma f16c bmi2"
V4 = V3 + " avx512f avx512bw avx512dq avx512vl avx512cd"
CPUS = {
    "x86-64-v2 only (old Atom)": ("sse4_2 ssse3 popcnt", "x86-64-v2"),
    "AVX2 laptop / EPYC Zen 3": (V3, "avx2"),
    "Skylake-SP (AVX-512, no VNNI)": (V4, "avx512"),
    "Cascade Lake / Ice Lake (VNNI)": (V4 + " avx512_vnni", "avx512_vnni"),
    "Zen 4 / Cooper Lake (VNNI, BF16)": (V4 + " avx512_vnni avx512_bf16", "avx512_bf16"),
    "Sapphire Rapids (AMX)": (V4 + " avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8", "amx"),
    "Alder Lake client (AVX2, AVX-VNNI, AVX-NE-CONVERT)": (V3 + " avx_vnni avx_ne_convert", "avx2"),
}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be an x86-64 CPU with the given flags (and optional cap)."""
    def pretend(flags: str, cap: str | None = None) -> None:
        monkeypatch.setattr(isa, "cpu_flags", lambda: tuple(flags.split()))
        monkeypatch.setattr(isa, "is_x86", lambda: True)
        if cap is None:
            monkeypatch.delenv("TOKENMILL_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("TOKENMILL_CPU_CAPABILITY", cap)
        isa.chosen_level.cache_clear()
    yield pretend
    isa.chosen_level.cache_clear()


@pytest.mark.parametrize("name", list(CPUS))
def test_each_cpu_gets_the_best_level_it_runs(cpu, name):
    flags, expected = CPUS[name]
    cpu(flags)
    assert isa.chosen_level().name == expected
    names = [level.name for level in isa.runnable_levels()]
    assert names == [level.name for level in isa.X86_LEVELS[:names.index(expected) + 1]]


def test_the_cap_lowers_the_level_and_what_follows_from_it(cpu):
    amx_flags = CPUS["Sapphire Rapids (AMX)"][0]
    cpu(amx_flags)
    assert isa.native_bf16() and isa.onednn_bf16_packing()
    cpu(amx_flags, cap="avx512_vnni")
    assert isa.chosen_level().name == "avx512_vnni"
    assert not isa.native_bf16(), "bfloat16 is the default only where the level multiplies it natively"
    assert isa.onednn_bf16_packing(), "AVX-512 BW/VL/DQ are within the avx512_vnni level"
    cpu(amx_flags, cap="avx2")
    assert [level.name for level in isa.runnable_levels()] == ["x86-64-v2", "avx2"]
    assert not isa.onednn_bf16_packing(), "an avx2 cap leaves oneDNN's AVX-512 bfloat16 packing out"


def test_a_cap_above_the_cpu_changes_nothing_and_a_bad_one_is_named(cpu):
    cpu(V3, cap="amx")
    assert isa.chosen_level().name == "avx2"
    cpu(V3, cap="AVX-9000")
    with pytest.raises(ValueError, match="unknown CPU capability 'avx-9000'.*x86-64-v2, avx2"):
        isa.chosen_level()


def test_avx_ne_convert_lets_onednn_pack_bfloat16_without_avx512(cpu):
    cpu(CPUS["Alder Lake client (AVX2, AVX-VNNI, AVX-NE-CONVERT)"][0])
    assert isa.onednn_bf16_packing() and not isa.native_bf16()
    cpu(CPUS["AVX2 laptop / EPYC Zen 3"][0])
    assert not isa.onednn_bf16_packing()


def test_no_cpuinfo_still_runs_the_baseline(cpu):
    cpu("")
    assert isa.chosen_level().name == "x86-64-v2"


@pytest.mark.parametrize("cap, preset, expected", [("avx2", None, "AVX2 AVX2"), ("x86-64-v2", None, "SSE41 SSE4_2"),
                                                   ("avx512_bf16", None, "AVX512_CORE_BF16 AVX512"),
                                                   ("amx", None, "None None"),
                                                   ("avx2", "AVX512_CORE", "AVX512_CORE AVX2")])
def test_the_cap_also_caps_onednn_and_mkl_unless_capped_already(cap, preset, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    env["TOKENMILL_CPU_CAPABILITY"] = cap
    if preset:
        env["ONEDNN_MAX_CPU_ISA"] = preset
    code = ("import os, tokenmill; "
            "print(os.environ.get('ONEDNN_MAX_CPU_ISA'), os.environ.get('MKL_ENABLE_INSTRUCTIONS'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == expected
