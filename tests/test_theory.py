import pytest
import torch

from verispec.theory import (
    batch_allocation,
    expected_speedup,
    expected_tokens,
    optimal_k,
    sampled_acceptance,
)
from verispec.verify import rejection_sample


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
