"""--threads and --cpu-bind (tokenmill/cpu_threads.py): CPU lists parse and print as vLLM-CPU's
VLLM_CPU_OMP_THREADS_BIND writes them, each rank of a node gets its share or its list, what does not fit is refused
naming it; and an engine pinned to CPUs runs its steps on an OpenMP team of that size, thread i on the i-th CPU,
without touching other threads. Cost: one tiny engine (~1 s), in a thread of its own so that its pinning stays
there."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from helpers.agreeing_drafts import write_bigram_llama
from tokenmill import LLM, SamplingParams
from tokenmill.cpu_threads import ThreadPlan, format_cpu_list, parse_cpu_list, thread_plan
from tokenmill.kernels.cpu_kernels import cpu_kernels


def test_cpu_lists_parse_and_print_as_ranges():
    assert parse_cpu_list("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cpu_list("5, 1") == (5, 1)  # the order given: thread 0 on CPU 5
    assert format_cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    for bad, said in (("0-", "not a CPU number"), ("3-1", "ascending"), ("a", "not a CPU number"),
                      ("1,1", "names a CPU twice"), ("-2", "not a CPU number")):
        with pytest.raises(ValueError, match=said):
            parse_cpu_list(bad)


def test_each_rank_of_a_node_gets_its_share_or_its_list():
    cpus = list(range(8))
    assert thread_plan(None, "none", available=cpus) == ThreadPlan(None, None)  # PyTorch's default
    assert thread_plan(None, "none", 1, 4, available=cpus) == ThreadPlan(2, None)  # the node's CPUs shared out
    assert thread_plan(3, "none", available=cpus) == ThreadPlan(3, None)
    assert thread_plan(None, "auto", 1, 2, available=cpus) == ThreadPlan(4, (4, 5, 6, 7))
    assert thread_plan(2, "auto", 0, 2, available=cpus) == ThreadPlan(2, (0, 1))
    assert thread_plan(None, "6,7|0-2", 1, 2, available=cpus) == ThreadPlan(3, (0, 1, 2))
    for threads, bind, rank, ranks, said in (
            (None, "0-3", 0, 2, "gives 1 CPU list.*this node runs 2 rank"),
            (None, "0-9", 0, 1, r"CPU\(s\) 8-9 are not this process's \(it may run on 0-7\)"),
            (5, "0-3", 0, 1, "threads 5 is more than the 4 CPU"),
            (None, "auto", 0, 16, "16 ranks on this node, but the process may run on 8 CPU")):
        with pytest.raises(ValueError, match=said):
            thread_plan(threads, bind, rank, ranks, available=cpus)
    with pytest.raises(ValueError, match="cpu list '0-x'"):
        LLM("unused", cpu_bind="0-x")  # refused with the config, before anything loads
    with pytest.raises(ValueError, match="threads must be >= 1"):
        LLM("unused", threads=0)


def test_an_engine_runs_its_steps_on_the_pinned_team_and_leaves_other_threads_alone(tmp_path):
    available = sorted(os.sched_getaffinity(0))
    cpus = available[:2][::-1]  # thread 0 on the higher CPU: the order is the list's
    bind = ",".join(map(str, cpus))
    path = str(write_bigram_llama(tmp_path))  # (written without transformers: ~2 s less)
    kernels, seen = cpu_kernels(), {}
    before = (os.sched_getaffinity(0), torch.get_num_threads())

    def engine_thread():
        try:
            llm = LLM(path, threads=len(cpus), cpu_bind=bind, num_kv_blocks=16)
            seen["ids"] = llm.generate(["one two three"], SamplingParams(temperature=0, max_tokens=4),
                                       use_tqdm=False)[0].outputs[0].token_ids
            seen["team"], seen["torch"] = kernels.thread_cpus(), torch.get_num_threads()
        except Exception as exc:
            seen["error"] = exc

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    if kernels is None:  # TOKENMILL_KERNELS=off: nothing could pin the team, and it says so
        assert "native kernels, which are off" in str(seen["error"])
        return
    assert "error" not in seen and len(seen["ids"]) == 4
    assert seen["team"] == cpus and seen["torch"] == len(cpus)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before  # this thread's own are untouched
    assert -1 in kernels.thread_cpus() or len(available) == 1  # and its team floats
