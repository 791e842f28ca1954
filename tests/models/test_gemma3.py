"""Gemma 3 on tiny random weights against HF transformers: interleaved sliding-window and global layers,
local/global RoPE bases, sandwich norms, GeGLU, scaled embeddings and logit soft-capping."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_greedy_matches_hf, assert_logits_equal_hf
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels

WINDOW = 16  # the tiny config's sliding window: every prompt below but one is longer
PROMPTS = [[1, 520, 9531, 42], list(range(100, 400, 7)), [7, 8, 9] * 30]

# also run without native kernels and at the lowest ISA level (`make test`)
pytestmark = pytest.mark.every_level


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("gemma3"), arch="gemma3_text")


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=256)


def test_the_config_becomes_per_layer_specs(llm):
    arch = llm.llm_engine.arch
    specs = [arch.layer_spec(i) for i in range(arch.num_hidden_layers)]
    assert [s.sliding_window for s in specs] == [WINDOW] * 5 + [None]
    assert [s.rope_theta for s in specs] == [10_000.0] * 5 + [1_000_000.0]


def test_logits_equal_hf(llm, hf):
    assert_logits_equal_hf(llm, hf, PROMPTS)


def test_greedy_ids_and_logprobs_equal_hf(llm, hf):
    assert_greedy_matches_hf(llm, hf)


def test_long_prompts_chunked_and_prefix_cached_agree_with_the_plain_run(path):
    """Prompts several windows long: chunked prefill and prefix-cache hits see the same window. With the
    native kernels the logprobs agree bit for bit in bfloat16 (batch invariance); without them PyTorch's
    products change a row's arithmetic with the row count (oneDNN picks its AMX, AVX-512 or reference
    path by shape), which in bfloat16 can flip a near-tie within 24 greedy steps, so there the ids are
    compared in float32."""
    prompts = [list(range(200, 290)), list(range(200, 260)) + [5, 6, 7] * 10]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    dtype = "bfloat16" if cpu_kernels() is not None else "float32"

    def run(num_kv_blocks=256, **options):
        llm = LLM(str(path), dtype=dtype, block_size=8, num_kv_blocks=num_kv_blocks, **options)
        outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0] for p in prompts]
        outs += [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                    use_tqdm=False)]  # the second time: prefix hits
        return [(o.token_ids, [e[t].logprob for e, t in zip(o.logprobs, o.token_ids)]) for o in outs], llm

    plain, _ = run(prefix_caching=False)
    chunked, llm = run(max_num_batched_tokens=24)
    # 50 blocks of 8 tokens over 6 groups of one layer: 114 tokens take 15 blocks in the full group and at
    # most 6 (a chunk and the window before it) in each of the 5 windowed groups, so each prompt fits
    # alone and the two together preempt each other
    tight, tight_llm = run(max_num_batched_tokens=24, num_kv_blocks=50)
    assert tight_llm.llm_engine.scheduler.num_preemptions_total > 0
    with pytest.raises(ValueError, match="holds 50 blocks"):
        tight_llm.generate({"prompt_token_ids": list(range(200, 600))}, params, use_tqdm=False)
    if cpu_kernels() is None:
        plain, chunked, tight = ([ids for ids, _ in run_] for run_ in (plain, chunked, tight))
    assert chunked == plain and tight == plain
    assert llm.llm_engine.kv_cache.prefix_hits > 0
    assert plain[0] == plain[2] and plain[1] == plain[3]
