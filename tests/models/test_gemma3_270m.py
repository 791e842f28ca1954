"""The real Gemma 3 270M (the packaged Q4_K_M GGUF) against HF transformers, which dequantises the same
file as the oracle; and the packed default's perplexity, held to the figure measured when it landed."""

from __future__ import annotations

import math

import pytest

from helpers.engine_probe import PERPLEXITY_TEXT as TEXT
from helpers.engine_probe import assert_greedy_matches_hf, llm_maker, perplexity
from tokenmill.models.loader.resolve import GEMMA3_270M, resolve_model_path

# prose, code, a question and numbers, of different lengths, in one batch
PROMPTS = ["Once upon a time, in a small village,", "def add(a, b):",
           "Q: What is the boiling point of water in Celsius?\nA:", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def gemma_path():
    return resolve_model_path(GEMMA3_270M)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path, tmp_path_factory):
    """HF transformers' float32 model of the file, dequantised by transformers itself. It loads a copy without
    the vocabulary arrays (helpers/gguf_without_vocabulary.py): every weight and setting byte for byte, but
    not the 262k tokens that its loader would parse twice, for most of a minute, to learn only their count."""
    from helpers.gguf_without_vocabulary import hf_float32_model
    return hf_float32_model(gemma_path, tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="module")
def make_gemma(gemma_path):
    """Build an LLM on the file with engine options; the file is opened once (its 262k-token vocabulary
    costs seconds to read) and every engine shares it."""
    from tokenmill.models.loader import load_model_source
    return llm_maker(load_model_source(gemma_path), model=gemma_path)


@pytest.fixture(scope="module")
def gemma_float(make_gemma):
    return make_gemma(dtype="float32", quantization="none", block_size=16, num_kv_blocks=512)


def test_float32_greedy_ids_and_logprobs_equal_hf(gemma_float, hf_gemma):
    tokenizer = gemma_float.get_tokenizer()
    assert_greedy_matches_hf(gemma_float, hf_gemma, [tokenizer(p).input_ids for p in PROMPTS], count=16)


def test_packed_default_perplexity(make_gemma, gemma_float):
    ids = gemma_float.get_tokenizer()(TEXT).input_ids
    reference = perplexity(gemma_float, ids)
    packed = make_gemma(block_size=16, num_kv_blocks=512)  # default: Q4_K/Q5_0/Q6_K/Q8_0 packed
    assert "int4+int8 projections, int8 embedding" in packed.llm_engine.model.describe_weights()
    # measured: 29.78 float32 (dequantised), 29.60 packed default in bfloat16 (AVX-512 machine)
    assert perplexity(packed, ids) == pytest.approx(reference, rel=0.03)
    assert math.isfinite(reference)
