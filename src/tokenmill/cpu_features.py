"""What the CPU can do, read once from /proc/cpuinfo (Linux; elsewhere nothing is assumed)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpu_flags() -> tuple[str, ...]:
    """The feature flags of the first CPU, in /proc/cpuinfo's order; empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ()
    return tuple(line.partition(":")[2].split())

