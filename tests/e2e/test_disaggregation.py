"""`tokenmill disagg-proxy` in front of a prefill server and a decode server, their blocks moving through a
shared folder or over TCP: the single server's answer, streamed or not, with the prompt computed on the
prefill server; without it, still the same answer; a transfer peer that hangs stalls no one else."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from e2e.server_harness import HOST, ServerProcess, free_port, local_http, metric, metric_samples, sse_events
from helpers.tiny_models import make_tiny_hf_model

PROMPT = "The lighthouse keeper counted the ships that passed in the night, one by one, until dawn came"
BODY = dict(model="m", prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)


def transfer_configs(connector: str, folder: Path) -> tuple[str, str]:
    """The prefill and the decode server's --kv-transfer-config."""
    if connector == "SharedStorageConnector":
        both = json.dumps({"kv_connector": connector, "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": str(folder)}})
        return both, both
    return (json.dumps({"kv_connector": connector, "kv_role": "kv_producer", "kv_ip": HOST, "kv_port": free_port()}),
            json.dumps({"kv_connector": connector, "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"fetch_timeout_s": 120}}))


# a small KV pool: the prompts here take a few blocks, and a pool sized from memory costs each server a GiB and
# seconds to start
COMMON = ("--block-size", "4", "--num-kv-blocks", "256", "--served-model-name", "m")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))


@pytest.fixture(scope="module")
def single(model, tmp_path_factory):
    """The plain server whose answers the pairs must give: it has no connector, so both connectors share it.
    Started here, waited for by `servers`, so that it boots alongside the first pair."""
    server = ServerProcess(model, *COMMON, log_path=tmp_path_factory.mktemp("single") / "single.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["SharedStorageConnector", "TCPConnector"])
def servers(request, model, single, tmp_path_factory):
    """A prefill and a decode server joined by the connector, and the proxy in front of them."""
    logs = tmp_path_factory.mktemp("disagg")
    produce, consume = transfer_configs(request.param, logs / "kv")
    prefill = ServerProcess(model, *COMMON, "--kv-transfer-config", produce, log_path=logs / "prefill.log").start()
    decode = ServerProcess(model, *COMMON, "--kv-transfer-config", consume, log_path=logs / "decode.log").start()
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "tokenmill.cli.main", "disagg-proxy", "--host", HOST,
                              "--port", str(port), "--prefill", f"http://{HOST}:{prefill.port}",
                              "--decode", f"http://{HOST}:{decode.port}"],
                             stdout=open(logs / "proxy.log", "wb"), stderr=subprocess.STDOUT)
    try:
        for server in (single, prefill, decode):
            server.wait_ready()
        url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if local_http().get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (logs / "proxy.log").read_text()
            time.sleep(0.2)
        yield single, prefill, decode, url
    finally:
        proxy.kill()
        proxy.wait()
        for server in (prefill, decode):  # both stop at once
            server.terminate()
        for server in (prefill, decode):
            server.stop()


def streamed(url: str, body: dict) -> tuple[str, list]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    return "".join(c["text"] for c in chunks), [lp for c in chunks for lp in c["logprobs"]["token_logprobs"]]


def stats(url: str) -> dict:
    return httpx.get(f"{url}/disagg/stats", timeout=5).json()


def test_the_proxy_answers_as_the_single_server_with_the_prompt_prefilled_elsewhere(servers):
    single, prefill, decode, url = servers
    before = stats(url)["disaggregated"]
    assert streamed(url, BODY) == streamed(single.url, BODY)
    whole = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()
    reference = httpx.post(f"{single.url}/v1/completions", json=BODY, timeout=60).json()
    assert whole["choices"][0]["text"] == reference["choices"][0]["text"]
    assert whole["choices"][0]["logprobs"]["token_logprobs"] == reference["choices"][0]["logprobs"]["token_logprobs"]
    prompt_tokens = whole["usage"]["prompt_tokens"]
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 4 * 4
    chat = dict(model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
    assert (httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["message"]
            == httpx.post(f"{single.url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["message"])
    assert stats(url)["disaggregated"] == before + 3


def test_vllm_router_drives_the_pair_as_it_drives_vllm(servers, tmp_path):
    """vllm-router's P/D mode sends do_remote_decode to the prefill server and its answer's
    kv_transfer_params to the decode server: the prompt comes from the transfer, the answer is the same."""
    single, prefill, decode, url = servers
    router_port = free_port()
    binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    router = subprocess.Popen([binary, "--host", HOST, "--port", str(router_port), "--vllm-pd-disaggregation",
                               "--prefill", prefill.url, "--decode", decode.url],
                              stdout=open(tmp_path / "router.log", "wb"), stderr=subprocess.STDOUT)
    try:
        body = {**BODY, "prompt": PROMPT + " through the router"}
        reference = httpx.post(f"{single.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        deadline = time.monotonic() + 60
        while True:
            try:
                answer = httpx.post(f"http://{HOST}:{router_port}/v1/completions", json=body, timeout=60)
                if answer.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text(errors="replace")[-2000:]
            time.sleep(0.3)
        hits = prefix_hits(decode)
        answer = httpx.post(f"http://{HOST}:{router_port}/v1/completions", json={**body, "prompt": body["prompt"] + "!"},
                            timeout=60).json()["choices"][0]
        again = httpx.post(f"{single.url}/v1/completions", json={**body, "prompt": body["prompt"] + "!"},
                           timeout=60).json()["choices"][0]
        assert answer["text"] == again["text"]
        # the router re-encodes the JSON, which may move a float's last printed digit
        assert answer["logprobs"]["token_logprobs"] == pytest.approx(again["logprobs"]["token_logprobs"], abs=1e-12)
        prompt_tokens = len(httpx.post(f"{single.url}/tokenize", json={"prompt": body["prompt"] + "!"}).json()["tokens"])
        assert prefix_hits(decode) - hits == (prompt_tokens - 1) // 4 * 4  # every full block was transferred
        assert reference["text"]  # the warm-up request was answered too
    finally:
        router.kill()
        router.wait()


def prefix_hits(server: ServerProcess) -> float:
    return metric(metric_samples(server.url), "tokenmill:prefix_cache_hits_total")


def test_without_the_prefill_server_the_decode_server_prefills_and_answers_the_same(servers):
    single, prefill, decode, url = servers
    body = {**BODY, "prompt": PROMPT + " again"}
    reference = streamed(single.url, body)
    prefill.stop()
    before = stats(url)["local_prefill"]
    assert streamed(url, body) == reference
    assert stats(url)["local_prefill"] == before + 1


@pytest.mark.parametrize("servers", ["TCPConnector"], indirect=True)
def test_a_transfer_peer_that_hangs_stalls_no_other_request(servers):
    """A request whose transfer comes from a peer that never answers waits alone: another request is
    answered meanwhile, and once the peer goes, the waiting one prefills locally with the same answer."""
    single, prefill, decode, url = servers
    peer = socket.create_server((HOST, 0))
    accepted = threading.Event()
    release = threading.Event()

    def hang():
        conn, _ = peer.accept()
        accepted.set()
        release.wait(120)
        conn.close()

    threading.Thread(target=hang, daemon=True).start()
    body = {**BODY, "prompt": "From a peer that hangs: " + PROMPT,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": HOST,
                                   "remote_port": peer.getsockname()[1], "remote_transfer_id": "ab12"}}
    reference = httpx.post(f"{single.url}/v1/completions", json={**body, "kv_transfer_params": None}, timeout=60).json()
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{decode.url}/v1/completions", json=body, timeout=180).json()))
    waiting.start()
    try:
        assert accepted.wait(60), "the decode server never reached the peer"
        other = httpx.post(f"{decode.url}/v1/completions", json={**BODY, "prompt": "meanwhile"}, timeout=60)
        assert other.status_code == 200 and other.json()["choices"][0]["text"]
        assert not answers, "the request behind the hanging peer cannot have an answer yet"
    finally:
        release.set()
        waiting.join(180)
        peer.close()
    (answer,) = answers
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    assert answer["choices"][0]["logprobs"]["token_logprobs"] == reference["choices"][0]["logprobs"]["token_logprobs"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
