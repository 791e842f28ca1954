"""Reach into an engine to compute full-sequence logits, for comparisons with HF transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.bench.teacher_forced import teacher_forced
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_state import BatchItem


@torch.inference_mode()
def model_logits(engine, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one sequence, computed through the paged KV path (blocks of
    its own in every KV cache group)."""
    kv = engine.kv_cache
    tables = [kv.pool.allocate(cdiv(len(ids), kv.block_size)) for _ in range(kv.num_groups)]
    try:
        item = BatchItem("probe", list(ids), 0, tables, False, SamplingParams(), list(ids), [])
        hidden, _ = engine.runner.forward([item])
        return engine.model.compute_logits(hidden)
    finally:
        for table in tables:
            kv.pool.release(table)


@torch.inference_mode()
def hf_greedy_tokens(model, ids: list[int], count: int) -> list[int]:
    """Plain greedy decoding with HF's own KV cache; EOS is just another token (like ignore_eos)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(count):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_greedy_tokens_from(model, ids: list[int], count: int, candidate: list[int]) -> list[int]:
    """HF's greedy tokens (what hf_greedy_tokens returns), found by checking `candidate` (the engine's, say) in
    one forward pass: each of its tokens that is HF's argmax after the ones before it is HF's greedy token, by
    induction. From the first that is not, HF decodes on its own, token by token."""
    tokens = list(candidate[:count])
    if tokens:
        argmax = hf_forced(model, ids, tokens)[0]
        agreed = next((i for i, (a, b) in enumerate(zip(tokens, argmax)) if a != b), len(tokens))
        tokens = tokens[:agreed] + argmax[agreed:agreed + 1]  # HF's own token where the first disagreement is
    if len(tokens) < count:
        tokens += hf_greedy_tokens(model, list(ids) + tokens, count - len(tokens))
    return tokens


@torch.inference_mode()
def hf_forced(model, ids: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """HF's float32 distributions after each prefix of `ids` followed by `tokens` (the engine's greedy output),
    from one forward pass: HF's argmax at each of those positions and the log-probability of each of `tokens`.
    Where every argmax equals its token, HF's own greedy decoding gives exactly `tokens`, by induction (each
    step of it sees the same prefix), so this is the greedy oracle at the price of one pass, not one per token."""
    logits = model(torch.tensor([list(ids) + list(tokens[:-1])]), use_cache=False).logits[0, len(ids) - 1:].float()
    rows = torch.log_softmax(logits, dim=-1)
    return logits.argmax(dim=-1).tolist(), rows[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()


def assert_sample_matches_hf(model, ids: list[int], sample, tolerance: float = 1e-4, mode: str = "") -> list[float]:
    """`sample` (a CompletionOutput generated greedily with logprobs) gives HF's greedy ids after `ids` and, for each
    token, a logprob within `tolerance` of HF's; returns HF's logprobs (for comparing other runs of the prompt)."""
    tokens = list(sample.token_ids)
    argmax, logprobs = hf_forced(model, ids, tokens)
    assert tokens == argmax, f"{mode}: prompt of {len(ids)} tokens, HF's greedy ids differ"
    ours = [entry[token].logprob for entry, token in zip(sample.logprobs, tokens)]
    worst = max(abs(a - b) for a, b in zip(ours, logprobs))
    assert worst <= tolerance, f"{mode}: prompt of {len(ids)} tokens, logprob off by {worst}"
    return logprobs


def assert_logits_equal_hf(llm, hf, prompts: list[list[int]]) -> None:
    """Each prompt's float32 logits through the paged KV path equal HF's, within float32 noise."""
    for ids in prompts:
        ours = model_logits(llm.llm_engine, ids)
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


# eight prompts of different lengths and content, ids inside every tiny model's vocabulary
EIGHT_PROMPTS = [[1, 520, 9531, 42], list(range(100, 400, 7)), [7, 8, 9] * 30, [2, 3],
                 list(range(1000, 1060)), [4242] * 5 + [17, 18], list(range(300, 100, -9)), [11, 12, 13, 14, 15, 16]]


def assert_greedy_matches_hf(llm, hf, prompts: list[list[int]] = EIGHT_PROMPTS, count: int = 32,
                             logprob_tolerance: float = 1e-4) -> None:
    """The engine's greedy ids equal HF's for every prompt (run as one batch), and each token's
    logprob is within `logprob_tolerance` of HF's (`hf_forced`: one HF pass a prompt)."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        assert_sample_matches_hf(hf, ids, output.outputs[0], logprob_tolerance)


PERPLEXITY_TEXT = (Path(__file__).parent.parent / "data" / "perplexity.txt").read_text()


def token_logprobs(llm, ids: list[int]) -> list[float]:
    """Each token's log-probability after its prefix (teacher-forced), from the second on."""
    from tokenmill import SamplingParams

    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [position[token].logprob for position, token in zip(out[0].prompt_logprobs[1:], ids[1:])]


def perplexity(llm, ids: list[int]) -> float:
    """exp of the mean negative log-probability of `ids` after their prefixes."""
    return teacher_forced(llm, [ids])[0]


def llm_maker(source, **fixed):
    """A function that builds an LLM from options on an already opened ModelSource (weights re-read per engine,
    the file's parsing and tokenizer shared): make(**options) uses `fixed` and then `options`."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.llm_engine import LLMEngine

    return lambda **options: LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(**fixed, **options), source=source))
