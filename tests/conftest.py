"""Shared test setup: make `tests/` importable so tests can `import helpers`, build the kernels with warnings
as errors, share the cores between pytest-xdist workers, and record every test's duration (`--durations-tsv`, which `make test` sets)."""

import os
import shlex
import sys
from collections import defaultdict
from pathlib import Path

# no GPU here: Triton kernels (the triton_paged backend) run in Triton's interpreter on CPU tensors. Triton
# reads this when it is first imported, so it is set before any test imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Every kernel library the suite builds is compiled with warnings as errors: test_build asserts that every level
# compiles warning-free, and with the same flags (part of a library's cache name) it reuses the libraries the
# other tests and their servers build instead of compiling each level a second time. The flag changes no code.
_KERNEL_CFLAGS = shlex.split(os.environ.get("TOKENMILL_KERNEL_CFLAGS", ""))
if "-Werror" not in _KERNEL_CFLAGS:
    os.environ["TOKENMILL_KERNEL_CFLAGS"] = shlex.join([*_KERNEL_CFLAGS, "-Werror"])

TESTS_DIR = str(Path(__file__).parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

# Under pytest-xdist each worker gets an equal share of the cores, and so does every server or rank process
# it starts (they inherit OMP_NUM_THREADS): N workers each using every core would oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

# The 30 files that take longest (test-artifacts/durations.tsv of a fresh clone's `make test` on the project machine,
# 2026-11-28), longest first, run before the others (which keep collection order). xdist hands a worker the next file whenever it
# finishes one, so with the long files first the workers end within a short file of each other, where a long file
# reached last had one worker run it while the other waited.
LONGEST_FIRST = ["tests/models/test_batch_invariance.py", "tests/e2e/test_gpu_check_dry_run.py",
                 "tests/kernels/test_build.py", "tests/models/test_triton_backend.py", "tests/e2e/test_web_ui.py",
                 "tests/models/test_vision_language.py", "tests/models/test_mla_vs_hf.py",
                 "tests/models/test_hybrid.py", "tests/models/test_smollm2_vs_hf.py", "tests/e2e/test_server.py",
                 "tests/models/test_speculative.py", "tests/models/test_parallel.py",
                 "tests/models/test_dense_families.py", "tests/models/test_precision.py",
                 "tests/models/test_hub_models.py", "tests/models/test_moe_vs_hf.py",
                 "tests/models/test_multinode.py", "tests/models/test_compressed_tensors.py",
                 "tests/reliability/test_openapi_fuzz.py", "tests/models/test_moe_families.py",
                 "tests/e2e/test_server_parallel.py", "tests/kernels/test_triton_attention.py",
                 "tests/models/test_gemma3_270m.py", "tests/e2e/test_data_parallel.py",
                 "tests/models/test_loaders.py", "tests/models/test_quantized_checkpoints.py",
                 "tests/e2e/test_disaggregation.py", "tests/models/test_kv_cache_quantized.py",
                 "tests/models/test_vision_language_kv.py", "tests/e2e/test_vision_language_server.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


# (test id, phase, seconds) of every report; on xdist's controller these are the workers' reports
_PHASES: list[tuple[str, str, float]] = []


def pytest_addoption(parser):
    parser.addoption("--durations-tsv", metavar="PATH", default=None,
                     help="write each test's setup, call and teardown seconds to PATH (test<TAB>phase<TAB>seconds) "
                          "and print the 20 slowest files")


def pytest_runtest_logreport(report):
    _PHASES.append((report.nodeid, report.when, report.duration))


def _writes_durations(config) -> bool:
    """Only the process that sees every report writes: xdist's controller, or pytest without xdist."""
    return config.getoption("durations_tsv") is not None and not hasattr(config, "workerinput")


def pytest_sessionfinish(session):
    config = session.config
    if not _writes_durations(config):
        return
    path = Path(config.getoption("durations_tsv"))
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [f"{test}\t{phase}\t{seconds:.3f}" for test, phase, seconds in _PHASES]
    path.write_text("\n".join(["test\tphase\tseconds", *rows]) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    if not _writes_durations(config) or not _PHASES:
        return
    per_file: dict[str, float] = defaultdict(float)
    for test, _, seconds in _PHASES:
        per_file[test.split("::")[0]] += seconds
    terminalreporter.write_sep("=", f"slowest 20 files (setup + call + teardown; {sum(per_file.values()):.0f} s "
                                    f"of test time in all, {config.getoption('durations_tsv')})")
    for path, seconds in sorted(per_file.items(), key=lambda item: -item[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
