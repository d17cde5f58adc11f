"""block_verify: table tests, the exact output law by Monte Carlo (with a negative control that
must fail), and more accepted tokens than token-wise verification on the same drafts."""

from fractions import Fraction

import pytest
import torch
from conftest import chi2_pvalue
from law_oracles import expected_accepted, round_law
from padded_verify import block_verify, rejection_sample

from verispec.sampling import sample
from verispec.verify import PAD_TOKEN, chains

TOY_TARGET = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)  # Sun et al.'s toy case
TOY_DRAFT = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)


def toy(draft_tokens, seed):
    rows = len(draft_tokens)
    return block_verify(torch.tensor(draft_tokens), TOY_DRAFT.expand(rows, 2, -1),
                        TOY_TARGET.expand(rows, 3, -1), torch.Generator().manual_seed(seed))


def test_toy_draft_a_b_is_always_kept_whole():
    # p_1 = 1/2, p_2 = min(1, 1/2 * 2) = 1: h_2 = 1 (token-wise keeps both half the time)
    tokens, accepted = toy([[0, 1]] * 200, 0)
    assert accepted.tolist() == [2] * 200 and (tokens[:, :2] == torch.tensor([0, 1])).all()


def test_toy_draft_a_a_stops_at_zero_or_two_never_one():
    # p_1 = 1/2, Z_1 = 0 so h_1 = 0; h_2 = p_2 = 1/4; at tau = 0 the residual is (0, 1/3) -> B
    tokens, accepted = toy([[0, 0]] * 4000, 1)
    assert set(accepted.tolist()) == {0, 2}
    assert (tokens[accepted == 0, 0] == 1).all()
    assert abs((accepted == 2).double().mean().item() - 0.25) < 0.03  # 4000 rows: SE 0.007


def test_equal_distributions_accept_everything():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 6, dtype=torch.float64, generator=generator), -1)
    draft_tokens = torch.multinomial(probs[:3], 1, generator=generator).T.expand(100, -1)
    _, accepted = block_verify(draft_tokens, probs[:3].expand(100, -1, -1),
                               probs.expand(100, -1, -1), generator)
    assert accepted.tolist() == [3] * 100


def test_k_zero_is_plain_sampling():
    target = torch.softmax(torch.randn(5, 1, 6, dtype=torch.float64), -1)
    tokens, accepted = block_verify(torch.empty(5, 0, dtype=torch.long),
                                    torch.empty(5, 0, 6, dtype=torch.float64), target,
                                    torch.Generator().manual_seed(3))
    assert accepted.tolist() == [0] * 5
    assert tokens[:, 0].tolist() == sample(target[:, 0], torch.Generator().manual_seed(3)).tolist()


def test_padding_past_a_rows_length_changes_nothing():
    """A row of num_draft = L in a [1, 4] layout (garbage tokens and target rows past L) gives
    what the [1, L] row gives with the same uniforms."""
    generator = torch.Generator().manual_seed(4)
    draft = torch.softmax(torch.randn(1, 4, 6, generator=generator, dtype=torch.float64), -1)
    target = torch.softmax(torch.randn(1, 5, 6, generator=generator, dtype=torch.float64), -1)
    draft_tokens = torch.tensor([[1, 2, 3, 4]])
    for length in range(5):
        padded_tokens = draft_tokens.masked_fill(torch.arange(4) >= length, PAD_TOKEN)
        padded_target = target.clone()
        padded_target[:, length + 1:] = 0.0
        for seed in range(30):
            coins, next_uniform = chains.uniforms(1, 4, torch.Generator().manual_seed(seed),
                                                          torch.device("cpu"))
            alone = chains.block(draft_tokens[:, :length], draft[:, :length],
                                         target[:, : length + 1], torch.tensor([length]),
                                         coins[:, :length], next_uniform)
            padded = chains.block(padded_tokens, draft, padded_target,
                                          torch.tensor([length]), coins, next_uniform)
            assert torch.equal(alone[1], padded[1])
            assert torch.equal(alone[0], padded[0][:, : length + 1])


def test_bad_input_is_a_clear_error():
    target = torch.zeros(1, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="positive"):
        block_verify(torch.tensor([[1]]), None, target, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="num_draft"):
        block_verify(torch.tensor([[1]]), None, target + 0.25, num_draft=[2])


# --- The output law, by Monte Carlo ----------------------------------------------------------

V, K, N = 4, 3, 40_000


def tables(seed, sharp=1.5):
    """Prefix-dependent laws: tables[n] [V^n, V], the next-token law after a prefix of n tokens
    (indexed in base V)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(V ** n, V, generator=generator, dtype=torch.float64)
                          * sharp, -1) for n in range(K + 1)]


def as_callable(table):
    def law(prefix):
        code = 0
        for token in prefix:
            code = code * V + token
        return table[len(prefix)][code].tolist()
    return law


def draft_round(target, draft, seed, deterministic=False):
    """N drafts of K tokens from q (or always token 2, deterministic), with their [N, K, V] q
    and [N, K+1, V] p after each prefix."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.zeros(N, dtype=torch.long)
    tokens, draft_rows, target_rows = [], [], []
    for n in range(K + 1):
        target_rows.append(target[n][codes])
        if n == K:
            break
        q = target[n][codes] if deterministic else draft[n][codes]  # (q unused when None)
        token = (torch.full((N,), 2) if deterministic
                 else torch.multinomial(q, 1, generator=generator)[:, 0])
        draft_rows.append(q)
        tokens.append(token)
        codes = codes * V + token
    return (torch.stack(tokens, 1), torch.stack(draft_rows, 1), torch.stack(target_rows, 1),
            generator)


def first_three(verifier, target, draft, seed, deterministic=False):
    """Counts [V^3] of the first three tokens of the output: a round, then plain sampling from
    the target (the next rounds) where the round emitted fewer."""
    draft_tokens, draft_probs, target_probs, generator = draft_round(target, draft, seed,
                                                                     deterministic)
    tokens, _ = verifier(draft_tokens, None if deterministic else draft_probs, target_probs,
                         generator)
    first = tokens[:, :3].clone()
    codes = torch.zeros(N, dtype=torch.long)
    for n in range(3):
        missing = first[:, n] == PAD_TOKEN
        first[missing, n] = sample(target[n][codes[missing]], generator)
        codes = codes * V + first[:, n]
    return torch.bincount(codes, minlength=V ** 3).double()


def exact_first_three(target):
    joint = target[0][0][:, None, None] * target[1].view(V, V, 1) * target[2].view(V, V, V)
    return joint.flatten()


@pytest.mark.parametrize("seed", [0, 1])
def test_output_law_is_the_targets(seed):
    target, draft = tables(seed), tables(seed + 10)
    counts = first_three(block_verify, target, draft, seed)
    assert chi2_pvalue(counts, exact_first_three(target)) > 1e-3


def test_deterministic_draft_output_law_is_the_targets():
    target = tables(2)
    counts = first_three(block_verify, target, None, 2, deterministic=True)
    assert chi2_pvalue(counts, exact_first_three(target)) > 1e-3


def test_negative_control_unscaled_h_fails_the_same_test(monkeypatch):
    """Power: h_i from Z_i computed with p(x | x_<=i) unscaled by p_i must be detected."""
    original = chains._residual_mass

    def unscaled(weight, *args):
        return original(torch.ones_like(weight), *args)

    monkeypatch.setattr(chains, "_residual_mass", unscaled)
    target, draft = tables(0), tables(10)
    counts = first_three(block_verify, target, draft, 0)
    assert chi2_pvalue(counts, exact_first_three(target)) < 1e-6


def test_accepted_length_law_matches_exact_enumeration():
    target, draft = tables(3), tables(13)
    draft_tokens, draft_probs, target_probs, generator = draft_round(target, draft, 3)
    _, accepted = block_verify(draft_tokens, draft_probs, target_probs, generator)
    counts = torch.bincount(accepted, minlength=K + 1).double()
    law = round_law(as_callable(target), as_callable(draft), K, "block")
    exact = torch.tensor([sum(c for tokens, c in law.items() if len(tokens) == t + 1)
                          for t in range(K + 1)], dtype=torch.float64)
    assert chi2_pvalue(counts, exact) > 1e-3
    # power: token-wise verification's length law is another, and the test tells them apart
    _, token_wise = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    assert chi2_pvalue(torch.bincount(token_wise, minlength=K + 1).double(), exact) < 1e-6


# --- More accepted tokens than token-wise, on the same drafts -------------------------------


def paired_acceptance(draft_tokens, draft_probs, target_probs, seed):
    _, block = block_verify(draft_tokens, draft_probs, target_probs,
                            torch.Generator().manual_seed(seed))
    _, token = rejection_sample(draft_tokens, draft_probs, target_probs,
                                torch.Generator().manual_seed(seed))
    block, token = block.double(), token.double()
    difference = block - token
    return block, token, difference.mean().item(), difference.std().item() / len(block) ** 0.5


def test_toy_case_block_accepts_11_9_against_10_9():
    generator = torch.Generator().manual_seed(5)
    rows = 100_000
    draft_tokens = torch.multinomial(TOY_DRAFT, 2 * rows, replacement=True,
                                     generator=generator).view(rows, 2)
    block, token, gain, error = paired_acceptance(
        draft_tokens, TOY_DRAFT.expand(rows, 2, -1), TOY_TARGET.expand(rows, 3, -1), 5)
    assert gain > 4 * error and abs(gain - 1 / 9) < 4 * error  # error ~0.003
    for measured, exact in ((block, 11 / 9), (token, 10 / 9)):
        assert abs(measured.mean().item() - exact) < 4 * measured.std().item() / rows ** 0.5
    target, draft = [[Fraction(1, 3), Fraction(2, 3)]] * 3, [[Fraction(2, 3), Fraction(1, 3)]] * 3
    law_target, law_draft = (lambda prefix: target[len(prefix)]), (lambda p: draft[len(p)])
    assert expected_accepted(law_target, law_draft, 2, "block") == Fraction(11, 9)


@pytest.mark.parametrize("seed", [6])
def test_random_cases_block_accepts_at_least_token_wise(seed):
    target, draft = tables(seed, sharp=2.0), tables(seed + 10, sharp=2.0)
    draft_tokens, draft_probs, target_probs, _ = draft_round(target, draft, seed)
    block, token, gain, error = paired_acceptance(draft_tokens, draft_probs, target_probs, seed)
    exact_block = expected_accepted(as_callable(target), as_callable(draft), K, "block")
    exact_token = expected_accepted(as_callable(target), as_callable(draft), K, "token")
    assert exact_block >= exact_token - 1e-12
    assert gain > -4 * error and abs(gain - (exact_block - exact_token)) < 4 * error
    assert abs(block.mean().item() - exact_block) < 4 * block.std().item() / N ** 0.5
