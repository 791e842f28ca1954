"""Building the kernels: every level compiles warning-free on any host and loads, aarch64 cross-compiles, the
cache survives unwritable folders and concurrent builders, and failures say what happened."""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import envs
from tokenmill.kernels import build, isa
from tokenmill.kernels.cpu_kernels import cpu_kernels

CROSS_COMPILER = "aarch64-linux-gnu-gcc"
EM_AARCH64 = 183  # the ELF header's e_machine of an aarch64 binary


@pytest.fixture
def warnings_are_errors(monkeypatch):
    """Builds through the kernel cache with -Werror added to TOKENMILL_KERNEL_CFLAGS. The flags are part of a
    library's cache name, so a cached library of that name was compiled without a warning from exactly these
    sources, flags and compiler: a later run reuses it, and any change to those inputs compiles again.
    tests/conftest.py adds the flag for the whole suite, so these are the libraries every other test loads."""
    flags = envs.extra_kernel_cflags()
    if "-Werror" not in flags:
        monkeypatch.setenv("TOKENMILL_KERNEL_CFLAGS", shlex.join([*flags, "-Werror"]))


def build_all(levels: tuple[isa.IsaLevel, ...]) -> tuple[dict[str, Path], dict[str, str]]:
    """Each level's library through build.built_library, in parallel: (paths, compiler messages of failures)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(levels)) as pool:
        runs = {level.name: pool.submit(build.built_library, level) for level in levels}
    built, failures = {}, {}
    for name, run in runs.items():
        try:
            built[name] = run.result()
        except build.KernelBuildError as exc:
            failures[name] = str(exc)[-2000:]
    return built, failures


def test_every_x86_level_compiles_without_warnings_and_links_without_undefined_symbols(warnings_are_errors):
    """Compiling needs no CPU support: a guard missing for any level fails here, on every machine. The link
    refuses undefined symbols (-z defs), and loading runs none of a level's instructions, so every level's
    library is loaded here too, whether or not this CPU could run it."""
    assert build.find_compiler(), "a C compiler is part of the project machine"
    built, failures = build_all(isa.X86_LEVELS)
    assert not failures, failures
    unloadable = {}
    for name, path in built.items():
        try:
            ctypes.CDLL(str(path))
        except OSError as exc:
            unloadable[name] = str(exc)
    assert not unloadable, unloadable


def test_the_sources_cross_compile_for_aarch64(warnings_are_errors, monkeypatch):
    """x86 intrinsics stay behind their guards, so the portable C builds for ARM (the NEON paths to come).
    The library is cached by the cross compiler's identity, which no native build shares."""
    assert shutil.which(CROSS_COMPILER), (f"{CROSS_COMPILER} is missing: `make test` installs it "
                                          "(Debian package gcc-aarch64-linux-gnu)")
    monkeypatch.setenv("CC", CROSS_COMPILER)
    built, failures = build_all((isa.GENERIC,))
    assert not failures, failures
    header = built["generic"].read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64


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
              "print('LEVEL', None if k is None else k.level.name)\n" + code +
              # as the tokenmill command does at exit (cli/main.py): the final collections over torch's
              # objects would cost most of a second of each of these processes' exits
              "\nimport gc; gc.freeze()\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def unoptimised() -> dict[str, str]:
    """TOKENMILL_KERNEL_CFLAGS as the suite sets it, with -O0 after it (the last -O wins). For the tests of the
    cache itself (its fallback folder, concurrent builders): each builds a library into a private cache that
    no other test reuses, and what they check does not depend on how the code is optimised, while -O0 compiles
    a level in about a fifth of -O3's CPU time. The -O3 build of every level is the first test's."""
    return {"TOKENMILL_KERNEL_CFLAGS": shlex.join([*envs.extra_kernel_cflags(), "-O0"])}


def test_an_unwritable_cache_falls_back_to_a_temporary_folder(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    run = kernels_in_subprocess({"TOKENMILL_CACHE_DIR": str(blocked / "cache"), "TOKENMILL_KERNELS": "required",
                                 "TOKENMILL_CPU_CAPABILITY": "x86-64-v2" if isa.is_x86() else "generic",
                                 "TMPDIR": str(private_tmp), **unoptimised()})
    assert run.returncode == 0, run.stderr
    assert "LEVEL x86-64-v2" in run.stdout or "LEVEL generic" in run.stdout
    assert any(p.suffix == ".so" for p in (private_tmp / f"tokenmill-kernels-{os.getuid()}").iterdir())


def test_two_processes_building_at_once_both_load_one_complete_library(tmp_path):
    level = "x86-64-v2" if isa.is_x86() else "generic"
    cache = tmp_path / "cache"
    env = {"TOKENMILL_CACHE_DIR": str(cache), "TOKENMILL_KERNELS": "required", "TOKENMILL_CPU_CAPABILITY": level,
           **unoptimised()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(kernels_in_subprocess, env) for _ in range(2)]
    for run in runs:
        assert run.result().returncode == 0, run.result().stderr
        assert f"LEVEL {level}" in run.result().stdout
    files = sorted(p.name for p in (cache / "kernels").iterdir())
    libraries = [name for name in files if name.endswith(".so")]
    assert len(libraries) == 1 and libraries[0].startswith(f"cpu_kernels-{level}-"), files
    assert set(files) == {libraries[0], libraries[0] + ".lock"}, "no partial library is left behind"


def test_a_failed_build_warns_with_the_compilers_message_or_stops_when_required(tmp_path, monkeypatch, caplog):
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
    # off needs no fresh process: it returns before any build or cached library, and warns of nothing
    for name, value in {**env, "TOKENMILL_KERNELS": "off"}.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.DEBUG):
        assert cpu_kernels() is None
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_a_bad_level_cap_is_named():
    """(A cap to the lowest level is honoured: the tests above run capped to it and check the level chosen.)"""
    bad = kernels_in_subprocess({"TOKENMILL_CPU_CAPABILITY": "avx9000"})
    assert bad.returncode != 0 and "unknown CPU capability 'avx9000'" in bad.stderr
    assert isa.runnable_levels()[-1] == isa.chosen_level()
