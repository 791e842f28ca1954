import math

import torch

from tokenmill.sampling.batch import SamplingRow
from tokenmill.sampling.logprobs import token_logprobs
from tokenmill.sampling.sampler import argmax_and_allowed, row_argmax, sample
from tokenmill.sampling_params import SamplingParams


def row(seed=None, prompt=(), output=(), eos=(), **kw):
    params = SamplingParams(seed=seed, **kw)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, gen, list(prompt), list(output), tuple(eos))


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    assert sample(logits, [row(temperature=0), row(temperature=0)]).tolist() == [1, 0]


def test_row_argmax_picks_as_torch_does_ties_and_nans_included():
    logits = torch.randn(5, 1000)
    logits[1, [10, 500]] = 50.0  # a tie: the first wins
    logits[2, [7, 900]] = float("nan")  # NaN counts as the maximum, the first NaN wins
    logits[3] = float("-inf")
    for x in (logits, logits[:, ::2], logits.bfloat16()):  # NumPy path, strided rows, PyTorch path
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_top_k_top_p_min_p_never_pick_excluded_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    for kw, allowed in [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}), ({"min_p": 0.4}, {0, 1}),
                        ({"top_p": 0.5}, {0})]:
        picks = set(sample(logits, [row(temperature=1.0, **kw) for _ in range(400)], gen).tolist())
        assert picks == allowed, (kw, picks)


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(6000, 1)
    picks = sample(logits, [row(temperature=1.0) for _ in range(6000)], torch.Generator().manual_seed(1))
    freq = torch.bincount(picks, minlength=3).float() / 6000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    alone = [sample(logits, [row(seed=42, temperature=1.0)]).item() for _ in range(1)]
    crowd = torch.cat([torch.randn(5, 50), logits])
    rows = [row(temperature=1.0) for _ in range(5)] + [row(seed=42, temperature=1.0)]
    assert sample(crowd, rows, torch.Generator().manual_seed(9))[-1].item() == alone[0]


def test_repetition_presence_frequency_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    out = sample(logits, [row(temperature=0, prompt=[0], repetition_penalty=4.0)])
    assert out.item() == 2, "token 0 falls to 0.5 < 1.0"
    logits = torch.tensor([[2.0, 0.0, 1.9, 0.0]])
    assert sample(logits, [row(temperature=0, output=[0], presence_penalty=0.5)]).item() == 2
    assert sample(logits, [row(temperature=0, output=[2, 2], frequency_penalty=0.05)]).item() == 0


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    r = row(temperature=0, eos=(1,), stop_token_ids=[2], min_tokens=2, output=[3])
    assert sample(logits, [r]).item() == 3
    r = row(temperature=0, eos=(1,), min_tokens=1, output=[3])
    assert sample(logits, [r]).item() == 1


def test_logprobs_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    (entry,) = token_logprobs(logits, torch.tensor([2]), [2])
    expected = torch.log_softmax(logits, -1)[0]
    assert math.isclose(entry.logprob, expected[2].item(), rel_tol=1e-6)
    assert entry.rank == 2
    assert [t for t, _ in entry.top] == [1, 2]


def test_logit_bias_applies_to_greedy_and_bans_tokens():
    logits = torch.tensor([[3.0, 1.0, 2.0]])
    assert sample(logits, [row(temperature=0, logit_bias={1: 5.0})]).item() == 1
    picks = sample(logits.repeat(200, 1), [row(temperature=1.0, logit_bias={0: -100, 2: -100}) for _ in range(200)])
    assert set(picks.tolist()) == {1}


def test_the_device_path_marks_rows_with_no_allowed_token_from_the_same_reduction_as_the_argmax():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0],
                           [float("-inf")] * 4,
                           [float("-inf"), float("-inf"), -3.0, float("-inf")],
                           [1.0, float("nan"), 0.0, 0.0]])
    tokens, allowed = argmax_and_allowed(logits)
    assert tokens[[0, 2]].tolist() == [1, 2]  # the first of tied maxima, as argmax picks
    assert allowed.tolist() == [True, False, True, False]  # all -inf, or a NaN maximum: nothing to pick


def test_a_bad_word_of_several_tokens_is_cut_only_after_its_first_tokens():
    """vLLM's rule: the word's last token is forbidden where the output ends with the tokens before it; a
    one-token word everywhere; other rows (and other positions) keep their logits."""
    logits = torch.zeros(3, 10)
    words = SamplingParams(temperature=0, bad_words=["unused"], bad_words_token_ids=[[4, 5, 6], [8]])
    rows = [SamplingRow(words, None, [1], [2, 4, 5], (0,)),  # ends with [4, 5]: 6 is forbidden, and 8
            SamplingRow(words, None, [1], [4, 2], (0,)),  # does not: only 8
            SamplingRow(SamplingParams(temperature=0), None, [1], [4, 5], (0,))]  # no bad words
    from tokenmill.sampling.sampler import adjust_logits

    adjusted = adjust_logits(logits, rows)
    forbidden = [set((adjusted[i] == float("-inf")).nonzero().flatten().tolist()) for i in range(3)]
    assert forbidden == [{6, 8}, {8}, set()] and not logits.isinf().any()  # (adjusted on a copy)
