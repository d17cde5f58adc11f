import pytest
import torch
from conftest import chi2_pvalue

from verispec import SamplingParams
from verispec.sampling import greedy_tokens, inverse_cdf, sample, sample_distinct, warp

LOGITS = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])


def test_temperature_one_is_softmax():
    torch.testing.assert_close(warp(LOGITS, SamplingParams(temperature=1.0)),
                               torch.softmax(LOGITS, -1))


def test_temperature_sharpens_and_flattens():
    cold = warp(LOGITS, SamplingParams(temperature=0.5))
    hot = warp(LOGITS, SamplingParams(temperature=2.0))
    assert cold[0, 0] > torch.softmax(LOGITS, -1)[0, 0] > hot[0, 0]


def test_top_k_keeps_k_tokens():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).sum().item() == 2
    torch.testing.assert_close(probs[0, :2], torch.softmax(LOGITS[0, :2], -1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = torch.softmax(LOGITS, -1)[0]  # [0.636, 0.234, 0.086, 0.032, 0.012]
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))[0]
    assert (probs > 0).tolist() == [True, True, False, False, False]
    torch.testing.assert_close(probs[:2], full[:2] / full[:2].sum())
    # A p below the top token's mass keeps just that token.
    assert (warp(LOGITS, SamplingParams(temperature=1.0, top_p=0.1)) > 0).sum().item() == 1

    # A p below float32's smallest number compares as 0 there; the top token stays all the same.
    tiny = warp(LOGITS, SamplingParams(temperature=1.0, top_p=1e-300))[0]
    assert tiny.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_sampling_params_refuse_seeds_and_temperatures_a_round_would_fail_on():
    for seed in (0, 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed
    for seed in (-1, 2**64, 10**30):  # torch.Generator.manual_seed: overflow, or an alias
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    assert SamplingParams(temperature=1e-6).temperature == 1e-6
    with pytest.raises(ValueError, match="temperature"):  # logits / 1e-300 overflow to inf
        SamplingParams(temperature=1e-300)


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, min_p=0.1))[0]
    # 0.636 * 0.1 = 0.064: tokens 0..2 survive (0.086 > 0.064), 3 and 4 do not.
    assert (probs > 0).tolist() == [True, True, True, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError):
        warp(LOGITS, SamplingParams(temperature=0.0))


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(temperature=-0.5),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.0), dict(seed="x"),
    dict(stop=("",)), dict(temperature=float("nan")), dict(verify="typical"),
    dict(verify="invariant", temperature=1.0), dict(stop=123), dict(stop=b"ab"),
    dict(stop={"a"}),
])
def test_bad_params_are_clear_errors(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n").stop == ("\n",)


def _sample_counts(probs: torch.Tensor, draws: int, seed: int) -> torch.Tensor:
    """Counts [B, V] of `draws` calls of sample(probs) with one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(probs)
    rows = torch.arange(probs.shape[0])
    for _ in range(draws):
        counts[rows, sample(probs, generator)] += 1
    return counts


def test_sample_draws_each_row_from_its_distribution():
    # Unnormalised rows, zeros inside and at both ends, a tiny mass: 20k draws a row.
    probs = torch.tensor([[0.0, 5.0, 0.0, 2.5, 2.5, 0.0, 0.01],
                          [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    counts = _sample_counts(probs, 20_000, seed=0)
    assert (counts[probs == 0] == 0).all()  # a token of probability 0 is never drawn
    for row in range(2):
        assert chi2_pvalue(counts[row], probs[row]) > 1e-3
    # Negative control: the same counts against a distribution 5% off on one token must fail.
    skewed = probs[0].clone()
    skewed[1] *= 1.05
    assert chi2_pvalue(counts[0], skewed) < 1e-3


def test_distinct_draws_are_draws_without_replacement():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05], dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    pairs = torch.zeros(5, 5, dtype=torch.float64)
    for _ in range(20_000):
        first, second = sample_distinct(probs, 2, generator)
        pairs[first, second] += 1
    # P(first = i, second = j) = p_i p_j / (1 - p_i), j != i
    exact = probs[:, None] * probs[None, :] / (1 - probs[:, None])
    exact.fill_diagonal_(0.0)
    assert pairs.diagonal().sum() == 0 and pairs[2].sum() == 0 and pairs[:, 2].sum() == 0
    kept = exact.flatten() > 0
    assert chi2_pvalue(pairs.flatten()[kept], exact.flatten()[kept]) > 1e-3
    # negative control: independent draws (with replacement) fail the same test
    independent = torch.outer(probs, probs).flatten()[kept]
    assert chi2_pvalue(pairs.flatten()[kept], independent) < 1e-6
    assert sorted(sample_distinct(probs, 9, generator)) == [0, 1, 3, 4]  # as many as have mass


@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_sample_refuses_a_row_without_mass(bad):
    probs = torch.tensor([[0.5, 0.5], [bad, bad]])
    with pytest.raises(ValueError, match="positive"):
        sample(probs, torch.Generator().manual_seed(0))


def test_sample_never_draws_zero_mass_tokens_of_a_large_vocabulary():
    generator = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, 49152, generator=generator) * 4, dim=-1)
    probs[:, 1::2] = 0.0  # half the vocabulary, interleaved
    probs[:, -1] = 0.0
    for _ in range(200):
        tokens = sample(probs, generator)
        assert (tokens % 2 == 0).all() and (tokens < 49151).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_argmax_with_first_index_on_ties(dtype):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 5, (3, 7, 1000), generator=generator).to(dtype)  # many ties
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(torch.tensor([[1.0, 3.0, 3.0, 0.0]])).tolist() == [1]


def test_verify_defaults_to_block_and_invariant_needs_a_seed_only_when_sampling():
    assert SamplingParams(temperature=1.0).verify == "block"
    assert SamplingParams(temperature=1.0, seed=3, verify="invariant").verify == "invariant"
    assert SamplingParams(verify="invariant").greedy  # greedy: already drafter-invariant
    with pytest.raises(ValueError, match="needs a seed"):
        SamplingParams(temperature=0.7, verify="invariant")


def test_inverse_cdf_is_sample_with_its_uniform():
    probs = torch.tensor([[0.0, 5.0, 0.0, 2.5, 2.5], [1.0, 1.0, 1.0, 1.0, 1.0]])
    for seed in range(20):
        uniform = torch.rand((2, 1), generator=torch.Generator().manual_seed(seed),
                             dtype=torch.float64)
        assert torch.equal(inverse_cdf(probs, uniform),
                           sample(probs, torch.Generator().manual_seed(seed)))
