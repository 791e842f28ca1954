"""Fixtures shared by the native-kernel tests."""

from __future__ import annotations

import pytest

from tokenmill.cpu_features import cpu_flags
from tokenmill.kernels.cpu_kernels import cpu_kernels


@pytest.fixture(scope="session")
def amx_kernels():
    """The native kernels, on a CPU with AMX-BF16 (the tests that need it skip elsewhere)."""
    lib = cpu_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    if "amx_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AMX-BF16")
    assert lib.amx, "the CPU has AMX-BF16, so the AMX kernels must be usable"
    return lib
