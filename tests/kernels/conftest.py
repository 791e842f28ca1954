"""Fixtures shared by the native-kernel tests: the kernels of every instruction-set level this CPU runs.

With TOKENMILL_TEST_AARCH64=1 (`make test-arm`) the `kernels` fixture is instead the aarch64 build of the portable
kernels run under qemu-user (helpers/aarch64_kernels.py), and so is `process_kernels`, and they join
`kernels_of_every_level`; only the tests that take one of these are collected: the kernel tests, run for ARM
without an ARM machine."""

from __future__ import annotations

import os

import pytest

from tokenmill.kernels import isa
from tokenmill.kernels.cpu_kernels import cpu_kernels, load_kernels

AARCH64 = os.environ.get("TOKENMILL_TEST_AARCH64") == "1"
LEVELS = (isa.GENERIC,) if AARCH64 else isa.runnable_levels()
# the engine on the aarch64 kernels: `make test-arm` only (it needs qemu-user, which `make test` does not install)
collect_ignore = [] if AARCH64 else ["test_engine_on_aarch64.py"]


@pytest.fixture(scope="session")
def aarch64_kernels():
    """The aarch64 kernels under qemu (one qemu process for the session), under TOKENMILL_TEST_AARCH64=1."""
    from helpers.aarch64_kernels import aarch64_kernels as start
    with pytest.MonkeyPatch.context() as patch:
        native, remote = start(patch)
        yield native
        remote.close()


@pytest.fixture(scope="session", params=LEVELS, ids=["aarch64" if AARCH64 else level.name for level in LEVELS])
def kernels(request):
    """The native kernels built for each level this CPU executes, up to TOKENMILL_CPU_CAPABILITY: every
    test that takes this fixture runs once per level. They must build and load on the test machine."""
    return request.getfixturevalue("aarch64_kernels") if AARCH64 else load_kernels(request.param)


@pytest.fixture(scope="session")
def process_kernels(request):
    """The kernels this process's engine uses (`cpu_kernels()`: its best level, or None without them), for the
    tests that run every attention backend once rather than every level."""
    return request.getfixturevalue("aarch64_kernels") if AARCH64 else cpu_kernels()


@pytest.fixture(scope="session")
def kernels_of_every_level(request):
    """{name: kernels} of every level this CPU runs but amx (its tiles round differently), and under
    TOKENMILL_TEST_AARCH64=1 the aarch64 build too: for the tests that assert every build gives the same bits."""
    found = {level.name: load_kernels(level) for level in isa.runnable_levels() if level.name != "amx"}
    if AARCH64:
        found["aarch64"] = request.getfixturevalue("aarch64_kernels")
    return found


def pytest_collection_modifyitems(config, items):
    """Under TOKENMILL_TEST_AARCH64=1 keep only the tests that run the kernels of a fixture above."""
    if not AARCH64:
        return
    runs_kernels = {"kernels", "process_kernels", "kernels_of_every_level", "aarch64_kernels"}
    kept = [item for item in items if runs_kernels & set(getattr(item, "fixturenames", ()))]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


@pytest.fixture(scope="session")
def amx_kernels():
    """The amx level's kernels, on a CPU with AMX-BF16 (the tests that need it skip elsewhere)."""
    amx = [level for level in LEVELS if level.name == "amx"]
    if not amx:
        pytest.skip("this CPU has no AMX-TILE/AMX-BF16 (or TOKENMILL_CPU_CAPABILITY caps the level below amx)")
    lib = load_kernels(amx[0])
    assert lib.amx, "the CPU has AMX-BF16, so the AMX kernels must be usable"
    return lib
