"""OpenAI's Files and Batch API (server/batch_api.py) driven by the official `openai` SDK, unmodified, against the
server's own app in-process: files.create, batches.create, batches.retrieve until the batch completes, and
files.content of its output and error files, in OpenAI's shapes: the good lines answered as the route answers them,
the bad ones in the error file; cancel, unknown ids and a wrong purpose; a batch cut off by a restart resumes from the
lines it had not finished. Cost: one tiny engine (~1 s)."""

from __future__ import annotations

import io
import json
import time

import pytest
from fastapi.testclient import TestClient
from openai import NotFoundError, OpenAI

from helpers.agreeing_drafts import write_bigram_llama
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import build_app
from tokenmill.server.tenants import Tenants


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = str(write_bigram_llama(tmp_path_factory.mktemp("batches")))
    engine = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(model=path, num_kv_blocks=64)), "tiny")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    with TestClient(build_app(engine, ServerConfig(state_dir=str(state)), None, Tenants.single_key("k"))) as http:
        yield OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http), state, http


def _lines() -> bytes:
    good = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": 2, "temperature": 0}} for i in range(8)]
    bad = [{"custom_id": "bad-max", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": [5], "max_tokens": 0}},
           {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}]
    return ("\n".join(json.dumps(line) for line in good + bad) + "\n").encode()


def test_the_sdk_runs_a_batch_end_to_end(client):
    sdk, state, _ = client
    upload = sdk.files.create(file=("in.jsonl", io.BytesIO(_lines())), purpose="batch")
    # under --api-key, the one tenant "default" owns what it uploads
    assert upload.bytes == len(_lines()) and (state / "files" / "tenants" / "default" / upload.id).is_file()
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                               metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress", "finalizing", "completed")
    while batch.status not in ("completed", "failed", "cancelled"):  # the batch runs on the server's loop
        batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.metadata == {"job": "test"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 8, 2)
    output = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    errors = {json.loads(line)["custom_id"]: json.loads(line) for line in
              sdk.files.content(batch.error_file_id).text.splitlines()}
    assert sorted(o["custom_id"] for o in output) == [f"c{i}" for i in range(8)]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["usage"]["completion_tokens"] == 2
               for o in output)
    assert errors["bad-max"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert "not this batch's endpoint" in errors["bad-url"]["error"]["message"]
    assert batch.id in [b.id for b in sdk.batches.list()]


def test_cancel_unknown_ids_and_a_wrong_purpose(client):
    sdk, _, http = client
    key = {"Authorization": "Bearer k"}
    with pytest.raises(NotFoundError):
        sdk.batches.retrieve("batch_missing")
    with pytest.raises(NotFoundError):
        sdk.files.content("file-missing")
    response = http.post("/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "fine-tune"}, headers=key)
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"
    # the engine paused (mode keep): the batch's lines wait outside it, so the cancel lands before any finishes
    assert http.post("/pause?mode=keep", headers=key).json() == {"is_paused": True}
    upload = sdk.files.create(file=("in.jsonl", io.BytesIO(_lines())), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    cancelled = sdk.batches.cancel(batch.id)
    while cancelled.status == "cancelling":
        cancelled = sdk.batches.retrieve(batch.id)
    http.post("/resume", headers=key)
    assert cancelled.status == "cancelled" and cancelled.request_counts.completed == 0
    assert sdk.files.delete(upload.id).deleted


def test_a_batch_past_its_completion_window_expires_with_its_lines_failed(client):
    sdk, _, http = client
    batches = http.app.state.batches
    batches.window_s = 0  # (24 h for real: a window that has already ended)
    try:
        upload = sdk.files.create(file=("in.jsonl", io.BytesIO(_lines())), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        while batch.status in ("validating", "in_progress"):
            batch = sdk.batches.retrieve(batch.id)
    finally:
        batches.window_s = 24 * 3600
    assert batch.status == "expired", batch.errors
    assert batch.expired_at is not None and batch.output_file_id is None
    assert batch.request_counts.failed == batch.request_counts.total > 0
    errors = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and len(errors) == batch.request_counts.total


def test_a_batch_cut_off_by_a_restart_resumes_from_the_lines_it_had_not_finished(engine, tmp_path):
    """A server with --state-dir stops while a batch runs (three lines answered, the fourth held in the paused engine);
    a new server on the same folder runs the rest as the batch's tenant: every line answered once, the three kept
    as they were (their output lines, ids included, are the first life's)."""
    from tokenmill.server.durable_state import SqliteBatches

    config = ServerConfig(state_dir=str(tmp_path), batch_max_concurrency=1)  # one line at a time
    key = {"Authorization": "Bearer k"}
    with TestClient(build_app(engine, config, None, Tenants.single_key("k"))) as http:
        sdk = OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http)
        upload = sdk.files.create(file=("in.jsonl", io.BytesIO(_lines())), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        while batch.request_counts.completed < 3:
            batch = sdk.batches.retrieve(batch.id)
        http.post("/pause?mode=keep", headers=key)  # the line in flight cannot finish before the server stops
    engine.resume()
    kept = SqliteBatches(str(tmp_path))
    before = kept.lines(batch.id)
    [(stored, owner)] = kept.listing()
    assert 3 <= len(before) < 10 and (stored["id"], stored["status"], owner) == (batch.id, "in_progress", "default")
    with TestClient(build_app(engine, config, None, Tenants.single_key("k"))) as http:
        sdk = OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http)
        deadline = time.monotonic() + 300  # (a bound on a failure, not a timing: a resumed batch ends in seconds)
        batch = sdk.batches.retrieve(batch.id)
        while batch.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
            batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "completed", (batch.status, batch.errors)
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 8, 2)
        lines = [json.loads(line) for file_id in (batch.output_file_id, batch.error_file_id)
                 for line in sdk.files.content(file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted([f"c{i}" for i in range(8)] + ["bad-max", "bad-url"])
    assert all(result in lines for result in before.values())
