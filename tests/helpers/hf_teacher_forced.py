"""Greedy output against HF transformers from one forward pass per prompt, instead of one per token."""

from __future__ import annotations

import torch

from tokenmill.sampling_params import SamplingParams


def assert_greedy_matches_hf_forced(llm, hf, prompts: list[list[int]], count: int = 32,
                                    logprob_tolerance: float = 1e-4) -> None:
    """The engine's greedy ids and logprobs for every prompt (run as one batch) against HF's distributions after
    each prefix of the prompt followed by the engine's own tokens, all from one HF forward pass per prompt. Each
    id must be HF's argmax after the ids before it, so by induction HF's greedy decoding gives the same ids (what
    helpers.engine_probe.assert_greedy_matches_hf checks a token at a time); each logprob must be within
    `logprob_tolerance` of HF's."""
    params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        sample = output.outputs[0]
        tokens = list(sample.token_ids)
        with torch.inference_mode():
            logits = hf(torch.tensor([list(ids) + tokens[:-1]]), use_cache=False).logits[0, len(ids) - 1:]
        rows = torch.log_softmax(logits.float(), dim=-1)
        assert tokens == rows.argmax(dim=-1).tolist(), f"prompt of {len(ids)} tokens"
        ours = [entry[token].logprob for entry, token in zip(sample.logprobs, tokens)]
        theirs = rows[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= logprob_tolerance
