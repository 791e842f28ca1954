"""Ranks spread over two nodes (two processes on this host's loopback, as two hosts would run them): the
torchrun-style flags give the one-rank tokens and logprobs, and a node that is missing or has the wrong
secret is named in a clear error, not a hang."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers.tiny_models import make_tiny_hf_model
from tokenmill.engine.llm import LLM
from tokenmill.executor import ExecutorDiedError
from tokenmill.sampling_params import SamplingParams

PROMPT_IDS = [[1, 5, 9, 13, 2, 7], [3, 3, 8], list(range(20, 45))]
SECRET = "loopback-test-secret"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("llama"), num_key_value_heads=4, num_hidden_layers=4))


def two_free_ports() -> int:
    """A port p with p and p + 1 free (the rendezvous and the step channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def start_node(model: str, node_rank: int, port: int, secret: str, log_path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TOKENMILL_DIST_KEY": secret}
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", "serve", model, "--nnodes", "2",
                             "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                             *extra], env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_for_log(path, text: str, process: subprocess.Popen, timeout: float = 300.0) -> None:
    """Block until `text` appears in the log at `path` (raise if the process ends first, or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert process.poll() is None, f"the node exited before logging {text!r}:\n{path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{text!r} not logged within {timeout:g} s"
        time.sleep(0.1)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


def ids_and_logprobs(outputs):
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


def test_two_nodes_tensor_x_pipeline_equal_one_rank(tiny_llama, tmp_path, monkeypatch):
    single = ids_and_logprobs(LLM(tiny_llama, dtype="float32").generate(PROMPT_IDS, greedy(), use_tqdm=False))
    port = two_free_ports()
    sizes = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    node1 = start_node(tiny_llama, 1, port, SECRET, tmp_path / "node1.log", *sizes)
    monkeypatch.setenv("TOKENMILL_DIST_KEY", SECRET)
    try:
        llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                  node_rank=0, master_addr="127.0.0.1", master_port=port)
        try:
            assert "4 worker processes on 2 nodes" in llm.llm_engine.executor.description
            # node 1 holds the last stage, so every answer crosses the node's connection
            assert ids_and_logprobs(llm.generate(PROMPT_IDS, greedy(), use_tqdm=False)) == single
        finally:
            llm.shutdown()
        assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()
    finally:
        node1.kill()


def test_a_node_that_goes_away_fails_the_engine_naming_its_rank(tiny_llama, tmp_path, monkeypatch):
    port = two_free_ports()
    node1 = start_node(tiny_llama, 1, port, SECRET, tmp_path / "node1.log", "--tensor-parallel-size", "2")
    monkeypatch.setenv("TOKENMILL_DIST_KEY", SECRET)
    try:
        llm = LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, master_port=port)
        try:
            assert llm.generate(PROMPT_IDS[0], greedy(), use_tqdm=False)[0].outputs[0].token_ids
            node1.send_signal(signal.SIGTERM)  # stops its worker: the engine is idle, so its monitor notices
            assert node1.wait(timeout=30) == 1
            deadline = time.monotonic() + 10
            while llm.llm_engine.executor.failure() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "worker rank 1 (on another node) is gone" in (llm.llm_engine.executor.failure() or "")
            with pytest.raises(ExecutorDiedError, match="worker rank 1"):
                llm.generate(PROMPT_IDS[0], greedy(), use_tqdm=False)
        finally:
            llm.shutdown()
    finally:
        node1.kill()


def test_a_node_with_the_wrong_secret_is_refused_and_node_0_names_the_missing_ranks(tiny_llama, tmp_path,
                                                                                    monkeypatch):
    port = two_free_ports()
    node1 = start_node(tiny_llama, 1, port, "not-the-secret", tmp_path / "node1.log", "--tensor-parallel-size", "2",
                       "--distributed-timeout", "120")
    monkeypatch.setenv("TOKENMILL_DIST_KEY", SECRET)
    try:
        # node 0 waits 6 s for node 1's worker, so the worker is knocking before node 0 starts (it knocks for up
        # to 120 s: node 0 is listening long before that, however loaded the machine)
        wait_for_log(tmp_path / "node1.log", "connecting to node 0's engine", node1)
        with pytest.raises(RuntimeError, match=r"worker ranks \[1\] \(node_rank 1\) did not connect"):
            LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, master_port=port, distributed_timeout=6)
        assert node1.wait(timeout=60) == 1
        assert "TOKENMILL_DIST_KEY differs from node 0's" in (tmp_path / "node1.log").read_text()
    finally:
        node1.kill()


def test_multi_node_flags_are_checked_before_anything_starts(tiny_llama, monkeypatch):
    monkeypatch.delenv("TOKENMILL_DIST_KEY", raising=False)
    with pytest.raises(ValueError, match="nnodes 2 does not divide tensor_parallel_size x pipeline_parallel_size"):
        LLM(tiny_llama, tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes\)"):
        LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="node_rank 1 runs only workers"):
        LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="needs TOKENMILL_DIST_KEY"):
        LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, distributed_timeout=5)
