"""Prompts with images where KV moves (issue 44): preempted requests swapped out and back or recomputed, and
a prompt's blocks prefilled by one engine and decoded by another, give the output of the run where nothing
moved, for both families (LLaVA: fixed image length; Qwen2-VL: image length by size, M-RoPE positions that
the decoding engine must shift past the images it never computed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from helpers.tiny_models import make_tiny_llava, make_tiny_qwen2_vl
from tokenmill import LLM, SamplingParams

# 24 tokens: the six prompts still need more than 14 blocks of 16, so the tight pool preempts
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
BLOCK = 16


def image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["llava", "qwen2-vl"])
def vlm(request, tmp_path_factory):
    """(model folder, six prompts of one or two images)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        folder, marker = make_tiny_llava(folder, "clip"), "<image>"
    else:
        folder, marker = make_tiny_qwen2_vl(folder), "<|image_pad|>"
    prompts = [{"prompt": "USER: " + f"{marker}\n" * (1 + i % 2) + f"Question {i}: what is shown? ASSISTANT:",
                "multi_modal_data": {"image": [image(10 * i + k, 40 + 30 * k, 60 + 9 * i) for k in range(1 + i % 2)]}}
               for i in range(6)]
    return str(folder), prompts


def answers(outputs) -> list:
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


def test_swapped_and_recomputed_requests_with_images_give_the_unpreempted_output(vlm):
    folder, prompts = vlm
    reference = LLM(folder, block_size=BLOCK, num_kv_blocks=256, max_num_seqs=6)
    expected = answers(reference.generate(prompts, GREEDY, use_tqdm=False))
    assert reference.llm_engine.scheduler.num_preemptions_total == 0
    for mode in ("swap", "recompute"):
        llm = LLM(folder, block_size=BLOCK, num_kv_blocks=14, max_num_seqs=6, preemption_mode=mode)
        assert answers(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected, mode
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_preemptions_total > 0, mode
        if mode == "swap":
            assert scheduler.swap.num_swapped_in_tokens > 0 and scheduler.num_recomputed_tokens == 0
        else:
            assert scheduler.num_recomputed_tokens > 0


def test_a_prompt_with_images_prefilled_elsewhere_decodes_to_the_single_engines_output(vlm, tmp_path):
    folder, prompts = vlm
    config = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    single = LLM(folder, block_size=BLOCK, num_kv_blocks=64)
    producer = LLM(folder, block_size=BLOCK, num_kv_blocks=64, kv_transfer_config=config)
    consumer = LLM(folder, block_size=BLOCK, num_kv_blocks=64, kv_transfer_config=config)
    for prompt in prompts[:2]:
        (reference,) = single.generate(prompt, GREEDY, use_tqdm=False)
        (prefilled,) = producer.generate(prompt, SamplingParams(max_tokens=1, kv_transfer_params={
            "do_remote_decode": True}), use_tqdm=False)
        transfer = prefilled.kv_transfer_params
        (out,) = consumer.generate(prompt, dataclasses.replace(GREEDY, kv_transfer_params=transfer), use_tqdm=False)
        full_blocks = (len(reference.prompt_token_ids) - 1) // BLOCK
        assert out.metrics.num_cached_tokens == full_blocks * BLOCK  # the images' blocks came over
        assert answers([out]) == answers([reference])
    assert consumer.llm_engine.encoder_totals[0] <= 2  # at most the last block's image positions, encoded there


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_ranks_in_processes_give_the_one_rank_output(tmp_path, parallel):
    """Worker processes get the images with the request (the first pipeline stage encodes them; every
    tensor-parallel rank does) and compute Qwen2-VL's positions as one rank does."""
    folder = str(make_tiny_qwen2_vl(tmp_path / "model"))
    prompt = {"prompt": "USER: <|image_pad|>\nand <|image_pad|>\nWhat changed? ASSISTANT:",
              "multi_modal_data": {"image": [image(1, 50, 40), image(2, 90, 130)]}}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = LLM(folder, dtype="float32").generate(prompt, params, use_tqdm=False)[0]
    llm = LLM(folder, dtype="float32", **parallel)
    try:
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == alone.outputs[0].token_ids
    finally:
        llm.shutdown()
