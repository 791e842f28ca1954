"""How many threads a rank's native kernels and PyTorch run, and the CPUs they are pinned to (--threads,
--cpu-bind): vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND, llama.cpp's -t and --cpu-range.

OpenMP keeps the team's size per calling thread, so a plan is applied in every thread that runs a rank's steps
(worker/worker.py's apply_thread_plan, once per thread): PyTorch's thread count, and with CPUs named, each thread of the team
pinned to one of them (kernels/threads.c), the calling thread being thread 0. The kernels share PyTorch's libgomp,
so one team serves both. Without CPUs named the OS schedules the threads (the default); with several ranks on a
node each gets an equal share of the node's CPUs by default. NUMA: a rank pinned to one node's CPUs allocates its
weights and KV pool there on first touch (Linux's default policy), as it loads them after pinning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThreadPlan:
    """A rank's threads: how many (None: PyTorch's default, the process's CPUs) and the CPU each is pinned to
    (thread i on cpus[i]; None: the OS schedules them)."""

    threads: Optional[int] = None
    cpus: Optional[tuple[int, ...]] = None

    def describe(self) -> str:
        """The plan as the start-up log says it."""
        if self.threads is None:
            return "PyTorch's default thread count, not pinned"
        pinned = f", pinned to CPUs {format_cpu_list(self.cpus)}" if self.cpus else ", not pinned"
        return f"{self.threads} thread(s){pinned}"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8), in the order written; ValueError for anything else, or a CPU named twice."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a CPU number or a range like 0-3") from None
        if low < 0 or high < low:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a CPU number or an ascending range")
        cpus.extend(range(low, high + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu list {text!r} names a CPU twice")
    return tuple(cpus)


def format_cpu_list(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8' (runs of consecutive CPUs as ranges)."""
    parts, start = [], 0
    for i in range(1, len(cpus) + 1):
        if i == len(cpus) or cpus[i] != cpus[i - 1] + 1:
            parts.append(str(cpus[start]) if i - 1 == start else f"{cpus[start]}-{cpus[i - 1]}")
            start = i
    return ",".join(parts)


def check_cpu_bind(cpu_bind: str) -> None:
    """ValueError unless `cpu_bind` is none, auto, or '|'-separated CPU lists (before any rank starts)."""
    if cpu_bind not in ("none", "auto"):
        for part in cpu_bind.split("|"):
            parse_cpu_list(part)


def thread_plan(threads: Optional[int], cpu_bind: str, local_rank: int = 0, ranks_per_node: int = 1,
                available: Optional[list[int]] = None) -> ThreadPlan:
    """The plan of rank `local_rank` of the `ranks_per_node` on this node, given --threads and --cpu-bind, over the
    CPUs this process may run on (`available`: os.sched_getaffinity's). ValueError naming what does not fit."""
    available = sorted(os.sched_getaffinity(0)) if available is None else available
    if cpu_bind == "none":
        if threads is None and ranks_per_node > 1:  # the ranks share the node's CPUs
            threads = max(1, len(available) // ranks_per_node)
        return ThreadPlan(threads, None)
    if cpu_bind == "auto":
        share = len(available) // ranks_per_node
        if share == 0:
            raise ValueError(f"cpu_bind auto: {ranks_per_node} ranks on this node, but the process may run on "
                             f"{len(available)} CPU(s) only")
        part = tuple(available[local_rank * share:(local_rank + 1) * share])
    else:
        lists = cpu_bind.split("|")
        if len(lists) != ranks_per_node:
            raise ValueError(f"cpu_bind {cpu_bind!r} gives {len(lists)} CPU list(s); this node runs "
                             f"{ranks_per_node} rank(s): one '|'-separated list each")
        part = parse_cpu_list(lists[local_rank])
        foreign = sorted(set(part) - set(available))
        if foreign:
            raise ValueError(f"cpu_bind {cpu_bind!r}: CPU(s) {format_cpu_list(tuple(foreign))} are not this "
                             f"process's (it may run on {format_cpu_list(tuple(available))})")
    threads = len(part) if threads is None else threads
    if threads > len(part):
        raise ValueError(f"threads {threads} is more than the {len(part)} CPU(s) cpu_bind gives rank {local_rank} "
                         f"({format_cpu_list(part)}): one thread a CPU")
    return ThreadPlan(threads, part[:threads])
