"""`tokenmill serve all-minilm-l6-v2`: /v1/embeddings through the openai client, /v1/score and /v1/rerank as
vLLM serves them, the errors of each; and a generative server refusing them."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch
from openai import OpenAI

from e2e.server_harness import ServerProcess, metric, metric_samples
from e2e.test_server import assert_openai_error
from helpers.tiny_models import make_tiny_hf_model

MODEL = "all-minilm-l6-v2"
DOCUMENTS = ["The cat sat on the mat.", "Stock markets fell sharply today.", "Kittens are young cats.",
             "A recipe for tomato soup."]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("embedding-server-logs")
    generative = str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model"))
    fleet = {"embed": ServerProcess(MODEL, "--max-num-seqs", "8", log_path=logs / "embed.log"),
             "generate": ServerProcess(generative, "--num-kv-blocks", "64", log_path=logs / "generate.log")}
    try:
        for server in fleet.values():
            server.start()
        yield {name: server.wait_ready().url for name, server in fleet.items()}
    finally:
        for server in fleet.values():
            server.stop()


@pytest.fixture(scope="module")
def reference():
    """The model's own vectors in this process (checked against sentence-transformers in tests/models)."""
    from tokenmill.pooling.model import load_embedding_model
    return load_embedding_model(MODEL)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_embeddings_through_the_openai_client(servers, reference):
    client = OpenAI(base_url=f"{servers['embed']}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    response = client.embeddings.create(model=MODEL, input=DOCUMENTS)
    expected = reference.encode([reference.tokenize(d) for d in DOCUMENTS])
    assert [d.index for d in response.data] == [0, 1, 2, 3]
    assert torch.equal(torch.tensor([d.embedding for d in response.data]), expected)
    assert response.usage.prompt_tokens == sum(len(reference.tokenize(d)) for d in DOCUMENTS)
    # base64: the float32 bytes, little-endian (the openai client asks for it by default and decodes it)
    raw = post(servers["embed"], "/v1/embeddings", {"input": DOCUMENTS[0], "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == expected[0].tolist()
    ids = reference.tokenize(DOCUMENTS[2])
    by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == expected[2].tolist()


def test_score_and_rerank(servers, reference):
    vectors = reference.encode([reference.tokenize(t) for t in ["cats", *DOCUMENTS]])
    cosines = (vectors[:1] @ vectors[1:].T)[0].tolist()
    score = post(servers["embed"], "/v1/score", {"model": MODEL, "text_1": "cats", "text_2": DOCUMENTS}).json()
    assert score["object"] == "list" and [d["index"] for d in score["data"]] == [0, 1, 2, 3]
    assert [d["score"] for d in score["data"]] == pytest.approx(cosines, abs=1e-6)
    pairwise = post(servers["embed"], "/v1/score", {"queries": DOCUMENTS[:2], "documents": DOCUMENTS[2:]}).json()
    assert len(pairwise["data"]) == 2
    rerank = post(servers["embed"], "/v1/rerank", {"query": "cats", "documents": DOCUMENTS, "top_n": 2}).json()
    best = sorted(range(4), key=lambda i: -cosines[i])[:2]
    assert [r["index"] for r in rerank["results"]] == best == [2, 0]  # the two texts about cats
    assert rerank["results"][0]["document"]["text"] == DOCUMENTS[2]
    assert rerank["results"][0]["relevance_score"] == pytest.approx(cosines[2], abs=1e-6)
    assert rerank["usage"]["total_tokens"] > 0
    assert post(servers["embed"], "/rerank", {"query": "cats", "documents": DOCUMENTS}).status_code == 200
    samples = metric_samples(servers["embed"])
    assert metric(samples, "tokenmill:request_success_total") >= 3


def test_bad_embedding_requests_are_400s(servers):
    url = servers["embed"]
    assert_openai_error(post(url, "/v1/embeddings", {"input": "hi", "dimensions": 8}), 400, "dimensions")
    error = assert_openai_error(post(url, "/v1/embeddings", {"input": "word " * 400}), 400, "input")
    assert "at most 256" in error["message"]
    cut = post(url, "/v1/embeddings", {"input": "word " * 400, "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    assert_openai_error(post(url, "/v1/embeddings", {"input": [[5, 99999]]}), 400, "input")
    assert_openai_error(post(url, "/v1/embeddings", {"input": []}), 400, "input")
    assert_openai_error(post(url, "/v1/embeddings", {"input": "hi", "model": "other"}), 404, "model")
    assert_openai_error(post(url, "/v1/embeddings", {"input": "hi", "encoding_format": "int8"}), 400)
    assert_openai_error(post(url, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400, "text_2")
    assert_openai_error(post(url, "/v1/rerank", {"query": "a", "documents": []}), 400, "documents")
    error = assert_openai_error(post(url, "/v1/completions", {"prompt": "hi"}), 400, "model")
    assert "embedding model" in error["message"]
    assert post(url, "/v1/embeddings", {"input": "still serving"}).status_code == 200


def test_generative_model_refuses_embedding_routes(servers):
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        error = assert_openai_error(post(servers["generate"], path, body), 400, "model")
        assert "does not embed" in error["message"]
