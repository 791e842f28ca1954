"""Tensor and pipeline parallelism: ranks in worker processes over gloo give the single-process tokens and logprobs."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from helpers.engine_probe import hf_greedy_tokens
from helpers.tiny_models import make_tiny_hf_model
from tokenmill.config import EngineConfig
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.executor import ExecutorDiedError
from tokenmill.sampling_params import SamplingParams

PROMPT_IDS = [[1, 5, 9, 13, 2, 7, 5, 9, 13], [3, 3, 8], list(range(20, 57)), [400, 12, 77, 5]]
# short and long prompts, one of a single token: 4 prompts x 8 tokens show a split that changes a sum
SMOLLM2_PROMPTS = ["The capital of France is", "def add(a, b):",
                   "Once upon a time, in a small village at the edge of a vast forest,", "Hi"]
SMOLLM2_TOKENS = 8


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, **kw)


def ids_and_logprobs(outputs):
    ids = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return ids, logprobs


def max_gap(a, b):
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Llama and Qwen2 (QKV bias) with 4 KV heads and 4 layers, so 2 and 4 ranks or stages divide them."""
    return {arch: str(make_tiny_hf_model(tmp_path_factory.mktemp(arch), arch=arch, num_key_value_heads=4,
                                         num_hidden_layers=4))
            for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def references(tiny_models):
    """Per tiny model, computed on its first use: HF's greedy ids and the one-rank float32 ids and logprobs."""
    from transformers import AutoModelForCausalLM

    found = {}

    def reference(arch: str) -> tuple[list, tuple]:
        if arch not in found:
            hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
            with torch.inference_mode():
                expected = [hf_greedy_tokens(hf, ids, 12) for ids in PROMPT_IDS]
            single = LLM(tiny_models[arch], dtype="float32").generate(PROMPT_IDS, greedy(), use_tqdm=False)
            found[arch] = expected, ids_and_logprobs(single)
        return found[arch]
    return reference


# Pairwise over model x way of summing x size: each model sums both ways, each way runs at 2 and 4 ranks,
# each model at 2 and 4 ranks. Partial sums add two operands with an all-reduce and more in rank order,
# hence both sizes; the model (QKV bias or not) only changes the column-parallel projections.
@pytest.mark.parametrize("arch, exact, tp", [("llama", True, 4), ("llama", False, 2), ("qwen2", True, 2),
                                             ("qwen2", False, 4)],
                         ids=["llama-exact-4", "llama-partial_sums-2", "qwen2-exact-2", "qwen2-partial_sums-4"])
def test_tiny_models_split_over_2_and_4_ranks_equal_hf(references, tiny_models, arch, exact, tp):
    expected, single = references(arch)
    assert single[0] == expected
    llm = LLM(tiny_models[arch], dtype="float32", tensor_parallel_size=tp, tensor_parallel_exact=exact)
    try:
        ids, logprobs = ids_and_logprobs(llm.generate(PROMPT_IDS, greedy(), use_tqdm=False))
    finally:
        llm.shutdown()
    assert ids == expected
    if exact:
        assert logprobs == single[1]
    else:
        assert max_gap(logprobs, single[1]) < 1e-4


@pytest.mark.parametrize("arch", ["llama"])
def test_tiny_models_in_pipeline_stages_equal_one_rank_bit_for_bit(references, tiny_models, arch):
    expected, single = references(arch)
    assert single[0] == expected
    # 3 stages of the 4 layers: a first stage of 2 layers, a middle and a last one of 1 (a middle stage hands
    # on a hidden state as it got one, so a second middle one runs the same path). Stages of tensor-parallel
    # ranks: 2 x 2 over two nodes in test_multinode.py (bit for bit) and in
    # test_features_work_split_and_a_row_does_not_depend_on_its_batch
    llm = LLM(tiny_models[arch], dtype="float32", pipeline_parallel_size=3)
    try:
        assert ids_and_logprobs(llm.generate(PROMPT_IDS, greedy(), use_tqdm=False)) == single
    finally:
        llm.shutdown()


def test_features_work_split_and_a_row_does_not_depend_on_its_batch(tiny_models):
    """Prefix caching, chunked prefill, preemption, speculation and seeded sampling at 2 ranks x 2 stages,
    in the default configuration: a request alone and in a mixed batch gives the same ids and logprobs."""
    options = dict(tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=24, block_size=4,
                   max_num_batched_tokens=16, speculative_method="ngram", num_speculative_tokens=3)
    llm = LLM(tiny_models["llama"], **options)
    engine, depths = llm.llm_engine, []
    submit = engine.executor.submit
    engine.executor.submit = lambda schedule: (submit(schedule), depths.append(engine.num_steps_in_flight + 1))[0]
    try:
        seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=12, logprobs=1)
        batch = llm.generate(PROMPT_IDS + [PROMPT_IDS[0]], [greedy()] * 4 + [seeded], use_tqdm=False)
        assert max(depths) == 2 and depths.count(2) > len(depths) // 3  # the two stages ran steps side by side
        alone = [llm.generate(ids, greedy(), use_tqdm=False)[0] for ids in PROMPT_IDS]
        seeded_alone = llm.generate(PROMPT_IDS[0], seeded, use_tqdm=False)[0]
        assert ids_and_logprobs(batch[:4]) == ids_and_logprobs(alone)
        assert ids_and_logprobs([batch[4]]) == ids_and_logprobs([seeded_alone])
        assert llm.llm_engine.stats().prefix_cache_hits > 0
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def smollm2_single(smollm2):
    """The float32 default model's ids and logprobs on one rank, in this process."""
    return ids_and_logprobs(smollm2.generate(SMOLLM2_PROMPTS, greedy(SMOLLM2_TOKENS), use_tqdm=False))


def test_smollm2_float32_over_3_ranks_summing_partial_products(make_smollm2, smollm2_single):
    params, single = greedy(SMOLLM2_TOKENS), smollm2_single
    split = make_smollm2(dtype="float32", quantization="none", tensor_parallel_size=3, tensor_parallel_exact=False)
    try:
        ids, logprobs = ids_and_logprobs(split.generate(SMOLLM2_PROMPTS, params, use_tqdm=False))
    finally:
        split.shutdown()
    assert ids == single[0]
    assert max_gap(logprobs, single[1]) < 1e-4


def test_smollm2_packed_q4_weights_over_3_ranks(make_smollm2):
    """The default configuration: packed Q4 weights, int8-quantised activations. Exact row-parallel
    products over 3 ranks give the single-rank ids and logprobs bit for bit (real weights split 3 ways).
    One stage: a stage only hands on its hidden state, whatever the weights' format, and stages of
    tensor-parallel ranks are held to one rank bit for bit in test_multinode.py (2 x 2). Partial sums over
    3 ranks are held to the one-rank output in float32 above, where their gap has a bound."""
    params = greedy(SMOLLM2_TOKENS)
    one = make_smollm2()
    single = ids_and_logprobs(one.generate(SMOLLM2_PROMPTS, params, use_tqdm=False))
    split = make_smollm2(tensor_parallel_size=3, tensor_parallel_exact=True)
    try:
        assert "int4 projections" in split.llm_engine.executor.description  # still packed, not dequantised
        assert ids_and_logprobs(split.generate(SMOLLM2_PROMPTS, params, use_tqdm=False)) == single
    finally:
        split.shutdown()


def test_a_killed_rank_fails_the_engine_naming_it(tiny_models):
    # a fresh engine of its own: the test kills one of its ranks
    engine = LLMEngine(EngineConfig.from_kwargs(model=tiny_models["llama"], tensor_parallel_size=2,
                                                num_kv_blocks=32))
    try:
        os.kill(engine.executor.processes[1].pid, signal.SIGKILL)
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(ExecutorDiedError, match="worker rank 1"):
            for _ in range(4):
                engine.step()
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.executor.processes)


def test_sizes_that_do_not_divide_the_model_are_refused_with_the_numbers(tiny_models):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's attention heads \(4\)"):
        LLM(tiny_models["llama"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 is more than the model's 4 layers"):
        LLM(tiny_models["llama"], pipeline_parallel_size=5)
