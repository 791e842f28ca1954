"""Building the kernels: every level compiles warning-free on any host, aarch64 cross-compiles, the
cache survives unwritable folders and concurrent builders, and failures say what happened."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tokenmill.kernels import build, isa

CROSS_COMPILER = "aarch64-linux-gnu-gcc"


def compile_level(compiler: str, level: isa.IsaLevel, output: Path) -> subprocess.CompletedProcess:
    command = build.compile_command(compiler, level, str(output), extra=["-Werror"])
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_every_x86_level_compiles_without_warnings_and_links_without_undefined_symbols(tmp_path):
    """Compiling needs no CPU support: a guard missing for any level fails here, on every machine."""
    compiler = build.find_compiler()
    assert compiler, "a C compiler is part of the project machine"
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = {level.name: pool.submit(compile_level, compiler, level, tmp_path / f"{level.name}.so")
                for level in isa.X86_LEVELS}
    failures = {name: run.result().stderr[-2000:] for name, run in runs.items() if run.result().returncode}
    assert not failures, failures


def test_the_sources_cross_compile_for_aarch64(tmp_path):
    """x86 intrinsics stay behind their guards, so the portable C builds for ARM (the NEON paths to come)."""
    assert shutil.which(CROSS_COMPILER), (f"{CROSS_COMPILER} is missing: `make test` installs it "
                                          "(Debian package gcc-aarch64-linux-gnu)")
    run = compile_level(CROSS_COMPILER, isa.GENERIC, tmp_path / "generic.so")
    assert run.returncode == 0, run.stderr[-2000:]
    assert b"\x7fELF" == (tmp_path / "generic.so").read_bytes()[:4]


def kernels_in_subprocess(env_overrides: dict, code: str = "") -> subprocess.CompletedProcess:
    """Run `cpu_kernels()` in a fresh interpreter (the level and library are per process). With a
    TOKENMILL_CACHE_DIR, the temporary folder (the cache's fallback) is made private to it too."""
    env = {**os.environ, **env_overrides}
    if "TOKENMILL_CACHE_DIR" in env_overrides and "TMPDIR" not in env_overrides:
        private_tmp = Path(env_overrides["TOKENMILL_CACHE_DIR"]).parent / "tmp"
        private_tmp.mkdir(exist_ok=True)
        env["TMPDIR"] = str(private_tmp)
    script = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
              "from tokenmill.kernels.cpu_kernels import cpu_kernels\n"
              "k = cpu_kernels()\n"
              "print('LEVEL', None if k is None else k.level.name)\n" + code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def test_an_unwritable_cache_falls_back_to_a_temporary_folder(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    run = kernels_in_subprocess({"TOKENMILL_CACHE_DIR": str(blocked / "cache"), "TOKENMILL_KERNELS": "required",
                                 "TOKENMILL_CPU_CAPABILITY": "x86-64-v2" if isa.is_x86() else "generic",
                                 "TMPDIR": str(private_tmp)})
    assert run.returncode == 0, run.stderr
    assert "LEVEL x86-64-v2" in run.stdout or "LEVEL generic" in run.stdout
    assert any(p.suffix == ".so" for p in (private_tmp / f"tokenmill-kernels-{os.getuid()}").iterdir())


def test_two_processes_building_at_once_both_load_one_complete_library(tmp_path):
    level = "x86-64-v2" if isa.is_x86() else "generic"
    cache = tmp_path / "cache"
    env = {"TOKENMILL_CACHE_DIR": str(cache), "TOKENMILL_KERNELS": "required", "TOKENMILL_CPU_CAPABILITY": level}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(kernels_in_subprocess, env) for _ in range(2)]
    for run in runs:
        assert run.result().returncode == 0, run.result().stderr
        assert f"LEVEL {level}" in run.result().stdout
    files = sorted(p.name for p in (cache / "kernels").iterdir())
    libraries = [name for name in files if name.endswith(".so")]
    assert len(libraries) == 1 and libraries[0].startswith(f"cpu_kernels-{level}-"), files
    assert set(files) == {libraries[0], libraries[0] + ".lock"}, "no partial library is left behind"


def test_a_failed_build_warns_with_the_compilers_message_or_stops_when_required(tmp_path):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    env = {"TOKENMILL_CACHE_DIR": str(tmp_path / "cache"), "CC": str(broken)}
    auto = kernels_in_subprocess({**env, "TOKENMILL_KERNELS": "auto"})
    assert auto.returncode == 0 and "LEVEL None" in auto.stdout
    assert "native CPU kernels unavailable" in auto.stderr and "this compiler is broken" in auto.stderr
    required = kernels_in_subprocess({**env, "TOKENMILL_KERNELS": "required"})
    assert required.returncode != 0
    assert "TOKENMILL_KERNELS=required" in required.stderr and "this compiler is broken" in required.stderr
    off = kernels_in_subprocess({**env, "TOKENMILL_KERNELS": "off"})
    assert off.returncode == 0 and "LEVEL None" in off.stdout and off.stderr == ""


def test_the_level_cap_is_honoured_and_a_bad_one_is_named():
    lowest = isa.levels()[0].name
    capped = kernels_in_subprocess({"TOKENMILL_CPU_CAPABILITY": lowest})
    assert capped.returncode == 0 and f"LEVEL {lowest}" in capped.stdout, capped.stderr
    bad = kernels_in_subprocess({"TOKENMILL_CPU_CAPABILITY": "avx9000"})
    assert bad.returncode != 0 and "unknown CPU capability 'avx9000'" in bad.stderr
    assert isa.runnable_levels()[-1] == isa.chosen_level()
