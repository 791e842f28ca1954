"""Every dtype the CLI offers runs on whatever this CPU (or its ISA cap) is, with float or quantised
weights: it loads, generates, and its logits follow float32's (no load-time or mid-request errors where
a library path needs a feature the CPU lacks, e.g. oneDNN's packed bfloat16 weights)."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_probe import model_logits
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams

# also run without native kernels and at the lowest ISA level (`make test`)
pytestmark = pytest.mark.every_level
PROMPT = [1, 520, 9531, 42, 7, 300, 12, 99]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("dtypes"), arch="llama"))


@pytest.fixture(scope="module")
def float32_logits(model_path):
    return model_logits(LLM(model_path, dtype="float32", block_size=8, num_kv_blocks=32).llm_engine, PROMPT)


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_loads_generates_and_tracks_float32(model_path, float32_logits, dtype, quantization):
    llm = LLM(model_path, dtype=dtype, quantization=quantization, block_size=8, num_kv_blocks=32)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    logits = model_logits(llm.llm_engine, PROMPT)
    assert torch.isfinite(logits).all()
    similarity = torch.nn.functional.cosine_similarity(logits, float32_logits, dim=-1)
    assert similarity.min() > (0.999 if quantization == "none" else 0.95), similarity


def test_the_native_attention_refuses_float16_by_name(model_path):
    with pytest.raises(ValueError, match="cpu_paged takes float32 or bfloat16, not float16"):
        LLM(model_path, dtype="float16", attention_backend="cpu_paged", block_size=8, num_kv_blocks=32)
