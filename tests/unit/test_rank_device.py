"""Each rank of a parallel run on its own GPU, talking over NCCL (gloo between CPU ranks)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.parallel.group import distributed_backend, init_tensor_parallel, rank_device


def test_a_cuda_rank_gets_the_gpu_of_its_local_rank():
    assert rank_device("cuda", rank=3, ranks_per_node=2) == torch.device("cuda", 1)
    assert [rank_device("cuda", r, 4) for r in range(8)] == [torch.device("cuda", i) for i in (0, 1, 2, 3) * 2]
    assert rank_device(torch.device("cuda"), rank=0, ranks_per_node=1) == torch.device("cuda", 0)
    assert rank_device("cuda:2", rank=1, ranks_per_node=2) == torch.device("cuda", 3)  # counted from the index named


def test_a_cpu_rank_stays_on_the_cpu():
    assert rank_device("cpu", rank=3, ranks_per_node=2) == torch.device("cpu")


def test_backend_is_nccl_on_cuda_and_gloo_on_cpu():
    assert distributed_backend(torch.device("cuda", 1)) == "nccl"
    assert distributed_backend(torch.device("cpu")) == "gloo"


def test_a_cuda_rank_without_its_gpu_is_refused():
    with pytest.raises(ValueError, match="rank_device"):
        init_tensor_parallel(1, 2, "tcp://127.0.0.1:1", torch.device("cuda"))


def test_a_cuda_rank_binds_its_gpu_before_joining_over_nccl(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kwargs: calls.append(("init", backend, kwargs["rank"])))
    group = init_tensor_parallel(3, 4, "tcp://127.0.0.1:1", rank_device("cuda", 3, 2))
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "nccl", 3)]
    assert (group.rank, group.size) == (3, 4)
