"""tokenmill behind the routers users already run, installed from PyPI: vllm-router places requests by
tokenmill's KV events (its kv_aware policy), sglang-router by its own prefix tree (cache_aware).
Either way, requests that repeat a prefix land on the replica holding it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from e2e.server_harness import HOST, ServerProcess, free_port, local_http, metric_samples
from helpers.tiny_models import make_tiny_hf_model

BLOCK = 4
PREFIXES = {"a": "Once upon a midnight dreary, while I pondered, weak and weary, over many a quaint volume",
            "b": "Shall I compare thee to a summer's day? Thou art more lovely and more temperate, said he",
            "c": "It was the best of times, it was the worst of times, it was the age of wisdom and folly"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two tokenmill servers, each publishing KV events on its own tcp ports."""
    model = str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))
    logs = tmp_path_factory.mktemp("replicas")
    servers = []
    for rank in range(2):
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}",
                  "replay_endpoint": f"tcp://*:{free_port()}"}
        # a small KV pool (the prompts here take a few blocks): a pool sized from memory costs seconds to start
        server = ServerProcess(model, "--block-size", str(BLOCK), "--num-kv-blocks", "256", "--served-model-name", "m",
                               "--kv-events-config", json.dumps(events), log_path=logs / f"r{rank}.log")
        server.events = {k: v.replace("*", HOST) for k, v in events.items() if k.endswith("endpoint")}
        servers.append(server.start())
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:  # both stop at once
            server.terminate()
        for server in servers:
            server.stop()


def start_router(command: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*command, "--host", HOST, "--port", str(port)], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        try:
            if local_http().post(f"{url}/v1/completions", json={"model": "m", "prompt": "warm", "max_tokens": 1},
                          timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError(log.read_text(errors="replace")[-3000:])


def finished(server: ServerProcess) -> float:
    samples = metric_samples(server.url)
    return sum(v for (name, _), v in samples.items() if name == "tokenmill:request_success_total")


def complete(url: str, prompt: str) -> dict:
    answer = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2,
                                                       "temperature": 0}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def served_by(replicas, url: str, prompt: str) -> tuple[int, int]:
    """(the replica that answered, the prompt tokens its prefix cache supplied)."""
    before = [finished(r) for r in replicas]
    answer = complete(url, prompt)
    after = [finished(r) for r in replicas]
    (rank,) = [i for i in range(len(replicas)) if after[i] > before[i]]
    return rank, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def router_binary(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is a test dependency (pip install -e '.[test]')"
    return path


def test_vllm_router_places_requests_by_tokenmills_kv_events(replicas, tmp_path):
    command = [router_binary("vllm-router"), "--policy", "kv_aware", "--kv-event-block-size", str(BLOCK),
               "--kv-event-model", "m", "--worker-urls", *[r.url for r in replicas]]
    for r in replicas:
        command += ["--kv-event-source", f"{r.url}={r.events['endpoint']}",
                    "--kv-event-replay-source", f"{r.url}={r.events['replay_endpoint']}"]
    proc, url = start_router(command, tmp_path / "vllm-router.log")
    try:
        # Each replica gets a different prefix directly, behind the router's back: only the replicas'
        # KV events can tell the router where each prefix lives.
        complete(replicas[1].url, PREFIXES["a"] + " warm")
        complete(replicas[0].url, PREFIXES["b"] + " warm")
        time.sleep(1.0)
        for question in range(3):
            assert served_by(replicas, url, f"{PREFIXES['a']} question {question}")[0] == 1
            rank, cached = served_by(replicas, url, f"{PREFIXES['b']} question {question}")
            assert rank == 0 and cached >= 16
    finally:
        proc.kill()
        proc.wait()


def test_sglang_router_keeps_a_prefix_on_the_replica_it_first_chose(replicas, tmp_path):
    command = [sys.executable, "-m", "sglang_router.launch_router", "--policy", "cache_aware", "--worker-urls",
               *[r.url for r in replicas]]
    proc, url = start_router(command, tmp_path / "sglang-router.log")
    try:
        first, _ = served_by(replicas, url, f"{PREFIXES['c']} question 0")
        for question in range(1, 4):
            rank, cached = served_by(replicas, url, f"{PREFIXES['c']} question {question}")
            assert rank == first and cached >= 16
    finally:
        proc.kill()
        proc.wait()
