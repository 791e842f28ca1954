"""This process's resident memory, as the OS counts it (what sleep mode gives back is measured with it)."""

from __future__ import annotations

import os
import resource


def resident_bytes() -> int:
    """The process's resident set now (Linux: /proc/self/statm); elsewhere its peak (getrusage), the best there is."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
