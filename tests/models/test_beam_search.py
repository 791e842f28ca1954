"""Beam search against Hugging Face's `generate(num_beams=4)` in float32 (the oracle): the same hypotheses in
the same order, scores within 1e-4, for several length penalties and early-stopping modes."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, BeamSearchParams

PROMPTS = [[1, 520, 9531, 42], list(range(100, 160, 3)), [7, 8, 9] * 5]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("beam") / "model")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), dtype="float32", num_kv_blocks=512)


def _hf_beams(hf, ids, width, max_tokens, length_penalty, early_stopping, eos=None):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens, do_sample=False,
                          length_penalty=length_penalty, early_stopping=early_stopping, output_scores=True,
                          return_dict_in_generate=True, **({"eos_token_id": eos} if eos is not None else {}))
    return [row[len(ids):].tolist() for row in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beams_match_hf(llm, hf, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outputs = llm.beam_search(PROMPTS, params)
    for ids, output in zip(PROMPTS, outputs):
        sequences, scores = _hf_beams(hf, ids, 4, 12, length_penalty, early_stopping)
        assert len(output.sequences) == 4
        for ours, theirs, score in zip(output.sequences, sequences, scores):
            assert theirs[:len(ours.tokens)] == ours.tokens
            assert all(t == hf.generation_config.pad_token_id for t in theirs[len(ours.tokens):])
            assert ours.score == pytest.approx(score, abs=1e-4)
        assert [s.score for s in output.sequences] == sorted((s.score for s in output.sequences), reverse=True)


def test_hypotheses_ending_in_eos_match_hf(llm, hf):
    """The best first token made the EOS: hypotheses end early (without a length penalty the one-token one
    wins), and HF's finishing and scoring rules decide the rest."""
    ids = PROMPTS[1]
    greedy = llm.beam_search([ids], BeamSearchParams(beam_width=1, max_tokens=6))[0].sequences[0].tokens
    eos = greedy[0]
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (eos,)
    try:
        output = llm.beam_search([ids], BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=0.0))[0]
    finally:
        engine.eos_token_ids = saved
    sequences, scores = _hf_beams(hf, ids, 4, 10, 0.0, False, eos=eos)
    assert output.sequences[0].tokens == [eos] and output.sequences[0].finish_reason == "stop"
    for ours, theirs, score in zip(output.sequences, sequences, scores):
        assert theirs[:len(ours.tokens)] == ours.tokens and ours.score == pytest.approx(score, abs=1e-4)


def test_beams_are_the_same_with_async_scheduling(folder, llm):
    params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=0.5, early_stopping=True)
    overlapped = LLM(str(folder), dtype="float32", num_kv_blocks=512, async_scheduling=True)
    got, expected = overlapped.beam_search(PROMPTS, params), llm.beam_search(PROMPTS, params)
    assert [[(s.tokens, s.score) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.score) for s in o.sequences] for o in expected]


def test_bad_beam_parameters():
    with pytest.raises(ValueError, match="temperature 0.7 is not honoured"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
