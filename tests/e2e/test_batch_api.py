"""OpenAI's Files and Batch API (server/batch_api.py) driven by the official `openai` SDK, unmodified, against the
server's own app in-process: files.create, batches.create, batches.retrieve until the batch completes, and
files.content of its output and error files, in OpenAI's shapes: the good lines answered as the route answers them,
the bad ones in the error file; cancel, unknown ids and a wrong purpose. Cost: one tiny engine (~1 s)."""

from __future__ import annotations

import io
import json

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
def client(tmp_path_factory):
    path = str(write_bigram_llama(tmp_path_factory.mktemp("batches")))
    engine = AsyncEngine(lambda: LLMEngine(EngineConfig.from_kwargs(model=path, num_kv_blocks=64)), "tiny")
    state = tmp_path_factory.mktemp("state")
    try:
        with TestClient(build_app(engine, ServerConfig(state_dir=str(state)), None, Tenants.single_key("k"))) as http:
            yield OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http), state, http
    finally:
        engine.shutdown()


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
