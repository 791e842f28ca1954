"""The verification of speculative tokens keeps the target's distribution exactly (chi-square tests, fixed seeds)."""

import torch

from tokenmill.sampling.batch import SamplingRow
from tokenmill.sampling.rejection import Proposal, verify
from tokenmill.sampling.sampler import adjust_logits, filtered_probs
from tokenmill.sampling_params import SamplingParams

P_VALUE_FLOOR = 1e-3  # a correct sampler fails this with probability 0.001; the seeds are fixed, so it cannot flake


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit of `counts` to `expected` (same total), over the categories expected to occur."""
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target cannot produce was produced"
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def row(params: SamplingParams, generator=None, output=()) -> SamplingRow:
    return SamplingRow(params, generator, [], list(output), (5,))


def test_greedy_keeps_drafts_while_they_match_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [Proposal([1, 0], 0, row(greedy))]) == [[1, 0, 2]]  # all accepted, plus a bonus
    assert verify(logits, [Proposal([1, 2], 0, row(greedy))]) == [[1, 0]]  # the second is wrong: corrected
    assert verify(logits, [Proposal([2, 0], 0, row(greedy))]) == [[1]]
    penalised = SamplingParams(temperature=0, repetition_penalty=4.0)  # the first draft counts as output
    assert verify(logits[:2], [Proposal([1], 0, row(penalised))]) == [[1, 0]]
    logits2 = torch.tensor([[0.0, 3.0, 1.0], [0.0, 2.0, 1.0]])
    assert verify(logits2, [Proposal([1], 0, row(penalised))]) == [[1, 2]]


def sampled_tokens(params, logits, draft_dists, trials, seed):
    """Run `trials` verifications of drafts drawn from `draft_dists` (None: deterministic drafts 0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    proposals, k = [], logits.shape[0] - 1
    for _ in range(trials):
        if draft_dists is None:
            drafts, q = [0, 1][:k], None
        else:
            drafts = [int(torch.multinomial(draft_dists[i], 1, generator=generator)) for i in range(k)]
            q = draft_dists
        proposals.append(Proposal(drafts, 0, row(params), q))
    rows = logits.repeat(trials, 1)
    for index, proposal in enumerate(proposals):
        proposal.first_row = index * (k + 1)
    return verify(rows, proposals, generator)


def target_probs(params, logits, output=()):
    adjusted = adjust_logits(logits.unsqueeze(0), [row(params, output=output)])
    return filtered_probs(adjusted, [params])[0]


def check_first_two_tokens(params, draft_dists, seed):
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.3],
                           [0.2, 1.5, -1.0, 0.0, 0.7, 1.1],
                           [0.0, 0.0, 0.5, 2.0, -1.0, 0.4]])
    trials = 6000
    results = sampled_tokens(params, logits, draft_dists, trials, seed)
    first = torch.bincount(torch.tensor([r[0] for r in results]), minlength=6).double()
    assert chi_square_p_value(first, trials * target_probs(params, logits[0]).double()) > P_VALUE_FLOOR
    # given the first token was an accepted draft, the second is a fresh draw from the target's next position
    for token in range(6):
        seconds = [r[1] for r in results if len(r) > 1 and r[0] == token]
        if len(seconds) < 500:
            continue
        counts = torch.bincount(torch.tensor(seconds), minlength=6).double()
        expected = len(seconds) * target_probs(params, logits[1], output=[token]).double()
        assert chi_square_p_value(counts, expected) > P_VALUE_FLOOR, token
    accepted = sum(len(r) - 1 for r in results)
    assert 0 < accepted < 2 * trials  # both outcomes occurred


def test_rejection_sampling_keeps_the_target_distribution_with_a_draft_distribution():
    q = torch.tensor([[0.3, 0.1, 0.2, 0.1, 0.1, 0.2], [0.1, 0.4, 0.1, 0.1, 0.2, 0.1]])
    check_first_two_tokens(SamplingParams(temperature=1.0), q, seed=1)
    check_first_two_tokens(SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05), q, seed=2)
    check_first_two_tokens(SamplingParams(temperature=1.3, presence_penalty=0.8, frequency_penalty=0.3), q, seed=3)


def test_rejection_sampling_keeps_the_target_distribution_with_deterministic_drafts():
    check_first_two_tokens(SamplingParams(temperature=1.0), None, seed=4)
    check_first_two_tokens(SamplingParams(temperature=0.8, top_k=3, repetition_penalty=1.3), None, seed=5)


def test_seeded_verification_is_reproducible():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)

    def run():
        generator = torch.Generator().manual_seed(7)
        return verify(logits, [Proposal([3, 9, 4], 0, row(params, generator))])

    assert run() == run()
