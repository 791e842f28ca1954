"""Sleep mode on CPU (LLMEngine.sleep / wake_up, vLLM's LLM.sleep): level 1 gives the KV pool's pages back to the
OS (the resident memory falls by what the pool held), level 2 the weights too; while asleep requests are refused
saying so; after wake_up the outputs are the ones before, bit for bit. Cost: two engines of a tiny checkpoint
written without transformers (~1 s)."""

from __future__ import annotations

import pytest

from helpers.agreeing_drafts import write_bigram_llama
from tokenmill import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}, {"prompt_token_ids": [700, 701, 702, 703]}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def _run(llm) -> list:
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs])
            for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_bigram_llama(tmp_path_factory.mktemp("sleep")))


def test_level_1_gives_the_kv_pool_back_and_wakes_to_the_same_outputs(checkpoint):
    llm = LLM(checkpoint, num_kv_blocks=4096, block_size=16)  # a pool of 32 MiB (bfloat16 here)
    before = _run(llm)
    pages = llm.llm_engine.runner.kv_pages
    for page in pages:  # every block written, as a busy server's pool would be
        page.fill_(1)
    pool = sum(page.untyped_storage().nbytes() for page in pages)
    memory = llm.sleep(level=1)
    assert memory["kv_pool_bytes_released"] == pool >= 16 << 20
    assert memory["resident_bytes_before"] - memory["resident_bytes_after"] > 0.9 * pool
    assert all(not page.any() for page in pages)  # the blocks read as zeros: the prefix cache forgot them
    with pytest.raises(ValueError, match=r"the engine is asleep \(kv_cache\): wake_up first"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.wake_up()
    assert _run(llm) == before


def test_level_2_lets_go_of_the_weights_and_reloads_them(checkpoint):
    llm = LLM(checkpoint, dtype="float32", quantization="none", num_kv_blocks=64)
    before = _run(llm)
    with pytest.raises(ValueError, match="sleep: level must be 1 or 2"):
        llm.sleep(level=3)
    llm.sleep(level=2)
    assert llm.llm_engine.runner.model is None
    llm.wake_up(tags=["weights"])  # vLLM's order: the weights first, the KV cache after
    assert llm.llm_engine.is_sleeping
    with pytest.raises(ValueError, match=r"asleep \(kv_cache\)"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.llm_engine.is_sleeping and _run(llm) == before
    with pytest.raises(ValueError, match="unknown tags"):
        llm.wake_up(tags=["everything"])
