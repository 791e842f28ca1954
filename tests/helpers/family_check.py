"""One check of a model family against HF transformers float32, in every mode the engine schedules a request
in (what issue 60 asks of each architecture), for the price of two engine runs:

1. plain: the eight prompts (helpers/engine_probe.EIGHT_PROMPTS) as one batch, whole, with ample memory and
   budget (alone, a request gives the same bits as in a batch: `check_alone_equals_batched`);
2. stressed: the eight as one batch on an engine whose token budget is smaller than a block (every prompt
   prefills in chunks of less than a block), whose pool is too small for all of them at once (requests are
   preempted and recomputed), followed by the second prompt alone, twice (the second run a prefix-cache
   hit, where the family supports prefix caching).

Every run's greedy ids must equal HF's and its logprobs be within `logprob_tolerance` of HF's; HF's are those
of one forward pass over each prompt and the plain run's tokens (helpers/engine_probe.hf_forced: HF's greedy ids
by induction, without a pass a token).
"""

from __future__ import annotations

from typing import Any

from helpers.engine_probe import EIGHT_PROMPTS, assert_sample_matches_hf
from tokenmill import LLM, SamplingParams

BLOCK = 8


def check_family(path: Any, hf: Any, count: int = 32, logprob_tolerance: float = 1e-4, prefix_caching: bool = True,
                 prompts: list[list[int]] = EIGHT_PROMPTS, preempts: bool = True, **engine: Any) -> dict[str, int]:
    """Assert the engine on `path` gives HF's greedy ids and logprobs for `prompts` plain, chunked, preempted,
    batched and (with `prefix_caching`) after a prefix hit; `engine`: further options for both engines.
    `preempts` False: the family's requests never grow once admitted (a recurrent state's one page: Mamba2), so the
    small pool makes them wait instead of being preempted (its caller tests preemption on its own).
    Returns the stressed engine's counts of preemptions and prefix-cache hits (each asserted above 0)."""
    params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, logprobs=0)
    plain = LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=512, **engine)
    # one batch of whole prompts (a request alone gives the same bits: check_alone_equals_batched)
    outputs = plain.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    expected = [(list(output.outputs[0].token_ids),
                 assert_sample_matches_hf(hf, ids, output.outputs[0], logprob_tolerance, "plain"))
                for ids, output in zip(prompts, outputs)]
    groups = plain.llm_engine.kv_cache.num_groups
    plain.shutdown()
    longest = max(len(ids) for ids in prompts) + count
    # room for the longest request (in every KV group) and a little more: the eight at once do not fit, so
    # some are preempted
    blocks = groups * -(-longest // BLOCK) + 4
    stressed = LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=blocks,
                   max_num_batched_tokens=BLOCK - 2, max_model_len=longest, prefix_caching=prefix_caching,
                   **engine)
    outputs = stressed.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for ids, want, output in zip(prompts, expected, outputs):
        _assert_same(output, want, "chunked, preempted and batched", ids, logprob_tolerance)
    # alone twice: the second run finds the first's blocks cached (the small pool may have evicted the batch's)
    hits_before = stressed.llm_engine.stats().prefix_cache_hits
    for _ in range(2):
        again = stressed.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
        _assert_same(again, expected[1], "after a prefix hit", prompts[1], logprob_tolerance)
    stats = stressed.llm_engine.stats()
    counts = {"preemptions": stats.num_preemptions, "prefix_cache_hits": stats.prefix_cache_hits - hits_before}
    stressed.shutdown()
    assert counts["preemptions"] > 0 or not preempts, counts
    assert counts["prefix_cache_hits"] > 0 or not prefix_caching, counts
    return counts


def _assert_same(output: Any, expected: tuple[list[int], list[float]], mode: str, ids: list[int],
                 tolerance: float) -> None:
    tokens, logprobs = expected
    sample = output.outputs[0]
    assert sample.token_ids == tokens, f"{mode}: prompt of {len(ids)} tokens"
    ours = [entry[token].logprob for entry, token in zip(sample.logprobs, sample.token_ids)]
    worst = max(abs(a - b) for a, b in zip(ours, logprobs))
    assert worst <= tolerance, f"{mode}: prompt of {len(ids)} tokens, logprob off by {worst}"


def check_alone_equals_batched(path: Any, **engine: Any) -> None:
    """Assert one request's greedy ids and top-2 logprobs in the engine's default dtype and kernels are the same
    bits alone and among others in 5-token chunks, preempted (a pool too small for the batch) and after a
    partial prefix hit. `engine`: further options for both engines (a dtype, say)."""
    from tokenmill.models.arch import kv_cache_layout
    from tokenmill.models.loader.hf_config import arch_config_from_hf

    target = list(range(300, 100, -9))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = LLM(str(path), block_size=BLOCK, num_kv_blocks=64, prefix_caching=False, **engine)
    expected = _sample(alone.generate([{"prompt_token_ids": target}], params, use_tqdm=False)[0])
    alone.shutdown()
    # room for the longest request (42 tokens: 6 blocks) in every KV group and 2 blocks more: preemptions
    groups = len(kv_cache_layout(arch_config_from_hf(path), 2).groups)
    busy = LLM(str(path), block_size=BLOCK, num_kv_blocks=6 * groups + 2, max_num_batched_tokens=5,
               max_model_len=64, **engine)
    busy.generate([{"prompt_token_ids": target[:10] + [5, 6]}], params, use_tqdm=False)  # a partial hit later
    others = [list(range(1000, 1030)), [7, 8, 9] * 9, [2, 3], list(range(100, 127))]
    prompts = others[:1] + [target] + others[1:]
    outputs = busy.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    stats = busy.llm_engine.stats()
    busy.shutdown()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert _sample(outputs[1]) == expected


def _sample(output: Any) -> tuple:
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                              for step in completion.logprobs)
