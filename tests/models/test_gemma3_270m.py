"""The real Gemma 3 270M (the packaged Q4_K_M GGUF) against HF transformers, which dequantises the same
file as the oracle; and the packed default's perplexity, held to the figure measured when it landed."""

from __future__ import annotations

import math
import os

import pytest
import torch

from helpers.engine_probe import PERPLEXITY_TEXT as TEXT
from helpers.engine_probe import assert_greedy_matches_hf, perplexity
from tokenmill import LLM
from tokenmill.models.loader.resolve import GEMMA3_270M, resolve_model_path

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village,",
           "List three fruits:", "Q: What is the boiling point of water in Celsius?\nA:", "1, 2, 3, 4,",
           "Translate to German: good morning", "Water is made of"]


@pytest.fixture(scope="module")
def gemma_path():
    return resolve_model_path(GEMMA3_270M)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(gemma_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma_float(gemma_path):
    return LLM(gemma_path, dtype="float32", quantization="none", block_size=16, num_kv_blocks=512)


def test_float32_greedy_ids_and_logprobs_equal_hf(gemma_float, hf_gemma):
    tokenizer = gemma_float.get_tokenizer()
    assert_greedy_matches_hf(gemma_float, hf_gemma, [tokenizer(p).input_ids for p in PROMPTS])


def test_packed_default_perplexity(gemma_path, gemma_float):
    ids = gemma_float.get_tokenizer()(TEXT).input_ids
    reference = perplexity(gemma_float, ids)
    packed = LLM(gemma_path, block_size=16, num_kv_blocks=512)  # default: Q4_K/Q5_0/Q6_K/Q8_0 packed
    assert "int4+int8 projections, int8 embedding" in packed.llm_engine.model.describe_weights()
    # measured: 29.78 float32 (dequantised), 29.60 packed default in bfloat16 (AVX-512 machine)
    assert perplexity(packed, ids) == pytest.approx(reference, rel=0.03)
    assert math.isfinite(reference)
