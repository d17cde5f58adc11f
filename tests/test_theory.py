import pytest
import torch

from verispec.theory import expected_speedup, expected_tokens, optimal_k, sampled_acceptance
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
