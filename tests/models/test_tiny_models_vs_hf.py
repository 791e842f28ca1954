"""Tiny random-weight Llama / Mistral / Qwen2 / Qwen3 checkpoints: logits and greedy tokens equal HF's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_logits_equal_hf, hf_greedy_tokens
from helpers.tiny_models import LLAMA3_ROPE_SCALING, make_tiny_hf_model
from tokenmill import LLM, SamplingParams

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope-scaling": dict(arch="llama", rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE_SCALING}),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    # YaRN past 32 original positions: interpolated low frequencies, cos/sin times mscale(4) = 1.139
    "qwen2-yarn": dict(arch="qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 32}),
    "qwen3": dict(arch="qwen3"),
}
PROMPTS = [[1, 520, 9531, 42], list(range(100, 400, 7)), [7, 8, 9] * 30]

# also run without native kernels and at the lowest ISA level (`make test`)
pytestmark = pytest.mark.every_level


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=128)
    return llm, hf


def test_logits_equal_hf(pair):
    llm, hf = pair
    assert_logits_equal_hf(llm, hf, PROMPTS)


def test_batched_greedy_equals_hf(pair):
    llm, hf = pair
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy_tokens(hf, ids, 16) for ids in PROMPTS]
