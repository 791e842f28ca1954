"""Embedding models against sentence-transformers (the oracle) on the same weights: tiny random encoders and
decoders, every pooling, and the real all-MiniLM-L6-v2; the pooling engine's batching and failures."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from helpers.tiny_models import make_tiny_embedding_model

TEXTS = ["hello world", "A much longer sentence about cats and dogs, and the way they play in the garden.", "x",
         "Paged attention keeps the KV cache in fixed-size blocks " * 4]


@pytest.fixture(scope="module")
def oracle():
    """Vectors from sentence-transformers for a folder, float64 for comparison."""
    from sentence_transformers import SentenceTransformer

    def encode(folder, texts):
        return torch.tensor(SentenceTransformer(str(folder), device="cpu").encode(texts)).double()
    return encode


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding-models")
    return {
        "bert-mean": make_tiny_embedding_model(root / "bert-mean", "bert", "mean"),
        "bert-cls-raw": make_tiny_embedding_model(root / "bert-cls", "bert", "cls", normalize=False),
        "qwen3-last": make_tiny_embedding_model(root / "qwen3-last", "qwen3", "lasttoken"),
        "llama-mean": make_tiny_embedding_model(root / "llama-mean", "llama", "mean"),
    }


def _cosines(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(ours.double(), theirs, dim=-1)


@pytest.mark.parametrize("kind", ["bert-mean", "bert-cls-raw", "qwen3-last", "llama-mean"])
def test_tiny_models_match_sentence_transformers(tiny_folders, oracle, kind):
    from tokenmill.pooling.model import load_embedding_model

    model = load_embedding_model(str(tiny_folders[kind]))
    ours = model.encode([model.tokenize(t) for t in TEXTS])
    theirs = oracle(tiny_folders[kind], TEXTS)
    assert _cosines(ours, theirs).min() >= 0.9999
    if kind == "bert-cls-raw":  # not normalised: the lengths agree too
        torch.testing.assert_close(ours.double().norm(dim=-1), theirs.norm(dim=-1), rtol=1e-4, atol=0)
    else:
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_all_minilm_l6_v2_matches_sentence_transformers(oracle):
    from tokenmill.models.loader.resolve import resolve_model_path
    from tokenmill.pooling.model import load_embedding_model

    folder = resolve_model_path("all-minilm-l6-v2")
    model = load_embedding_model("all-minilm-l6-v2")
    assert model.max_model_len == 256 and model.pooler.method == "mean" and model.pooler.normalize
    ours = model.encode([model.tokenize(t) for t in TEXTS])
    assert _cosines(ours, oracle(folder, TEXTS)).min() >= 0.9999


def test_a_vector_does_not_depend_on_its_batch(tiny_folders):
    """The default configuration: each input's vector is bitwise the same alone, in any batch, in any order."""
    from tokenmill.pooling.model import load_embedding_model

    for kind in ("bert-mean", "qwen3-last"):
        model = load_embedding_model(str(tiny_folders[kind]))
        ids = [model.tokenize(t) for t in TEXTS]
        alone = torch.cat([model.encode([i]) for i in ids])
        assert torch.equal(model.encode(ids), alone)
        assert torch.equal(model.encode(ids[::-1] + ids)[len(ids):], alone)


def test_llm_embed_and_score(tiny_folders, oracle):
    from tokenmill import LLM

    llm = LLM(str(tiny_folders["bert-mean"]))
    outputs = llm.embed(TEXTS)
    assert [o.prompt_token_ids for o in outputs] == [llm.get_tokenizer()(t).input_ids for t in TEXTS]
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    assert _cosines(ours, oracle(tiny_folders["bert-mean"], TEXTS)).min() >= 0.9999
    scores = llm.score(TEXTS[0], TEXTS[1:])
    expected = torch.nn.functional.cosine_similarity(ours[:1], ours[1:]).tolist()
    assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-6)
    cut = llm.embed([TEXTS[3]], truncate_prompt_tokens=5)[0]
    assert len(cut.prompt_token_ids) == 5 and cut.prompt_token_ids[-1] == llm.get_tokenizer().sep_token_id
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("hello", dimensions=8)
    with pytest.raises(ValueError, match="at most 128"):
        llm.embed([list(range(1000, 1200))])


def test_generative_llm_refuses_embed(tmp_path):
    from helpers.tiny_models import make_tiny_hf_model
    from tokenmill import LLM

    llm = LLM(str(make_tiny_hf_model(tmp_path / "lm")), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="needs an embedding model"):
        llm.embed("hello")


def test_matryoshka_dimensions(tmp_path):
    """A model whose config says it was trained for shorter vectors gives the leading dimensions, normalised."""
    from tokenmill.pooling.model import load_embedding_model

    folder = make_tiny_embedding_model(tmp_path / "m", "bert", "mean")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    model = load_embedding_model(str(folder))
    ids = [model.tokenize(t) for t in TEXTS]
    full, short = model.encode(ids), model.encode(ids, dimensions=16)
    torch.testing.assert_close(short, torch.nn.functional.normalize(full[:, :16], dim=-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 64\]"):
        model.check_dimensions(65)


def test_unsupported_sentence_transformers_module_is_named(tmp_path):
    from tokenmill.pooling.pooler_config import read_pooler_config

    folder = make_tiny_embedding_model(tmp_path / "m", "bert", "mean")
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"\['Dense'\] are not supported"):
        read_pooler_config(str(folder), {}, encoder=True)


# ------------------------------------------------------------------------------------- the pooling engine
def _engine(folder, **limits):
    from tokenmill.pooling.engine import PoolingEngine
    from tokenmill.pooling.model import load_embedding_model
    return PoolingEngine(load_embedding_model(str(folder)), **limits)


def test_engine_batches_concurrent_requests_without_changing_them(tiny_folders):
    engine = _engine(tiny_folders["bert-mean"], max_num_batched_tokens=64, max_num_seqs=3)
    try:
        ids = [engine.model.tokenize(t) for t in TEXTS]
        alone = engine.model.encode(ids)

        async def run():
            return await asyncio.gather(*(engine.embed(ids[i:] + ids[:i]) for i in range(len(ids))))
        results = asyncio.run(run())
        for shift, vectors in enumerate(results):
            assert torch.equal(torch.stack(vectors), torch.cat([alone[shift:], alone[:shift]]))
        stats = engine.stats()
        assert stats.requests == len(ids) and stats.waiting_sequences == 0
        assert stats.steps < len(ids) * len(ids)  # inputs of different requests shared steps
    finally:
        engine.shutdown()


def test_engine_overload_and_a_failing_request(tiny_folders, monkeypatch):
    from tokenmill.engine.async_engine import QueueFullError, RequestFailedError

    engine = _engine(tiny_folders["bert-mean"], max_waiting_sequences=4)
    try:
        poison = 4242
        encode = engine.model.encode

        def fragile(sequences, dimensions=None):
            if any(poison in s for s in sequences):
                raise RuntimeError("boom")
            return encode(sequences, dimensions)
        monkeypatch.setattr(engine.model, "encode", fragile)
        good = [engine.model.tokenize(t) for t in TEXTS[:2]]

        async def run():
            return await asyncio.gather(engine.embed(good), engine.embed([[101, poison, 102]]),
                                        engine.embed([[101, 102]] * 5), return_exceptions=True)
        ok, failed, refused = asyncio.run(run())
        assert torch.equal(torch.stack(ok), encode(good))
        assert isinstance(failed, RequestFailedError) and "boom" in str(failed)
        assert isinstance(refused, QueueFullError)
        assert engine.stats().rejected == 1
        assert len(asyncio.run(engine.embed(good))) == 2  # and it goes on serving
    finally:
        engine.shutdown()
