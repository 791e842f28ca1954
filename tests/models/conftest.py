"""Shared, expensive fixtures: the real default model in tokenmill and in HF transformers (float32)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_source():
    from tokenmill.models.loader import load_model_source
    return load_model_source(None)


@pytest.fixture(scope="session")
def make_smollm2(smollm2_source):
    """Build an LLM on the default model with extra engine options (weights are re-read, tokenizer shared)."""
    from helpers.engine_probe import llm_maker
    return llm_maker(smollm2_source)


@pytest.fixture(scope="session")
def smollm2(make_smollm2):
    """The float reference: float32, every weight dequantised, as HF transformers loads the GGUF."""
    return make_smollm2(dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_source, tmp_path_factory):
    """HF transformers' float32 model of the default GGUF, dequantised by transformers itself (from a copy
    without the vocabulary arrays, which the weights do not depend on: helpers/gguf_without_vocabulary.py)."""
    from helpers.gguf_without_vocabulary import hf_float32_model
    return hf_float32_model(smollm2_source.path, tmp_path_factory.mktemp("hf-smollm2"))
