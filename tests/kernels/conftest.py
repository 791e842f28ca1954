"""Fixtures shared by the native-kernel tests: the kernels of every instruction-set level this CPU runs."""

from __future__ import annotations

import pytest

from tokenmill.kernels import isa
from tokenmill.kernels.cpu_kernels import load_kernels

LEVELS = isa.runnable_levels()


@pytest.fixture(scope="session", params=LEVELS, ids=[level.name for level in LEVELS])
def kernels(request):
    """The native kernels built for each level this CPU executes, up to TOKENMILL_CPU_CAPABILITY: every
    test that takes this fixture runs once per level. They must build and load on the test machine."""
    return load_kernels(request.param)


@pytest.fixture(scope="session")
def amx_kernels():
    """The amx level's kernels, on a CPU with AMX-BF16 (the tests that need it skip elsewhere)."""
    amx = [level for level in LEVELS if level.name == "amx"]
    if not amx:
        pytest.skip("this CPU has no AMX-TILE/AMX-BF16 (or TOKENMILL_CPU_CAPABILITY caps the level below amx)")
    lib = load_kernels(amx[0])
    assert lib.amx, "the CPU has AMX-BF16, so the AMX kernels must be usable"
    return lib
