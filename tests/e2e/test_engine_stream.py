"""The live engine stream (`GET /v1/engine/stream`) of a real `tokenmill serve` on a tiny model: its samples
follow the schema of docs/dashboard.md, show the steps, the KV pool and each request's timeline while load
runs, agree with /metrics, and the stream's own limits answer in the OpenAI error shape."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.tiny_models import make_tiny_hf_model
from server_harness import ServerProcess, metric, metric_samples

NUM_BLOCKS = 256
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=4096)
    process = ServerProcess(str(model), "--max-model-len", "1024", "--num-kv-blocks", str(NUM_BLOCKS),
                            "--block-size", str(BLOCK_SIZE), log_path=tmp_path_factory.mktemp("logs") / "server.log")
    process.start()
    try:
        yield process.wait_ready().url
    finally:
        process.stop()


class StreamReader:
    """Reads the stream on a thread, keeping every sample."""

    def __init__(self, url: str, interval_ms: int = 100) -> None:
        self.samples: list[dict] = []
        self.closed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(f"{url}/v1/engine/stream?interval_ms={interval_ms}",),
                                        daemon=True)
        self._thread.start()

    def _read(self, url: str) -> None:
        with httpx.stream("GET", url, timeout=30) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.samples.append(json.loads(line[len("data: "):]))
                if self._stop.is_set():
                    break
        self.closed.set()

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for sample in self.samples[seen:]:
                if predicate(sample):
                    return sample
            seen = len(self.samples)
            time.sleep(0.05)
        raise AssertionError(f"no sample matched within {timeout} s ({len(self.samples)} samples)")

    def close(self) -> None:
        self._stop.set()
        self.closed.wait(10)


def complete(url: str, prompt: str, max_tokens: int = 24) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_sample_follows_the_documented_schema(server):
    reader = StreamReader(server)
    try:
        sample = reader.wait_for(lambda s: True)
    finally:
        reader.close()
    assert sample["version"] == 1 and sample["model"]
    assert abs(sample["time"] - time.time()) < 60
    scheduler, kv = sample["scheduler"], sample["kv"]
    assert {"running", "waiting", "preempted", "preemptions_total", "max_num_seqs", "steps"} <= set(scheduler)
    assert kv["num_blocks"] == NUM_BLOCKS and kv["block_size"] == BLOCK_SIZE and kv["blocks_per_cell"] == 1
    assert len(kv["map"]) == NUM_BLOCKS and set(kv["map"]) <= set("0123")
    assert sum(kv["counts"].values()) == NUM_BLOCKS
    for name in ("ttft", "itl", "e2e", "queue"):
        histogram = sample["latency"][name]
        assert len(histogram["counts"]) == len(histogram["le"]) + 1
        assert sum(histogram["counts"]) == histogram["count"]
    assert set(sample["requests"]["finished"]) == {"stop", "length", "abort", "error"}
    assert {"drafts", "draft_tokens", "accepted_tokens", "acceptance_rate"} <= set(sample["spec"])
    assert sample["encoder"] == {"images_total": 0, "seconds_total": 0}  # a text-only model encodes no image


def test_load_shows_as_steps_timeline_and_cached_blocks(server):
    reader = StreamReader(server)
    try:
        reader.wait_for(lambda s: True)
        prompt = "the quick brown fox jumps over the lazy dog " * 12  # several full blocks
        first = complete(server, prompt)
        again = complete(server, prompt)  # the prompt's full blocks are found in the prefix cache
        ids = {f"{first['id']}-0", f"{again['id']}-0"}  # the engine's ids: the response's, then the prompt's index
        sample = reader.wait_for(lambda s: {t["id"] for t in s["timeline"] if t["finished"]} >= ids)
        steps = [step for s in reader.samples for step in s["scheduler"]["steps"]]
    finally:
        reader.close()
    assert sum(step["prefill_tokens"] for step in steps) > 0 and sum(step["decode_tokens"] for step in steps) > 0
    assert all(step["duration_ms"] >= 0 and step["requests"] >= 1 for step in steps)
    seqs = [step["seq"] for step in steps]
    assert seqs == sorted(set(seqs)), "each step is sent once, in order"
    traces = {t["id"]: t for t in sample["timeline"]}
    for request_id in ids:
        trace = traces[request_id]
        assert trace["finish_reason"] == "length"
        kinds = [span[0] for span in trace["spans"]]
        assert kinds[0] == "prefill" and "decode" in kinds
        assert trace["arrival"] <= trace["first_scheduled"] <= trace["spans"][0][1] <= trace["finished"]
        assert sum(span[3] for span in trace["spans"] if span[0] == "decode") == 23  # the first token ends the prefill
    kv = sample["kv"]
    assert kv["counts"]["evictable"] > 0 and "2" in kv["map"]  # cached blocks, free to evict
    assert kv["prefix_cache"]["hits"] > 0 and kv["prefix_cache"]["hit_rate"] > 0


def test_the_stream_and_metrics_agree(server):
    complete(server, "counting the tokens twice")
    reader = StreamReader(server)
    try:
        sample = reader.wait_for(lambda s: s["scheduler"]["running"] == 0 and s["scheduler"]["waiting"] == 0)
        samples = metric_samples(server)
    finally:
        reader.close()
    assert sample["tokens"]["generation_total"] == metric(samples, "tokenmill:generation_tokens_total") > 0
    assert sample["tokens"]["prefill_total"] == metric(samples, "tokenmill:iteration_prefill_tokens_total") > 0
    assert sample["tokens"]["decode_total"] == metric(samples, "tokenmill:iteration_decode_tokens_total") > 0
    assert sample["latency"]["ttft"]["count"] == metric(samples, "tokenmill:time_to_first_token_seconds_count") > 0
    assert sample["requests"]["finished"]["length"] == metric(samples, "tokenmill:request_success_total",
                                                              finish_reason="length") > 0


def test_bad_intervals_and_too_many_streams_are_refused(server):
    for interval in (0, 10, 60_000):
        response = httpx.get(f"{server}/v1/engine/stream", params={"interval_ms": interval}, timeout=10)
        assert response.status_code == 400
        assert "interval_ms must be between 50 and 10000" in response.json()["error"]["message"]
    readers = [StreamReader(server, interval_ms=1000) for _ in range(8)]
    try:
        for reader in readers:
            reader.wait_for(lambda s: True)
        response = httpx.get(f"{server}/v1/engine/stream", timeout=10)
        assert response.status_code == 429 and response.json()["error"]["type"] == "rate_limit_error"
    finally:
        for reader in readers:
            reader.close()
    reader = StreamReader(server)  # closed streams give their places back
    try:
        reader.wait_for(lambda s: True, timeout=15)
    finally:
        reader.close()


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(server):
    complete(server, "one finished request, so that every labelled family has a sample")
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "examples" / "grafana" / "tokenmill.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"tokenmill:[a-z0-9_]+", expr)}
    exported = {name for name, _ in metric_samples(server)}
    assert len(queried) >= 15 and queried <= exported, sorted(queried - exported)
