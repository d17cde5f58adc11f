import itertools
import random
from fractions import Fraction

import pytest
import torch
from law_oracles import expected_accepted, gumbel_agreement, iid, round_law
from padded_verify import rejection_sample

from verispec.theory import (
    batch_allocation,
    expected_speedup,
    expected_tokens,
    optimal_k,
    sampled_acceptance,
)


def test_expected_tokens_formula_values():
    # The formula, not the 3.08 / 3.93 quoted in one write-up.
    assert expected_tokens(0.7, 5) == pytest.approx(2.94, abs=5e-3)
    assert expected_tokens(0.8, 5) == pytest.approx(3.69, abs=5e-3)
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 0) == 1.0


def test_expected_tokens_is_a_geometric_sum():
    for gamma in (0.1, 0.5, 0.9):
        for k in range(8):
            assert expected_tokens(gamma, k) == pytest.approx(sum(gamma**i for i in range(k + 1)))


def test_expected_speedup_and_optimal_k():
    assert expected_speedup(0.8, 0, 0.1) == 1.0
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(expected_tokens(0.8, 4) / 1.2)
    assert optimal_k(0.0, 0.1) == 0  # nothing is ever accepted: do not speculate
    assert optimal_k(0.9, 1.0) == 0  # a draft as slow as the target never pays
    k = optimal_k(0.8, 0.05)
    assert 1 <= k <= 16
    assert all(expected_speedup(0.8, k, 0.05) >= expected_speedup(0.8, j, 0.05)
               for j in range(1, 17))


@pytest.mark.parametrize("gamma", [-0.1, 1.5])
def test_gamma_outside_unit_interval_is_refused(gamma):
    with pytest.raises(ValueError):
        expected_tokens(gamma, 3)


def test_batch_optimal_k_needs_the_margin_to_speculate():
    from verispec.theory import batch_optimal_k

    costs = [1.0, 1.12, 1.23]
    assert batch_optimal_k([0.23] * 4, 0.091, costs) == 1  # predicted +1.6%
    assert batch_optimal_k([0.23] * 4, 0.091, costs, min_speedup=1.10) == 0
    assert batch_optimal_k([0.9] * 4, 0.0, costs, min_speedup=1.10) == 2


def test_sampled_acceptance_is_the_verifiers_acceptance_rate():
    # 40k rows, K = 1: draft tokens drawn from q, verified against p by rejection_sample; the
    # share accepted must match sum min(p, q) (standard error ~0.0025, tolerance 4 of them).
    generator = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(12, generator=generator) * 2, dim=-1)
    draft = torch.softmax(torch.randn(12, generator=generator) * 2, dim=-1)
    rows = 40_000
    draft_tokens = torch.multinomial(draft, rows, replacement=True, generator=generator)[:, None]
    _, accepted = rejection_sample(draft_tokens, draft.expand(rows, 1, -1),
                                   target.expand(rows, 2, -1), generator)
    rate, expected = accepted.float().mean().item(), float(sampled_acceptance(target, draft))
    assert abs(rate - expected) < 0.01
    assert 0.2 < expected < 0.9  # a case where the check has power
    assert abs(float(sampled_acceptance(target, target)) - 1.0) < 1e-6
    # Negative control: a wrong formula (accepting x with probability p(x), the rate of a
    # deterministic draft: sum p q) is told apart from the measured rate.
    assert abs(rate - float((target * draft).sum())) > 0.05


def test_batch_allocation_keeps_the_tokens_that_pay_for_the_whole_batch():
    linear = lambda extra: 1 + 0.1 * extra  # noqa: E731
    assert batch_allocation([[0.9, 0.8], [0.2]], linear) == [2, 0]  # the docstring's example
    assert batch_allocation([[0.9, 0.8], [0.2]], lambda extra: 1.0) == [2, 1]  # free: all
    assert batch_allocation([[0.9, 0.8], [0.2]], lambda extra: 1 + 10 * extra) == [0, 0]
    assert batch_allocation([], linear) == [] and batch_allocation([[], []], linear) == [0, 0]
    # 16 rows: one position costs 0.35 / 16 of a step (SmolLM2 at batch 16 on the AMD EPYC),
    # so a token must be accepted with more than ~0.35 to be worth verifying, and one row's
    # weak lookup is dropped where a lone row (row-share prices) would have verified it
    batch16 = lambda extra: 1 + 0.35 * extra / 16  # noqa: E731
    gains = [[0.8 ** (j + 1) for j in range(8)]] + [[0.3 ** (j + 1) for j in range(4)]] * 15
    kept = batch_allocation(gains, batch16)
    assert kept[0] == 4 and kept[1:] == [0] * 15  # 0.8^4 = 0.41 kept, 0.8^5 = 0.33 not
    # brute force over every count per row agrees on a small case
    gains = [[0.7, 0.49, 0.343], [0.5, 0.25], [0.9]]
    steep = lambda extra: 1 + 0.04 * extra + 0.03 * extra ** 2  # noqa: E731
    best = max(((a, b, c) for a in range(4) for b in range(3) for c in range(2)),
               key=lambda n: (3 + sum(gains[0][:n[0]]) + sum(gains[1][:n[1]])
                              + sum(gains[2][:n[2]])) / steep(sum(n)))
    assert batch_allocation(gains, steep) == list(best)
    with pytest.raises(ValueError, match="must not increase"):
        batch_allocation([[0.2, 0.5]], linear)


# --- Exact laws of token-wise, block and invariant verification -----------------------------

TOY_TARGET = [Fraction(1, 3), Fraction(2, 3)]
TOY_DRAFT = [Fraction(2, 3), Fraction(1, 3)]


def random_law(vocab, depth, rng, zeros=True):
    """A next-token law for every prefix up to `depth` tokens, some entries zero."""
    table = {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            weights = [rng.random() ** 3 for _ in range(vocab)]
            if zeros and rng.random() < 0.3:
                weights[rng.randrange(vocab)] = 0.0
            table[prefix] = [w / sum(weights) for w in weights]
    return table.__getitem__


def continued(law, target, length):
    """A round's law followed by plain sampling from the target up to `length` tokens."""
    out = {}

    def extend(tokens, chance):
        if len(tokens) == length:
            out[tokens] = out.get(tokens, 0) + chance
            return
        for token, mass in enumerate(target(tokens)):
            if mass:
                extend(tokens + (token,), chance * mass)

    for tokens, chance in law.items():
        extend(tokens, chance)
    return out


def test_the_papers_toy_case_exactly():
    target, draft = iid(TOY_TARGET), iid(TOY_DRAFT)
    assert expected_accepted(target, draft, 2, "token") == Fraction(10, 9)
    assert expected_accepted(target, draft, 2, "block") == Fraction(11, 9)
    assert expected_accepted(target, draft, 1, "token") == expected_accepted(target, draft, 1,
                                                                             "block")
    assert round_law(target, draft, 1, "token") == {
        (1,): Fraction(1, 3), (0, 0): Fraction(1, 9), (0, 1): Fraction(2, 9),
        (1, 0): Fraction(1, 9), (1, 1): Fraction(2, 9)}


@pytest.mark.parametrize("method", ["token", "block", "invariant"])
def test_every_method_is_exactly_lossless_on_random_prefix_dependent_laws(method):
    rng = random.Random(method)
    for _ in range(25):
        vocab, k = rng.choice([2, 3, 4]), rng.choice([1, 2, 3])
        target, draft = random_law(vocab, k + 1, rng), random_law(vocab, k + 1, rng)
        got = continued(round_law(target, draft, k, method), target, k + 1)
        expected = continued({(): 1.0}, target, k + 1)
        assert max(abs(got.get(t, 0) - expected.get(t, 0)) for t in got.keys() | expected) < 1e-12
    # negative control: accepting every draft token (the draft's law, then the target's) is
    # told apart by the same comparison
    accept_all = continued(continued({(): 1.0}, draft, k), target, k + 1)
    assert max(abs(accept_all.get(t, 0) - expected.get(t, 0))
               for t in accept_all.keys() | expected) > 1e-3


def test_block_never_accepts_fewer_than_token_wise_on_random_laws():
    rng = random.Random(1)
    gains = []
    for _ in range(40):
        vocab, k = rng.choice([2, 3, 4]), rng.choice([2, 3, 4])
        target, draft = random_law(vocab, k, rng), random_law(vocab, k, rng)
        block = expected_accepted(target, draft, k, "block")
        token = expected_accepted(target, draft, k, "token")
        assert block >= token - 1e-12
        gains.append(block - token)
    assert max(gains) > 0.01  # the inequality is strict on some cases: the check has power


def test_point_mass_drafts_make_block_and_token_wise_the_same_law():
    """A draft without probabilities (n-gram lookup) is a point mass: then P(tau >= i) is the
    product of p(x_j) under both procedures and the residual is p without the draft token."""
    rng = random.Random(2)
    for _ in range(20):
        vocab, k = rng.choice([2, 3, 4]), rng.choice([1, 2, 3])
        target = random_law(vocab, k, rng)
        proposals = {}

        def lookup(prefix, vocab=vocab, proposals=proposals):
            token = proposals.setdefault(prefix, rng.randrange(vocab))
            return [1.0 if t == token else 0.0 for t in range(vocab)]

        token_law, block_law = (round_law(target, lookup, k, m) for m in ("token", "block"))
        assert token_law.keys() == block_law.keys()
        assert max(abs(token_law[t] - block_law[t]) for t in token_law) < 1e-12


def test_invariant_agreement_is_at_least_the_coupling_bound():
    rng = random.Random(3)
    for _ in range(50):
        vocab = rng.choice([2, 3, 5, 8])
        p, q = random_law(vocab, 0, rng)(()), random_law(vocab, 0, rng)(())
        tv = 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))
        agreement = sum(gumbel_agreement(p, q))
        assert (1 - tv) / (1 + tv) - 1e-12 <= agreement <= 1 - tv + 1e-12
        assert expected_accepted(iid(p), iid(q), 1, "invariant") == pytest.approx(agreement)
    with pytest.raises(ValueError, match="method"):
        round_law(iid(p), iid(q), 1, "typical")
