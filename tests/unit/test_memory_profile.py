"""Sizing the KV pool from GPU memory: the arithmetic of what gpu_memory_utilization leaves."""

from __future__ import annotations

import pytest

from tokenmill.worker.memory_profile import blocks_for_budget

GIB = 1 << 30


def test_the_pool_gets_what_the_peak_and_memory_outside_pytorch_leave():
    # 80 GiB card at 0.9: 72 GiB; 10 GiB peak (weights + a full step), 1 GiB outside PyTorch's allocator
    # (total 80 - free 60 - reserved 19), so 61 GiB of 1 MiB blocks
    assert blocks_for_budget(80 * GIB, 60 * GIB, 19 * GIB, 10 * GIB, 0.9, 1 << 20) == 61 * 1024


def test_a_budget_that_leaves_nothing_is_refused_with_the_figures():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.1 leaves no memory for the KV cache: 10.00 GiB"):
        blocks_for_budget(80 * GIB, 70 * GIB, 10 * GIB, 10 * GIB, 0.1, 1 << 20)
