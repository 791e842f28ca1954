"""`tokenmill serve` with 2 tensor-parallel ranks or 2 pipeline stages: the same streamed answer as one
rank; a rank killed (or stopped) mid-stream is replaced with its whole group and the stream goes on to the same
answer; one failure more than --max-worker-restarts makes the server exit for its supervisor, within seconds."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess
from helpers.tiny_models import make_tiny_hf_model

BODY = dict(prompt="The lighthouse keeper", max_tokens=24, temperature=0, logprobs=2)
# long enough that a rank signalled on the first streamed chunk is signalled mid-stream: 127 steps more to go (each
# a round trip through both ranks) while the client sends one signal to a pid it looked up before streaming. The
# test checks it: the server logs that the stream's request resumed (a kill) or that the group hung (a stop).
LONG = dict(BODY, max_tokens=128, extra_body={"ignore_eos": True})
# a small KV pool (the one request takes 2 blocks): a pool sized from memory costs each rank seconds to start
KV = ("--num-kv-blocks", "64")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", num_key_value_heads=4))


def streamed(url: str, body: dict = BODY, after_first_chunk=lambda: None) -> tuple[str, list]:
    """The streamed text and token logprobs of `body`; `after_first_chunk` runs once the first chunk came."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    text, logprobs = "", []
    for chunk in client.completions.create(model=client.models.list().data[0].id, stream=True, **body):
        if not text:
            after_first_chunk()
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
    """One rank's greedy text and token logprobs for BODY and LONG, from the engine in this process: the ranks'
    servers must stream exactly what the engine alone makes (a one-rank server of its own would add only its
    start)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny, num_kv_blocks=64)
    try:
        outs = llm.generate([BODY["prompt"]] * 2, [
            SamplingParams(max_tokens=body["max_tokens"], temperature=0, logprobs=BODY["logprobs"], ignore_eos=ignore)
            for body, ignore in ((BODY, False), (LONG, True))], use_tqdm=False)
    finally:
        llm.shutdown()
    return [(c.text, [entry[token].logprob for token, entry in zip(c.token_ids, c.logprobs)])
            for c in (out.outputs[0] for out in outs)]


def metric(url: str, name: str) -> float:
    """A series of the server's /metrics (its first sample)."""
    line = next(l for l in httpx.get(f"{url}/metrics").text.splitlines() if l.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def disturbed_mid_stream(server: ServerProcess, how: int) -> tuple[str, list]:
    """LONG streamed while one worker gets the signal `how` once the first chunk came (the worker looked up
    before the stream starts, so that the signal follows the first chunk at once)."""
    rank = worker_pids(server.proc.pid)[-1]
    return streamed(server.url, LONG, lambda: os.kill(rank, how))


def test_two_pipeline_stages_stream_the_one_rank_answer_and_with_no_replacement_a_killed_rank_stops_the_server(
        tiny, one_rank_answer, tmp_path):
    short, _ = one_rank_answer
    two = ServerProcess(tiny, "--pipeline-parallel-size", "2", *KV, "--max-worker-restarts", "0",
                        log_path=tmp_path / "two.log").start().wait_ready()
    try:
        assert streamed(two.url) == short
        workers = worker_pids(two.proc.pid)
        assert len(workers) == 2, two.log()[-2000:]
        os.kill(workers[-1], signal.SIGKILL)
        assert two.proc.wait(timeout=120) == 3, two.log()[-2000:]  # it exits by itself, however loaded the machine
        assert "worker rank" in two.log() and "not replacing it again" in two.log()
    finally:
        two.stop()


def test_two_ranks_stream_the_one_rank_answer_through_a_replaced_worker_group(tiny, one_rank_answer, tmp_path):
    """Tensor-parallel: a rank killed, then one stopped (SIGSTOP: the group hangs until --worker-step-timeout),
    mid-stream, each time replaced with its group (two within the window); a third failure exits 3."""
    short, long = one_rank_answer
    assert short[1] and len(long[1]) == LONG["max_tokens"], "the engine answered nothing to compare with"
    two = ServerProcess(tiny, "--tensor-parallel-size", "2", *KV, "--max-worker-restarts", "2",
                        "--worker-step-timeout", "5", log_path=tmp_path / "two.log").start().wait_ready()
    try:
        assert streamed(two.url) == short
        assert len(worker_pids(two.proc.pid)) == 2, two.log()[-2000:]
        assert disturbed_mid_stream(two, signal.SIGKILL) == long  # the client saw a pause, not an error
        assert metric(two.url, "tokenmill:worker_restarts_total") == 1
        assert metric(two.url, "tokenmill:worker_recovery_seconds") > 0
        assert "1 requests resume by recomputing" in two.log()  # the stream's request was in flight
        assert disturbed_mid_stream(two, signal.SIGSTOP) == long
        assert "the worker group hangs (stopped: rank 1)" in two.log()
        assert two.log().count("1 requests resume by recomputing") == 2  # this stream's request was in flight too
        assert len(worker_pids(two.proc.pid)) == 2, two.log()[-2000:]
        # one failure more within the window: the stream ends with an error and the server exits 3
        ended: list[BaseException] = []

        def last_stream() -> None:
            try:
                disturbed_mid_stream(two, signal.SIGKILL)
            except Exception as exc:  # (the SDK raises on the stream's error event or its broken connection)
                ended.append(exc)
        failed = threading.Thread(target=last_stream)
        failed.start()
        code = two.proc.wait(timeout=120)  # it exits by itself, however loaded the machine
        failed.join(timeout=60)
        assert code == 3, two.log()[-2000:]
        assert ended, "the last stream ended without an error"
        assert "not replacing it again" in two.log()
    finally:
        two.stop()


def test_a_size_that_does_not_divide_the_model_stops_the_server_with_the_numbers(tiny, tmp_path):
    server = ServerProcess(tiny, "--tensor-parallel-size", "3", *KV, log_path=tmp_path / "bad.log").start()
    assert server.proc.wait(timeout=120) != 0
    assert "tensor_parallel_size 3 does not divide the model's attention heads (4)" in server.log()
    server.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2.0)
