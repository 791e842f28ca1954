"""Logits processors and request controls (sampling/logits_processors.py): allowed_token_ids and bad_words change
greedy output exactly as specified; a third-party processor loaded by module:Class (or an entry point) changes the
requests that ask for it through extra_args and no other, alone and batched, the others' ids and logprobs the same
bits as alone; what cannot work is refused naming it (an unknown or unbuildable processor, processors with
speculation, bad words that leave no allowed token). Cost: tiny engines of a checkpoint written without
transformers (~2 s)."""

from __future__ import annotations

import pytest

from helpers.agreeing_drafts import write_bigram_llama
from tokenmill import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}
OTHER = {"prompt_token_ids": [300, 301, 302]}
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def _ids_and_logprobs(output) -> tuple:
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                              for step in completion.logprobs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_bigram_llama(tmp_path_factory.mktemp("processors")))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, num_kv_blocks=64, logits_processors=["helpers.logits_processors:OnlyToken"])


def test_allowed_token_ids_and_bad_words_change_greedy_output_as_specified(llm):
    tokenizer = llm.get_tokenizer()
    (seven,), (eight,) = (tokenizer(text, add_special_tokens=False).input_ids for text in ("7", "8"))
    only = llm.generate([PROMPT], SamplingParams(**GREEDY, allowed_token_ids=[seven, eight]), use_tqdm=False)[0]
    assert set(only.outputs[0].token_ids) <= {seven, eight}
    assert [seven] in llm.llm_engine.inputs._bad_word_ids(SamplingParams(bad_words=["7"]))
    banned = llm.generate([PROMPT], SamplingParams(**GREEDY, allowed_token_ids=[seven, eight], bad_words=["7"]),
                          use_tqdm=False)[0]
    assert banned.outputs[0].token_ids == [eight] * 6
    with pytest.raises(ValueError, match="bad_words forbid every token allowed_token_ids allows"):
        llm.generate([PROMPT], SamplingParams(**GREEDY, allowed_token_ids=[seven], bad_words=["7"]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids token ids must be < the vocabulary size"):
        llm.generate([PROMPT], SamplingParams(**GREEDY, allowed_token_ids=[10 ** 9]), use_tqdm=False)


def test_a_third_party_processor_changes_only_the_requests_that_ask_for_it(llm):
    alone = _ids_and_logprobs(llm.generate([OTHER], SamplingParams(**GREEDY), use_tqdm=False)[0])
    forced, other = llm.generate([PROMPT, OTHER], [SamplingParams(**GREEDY, extra_args={"only_token": 77}),
                                                   SamplingParams(**GREEDY)], use_tqdm=False)
    assert forced.outputs[0].token_ids == [77] * 6
    assert _ids_and_logprobs(other) == alone  # batched beside it: the same bits as alone


def test_processors_that_cannot_work_are_refused_naming_them(checkpoint, monkeypatch):
    for names, said in ((["helpers.logits_processors:Missing"], "'helpers.logits_processors:Missing' not found"),
                        (["no-such-plugin"], "'no-such-plugin' not found: give module:Class, or the name of an "
                                             "entry point"),
                        (["helpers.logits_processors:NeedsArguments"], "could not be constructed without arguments")):
        with pytest.raises(ValueError, match=said):
            LLM(checkpoint, num_kv_blocks=16, logits_processors=names)
    with pytest.raises(ValueError, match="logits processors and speculative decoding do not combine"):
        LLM(checkpoint, logits_processors=["helpers.logits_processors:OnlyToken"],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    # a plugin package's entry point, by its name
    import importlib.metadata

    from helpers.logits_processors import OnlyToken

    class Point:
        name = "only-token"

        @staticmethod
        def load():
            return OnlyToken

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [Point()] if group ==
                        "tokenmill.logits_processors" else [])
    plugged = LLM(checkpoint, num_kv_blocks=16, logits_processors=["only-token"])
    out = plugged.generate([PROMPT], SamplingParams(**GREEDY, extra_args={"only_token": 9}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [9] * 6
