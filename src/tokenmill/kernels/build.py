"""Compile the C kernels into one shared library per instruction-set level (kernels/isa.py).

A library is built on first use of its level, its sources compiled one per core at once and then linked,
and kept in the kernel cache
($TOKENMILL_CACHE_DIR/kernels, default ~/.cache/tokenmill/kernels; where that cannot be written, a
per-user folder in the system's temporary directory), named by the level and a hash of the sources,
the flags and the compiler's version: the same library serves every process and every later run.
Two processes building at once take turns on a lock file and install the result by an atomic rename,
so the cache never holds a partial library. The link refuses undefined symbols (-z defs), so a
library that builds also loads.
No torch here.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from tokenmill import envs
from tokenmill.kernels.isa import IsaLevel

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / name for name in ("cpu_kernels.c", "decode_attention.c", "attention_tiles.c", "decode_attention_q8.c",
                                     "prefill_attention.c", "amx_int8.c",
                                     "quant_kernels.c", "amx_kernels.c", "decode_step.c",
                                     "dense_kernels.c", "threads.c")]
HEADERS = [_HERE / name for name in ("cpu_common.h", "cpu_avx2.h", "quant_cells.h", "amx_tiles.h", "paged_queries.h",
                                     "attention_tiles_avx512.h", "attention_tiles_avx2.h", "q8_rows.h")]
# -ffp-contract=off: a * b + c rounds as PyTorch's separate element-wise ops do; explicit fmas stay.
COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11", "-Wall")
# -z defs: an undefined symbol fails the link, not the load; -Bsymbolic: the kernels call their own
# level's functions even with several levels' libraries loaded in one process (the tests do).
LINK_FLAGS = ("-Wl,-z,defs", "-Wl,-Bsymbolic", "-lm")
_BUILD_TIMEOUT_S = 300
_LOCK_TIMEOUT_S = 600


class KernelBuildError(RuntimeError):
    """The kernels could not be built: the message is the compiler's (or why there is none)."""


def find_compiler() -> Optional[str]:
    """CC, else gcc or cc on PATH; None when there is none."""
    return envs.c_compiler() or shutil.which("gcc") or shutil.which("cc")


def _flags(level: IsaLevel) -> list[str]:
    return [*COMMON_FLAGS, *level.compiler_flags, *envs.extra_kernel_cflags()]


def object_command(compiler: str, level: IsaLevel, source: Path, output: str) -> list[str]:
    """The command that compiles one of SOURCES for `level` into the object file `output`."""
    return [compiler, *_flags(level), "-c", "-o", output, str(source)]


def link_command(compiler: str, level: IsaLevel, objects: Sequence[str], output: str) -> list[str]:
    """The command that links `level`'s object files into the shared library `output`."""
    return [compiler, *_flags(level), "-o", output, *objects, *LINK_FLAGS]


def _compiler_identity(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        return done.stdout.splitlines()[0] if done.stdout else compiler
    except (OSError, subprocess.SubprocessError):
        return compiler


def cache_dirs() -> list[Path]:
    """Where libraries are kept, in order of preference."""
    return [envs.cache_root() / "kernels", Path(tempfile.gettempdir()) / f"tokenmill-kernels-{os.getuid()}"]


def _writable_cache_dir() -> Path:
    for folder in cache_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            pass
        logger.info("kernel cache %s cannot be written; trying the next one", folder)
    raise KernelBuildError(f"none of the kernel cache folders can be written: {', '.join(map(str, cache_dirs()))}")


def library_name(level: IsaLevel, compiler: str) -> str:
    """The cache file name of `level`'s library built by `compiler`."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join(link_command(compiler, level, [], "out")).encode())  # every flag of either step
    digest.update(_compiler_identity(compiler).encode())
    return f"cpu_kernels-{level.name}-{digest.hexdigest()[:16]}.so"


def built_library(level: IsaLevel) -> Path:
    """The path of `level`'s library, compiled now unless a cache already holds it."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler: none of $CC, gcc, cc is on PATH")
    name = library_name(level, compiler)
    for folder in cache_dirs():
        if (folder / name).exists():
            return folder / name
    folder = _writable_cache_dir()
    target = folder / name
    with _lock(folder / (name + ".lock")):
        if target.exists():  # another process built it while this one waited
            return target
        started = time.perf_counter()
        logger.info("building the native kernels for %s (once per machine and version)", level.name)
        work = Path(tempfile.mkdtemp(dir=folder, prefix=f".build-{level.name}-"))
        try:
            objects = _compile_objects(compiler, level, work)
            library = str(work / "library.so")
            _run(link_command(compiler, level, objects, library), level, "linking")
            os.replace(library, target)  # atomic: the cache never holds a partial library
        finally:
            shutil.rmtree(work, ignore_errors=True)
        logger.info("built %s in %.1f s", target, time.perf_counter() - started)
    return target


def _compile_objects(compiler: str, level: IsaLevel, work: Path) -> list[str]:
    """Compile every source into `work`, one compiler per core at once (one after another a vector level's
    sources take 8-13 s; the longest, attention_tiles.c, about a third of that). Raises KernelBuildError
    naming a source that failed; returns the object files' paths."""
    objects = [str(work / f"{source.stem}.o") for source in SOURCES]
    commands = [object_command(compiler, level, source, out) for source, out in zip(SOURCES, objects)]
    workers = max(1, min(len(commands), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        runs = [pool.submit(_run, command, level, f"compiling {source.name}")
                for command, source in zip(commands, SOURCES)]
    for run in runs:
        run.result()
    return objects


def _run(command: list[str], level: IsaLevel, what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise KernelBuildError(f"{what} for the {level.name} kernels took over {_BUILD_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        raise KernelBuildError(f"{what} for the {level.name} kernels failed:\n{done.stderr[-3000:]}")


class _lock:
    """An exclusive lock on a file, waited for at most _LOCK_TIMEOUT_S."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    os.close(self.fd)
                    raise KernelBuildError(f"could not lock {self.path}: {exc}") from exc
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
