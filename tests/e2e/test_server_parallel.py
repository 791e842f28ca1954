"""`tokenmill serve` with 2 tensor-parallel ranks or 2 pipeline stages: the same streamed answer as one
rank; a killed rank makes the server exit for its supervisor, within seconds."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess
from helpers.tiny_models import make_tiny_hf_model

BODY = dict(prompt="The lighthouse keeper", max_tokens=24, temperature=0, logprobs=2)
# a small KV pool (the one request takes 2 blocks): a pool sized from memory costs each rank seconds to start
KV = ("--num-kv-blocks", "64")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", num_key_value_heads=4))


def streamed(url: str) -> tuple[str, list]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    text, logprobs = "", []
    for chunk in client.completions.create(model=client.models.list().data[0].id, stream=True, **BODY):
        text += chunk.choices[0].text
        logprobs += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    return text, logprobs


def worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes: the children of the forkserver it started (executor/rank_start.py), which
    is one of its own children (multiprocessing's resource tracker is another)."""
    def children(pid: int) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
            except OSError:
                continue
        return found

    def cmdline(pid: int) -> bytes:
        try:
            return open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            return b""

    servers = [pid for pid in children(server_pid) if b"forkserver" in cmdline(pid)]
    return sorted(worker for server in servers for worker in children(server))


@pytest.fixture(scope="module")
def one_rank_answer(tiny):
    """One rank's greedy text and token logprobs for BODY, from the engine in this process: the ranks' servers
    must stream exactly what the engine alone makes (a one-rank server of its own would add only its start)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny, num_kv_blocks=64)
    try:
        (out,) = llm.generate(BODY["prompt"], SamplingParams(max_tokens=BODY["max_tokens"], temperature=0,
                                                             logprobs=BODY["logprobs"]), use_tqdm=False)
    finally:
        llm.shutdown()
    (completion,) = out.outputs
    return completion.text, [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_ranks_stream_the_one_rank_answer_and_a_killed_rank_stops_the_server(tiny, one_rank_answer, flag,
                                                                                   tmp_path):
    expected = one_rank_answer
    assert expected[1], "the engine answered nothing to compare with"
    two = ServerProcess(tiny, flag, "2", *KV, log_path=tmp_path / "two.log").start().wait_ready()
    try:
        assert streamed(two.url) == expected
        workers = worker_pids(two.proc.pid)
        assert len(workers) == 2, two.log()[-2000:]
        os.kill(workers[-1], signal.SIGKILL)
        code = two.proc.wait(timeout=120)  # it exits by itself, however loaded the machine
        assert code == 3, two.log()[-2000:]
        assert "worker rank" in two.log()
    finally:
        two.stop()


def test_a_size_that_does_not_divide_the_model_stops_the_server_with_the_numbers(tiny, tmp_path):
    server = ServerProcess(tiny, "--tensor-parallel-size", "3", *KV, log_path=tmp_path / "bad.log").start()
    assert server.proc.wait(timeout=120) != 0
    assert "tensor_parallel_size 3 does not divide the model's attention heads (4)" in server.log()
    server.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2.0)
