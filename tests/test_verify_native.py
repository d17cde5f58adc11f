"""The C++ chain verifier (verify_native) against verify.py's PyTorch reference: the same accepted
lengths and tokens from the same uniforms, on random and degenerate cases, across the chunks of
its two-level draw; the output law by Monte Carlo, with a control that must fail."""

import pytest
import torch
from conftest import chi2_pvalue
from padded_verify import _flat, block_verify, rejection_sample
from test_block_verify import draft_round, exact_first_three, first_three, tables

from verispec.verify import RowVerification, chains, native, verify_rows


@pytest.fixture(autouse=True)
def built():
    """The library, built on first use (never at collection); skipped where it cannot build."""
    if native.load() is None:
        pytest.skip("the C++ chain verifier does not build here")


REFERENCE = {"token": chains.token_wise, "block": chains.block}


def random_case(seed, rows, width, vocab, point_mass=False, sharp=3.0):
    """Draft tokens [B, W] drawn from q, q [B, W, V] (None: point masses), p [B, W+1, V], and
    ragged lengths [B], all float32."""
    generator = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(rows, width + 1, vocab, generator=generator) * sharp
    draft_logits = target_logits[:, :width] + torch.randn(rows, width, vocab,
                                                          generator=generator) * 0.7
    target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=generator)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    return tokens.view(rows, width), None if point_mass else draft, target, lengths


def both(method, tokens, draft, target, lengths, seed):
    """(native, reference) results of one group with the same uniforms."""
    coins, next_uniform = chains.uniforms(*tokens.shape, torch.Generator().manual_seed(
        seed), torch.device("cpu"))
    native = chains.verify_chains(method, tokens, lengths, coins, next_uniform,
                                   *_flat(draft, target))
    reference = REFERENCE[method](tokens, draft, target, lengths, coins, next_uniform)
    return native, reference


def assert_same(native, reference):
    assert torch.equal(native[2], reference[2])  # ok
    assert torch.equal(native[1], reference[1])  # accepted lengths
    assert torch.equal(native[0][native[2]], reference[0][reference[2]])  # tokens


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("point_mass", [False, True])
def test_native_equals_the_reference_on_random_cases(method, point_mass):
    # vocabularies below one chunk, across chunks, with tails that are not whole lanes
    for seed in range(120):
        vocab = (7, 50, 1024, 1041, 3 * 1024 + 19)[seed % 5]
        case = random_case(seed, rows=3, width=1 + seed % 6, vocab=vocab, point_mass=point_mass,
                           sharp=(1.0, 3.0, 6.0)[seed % 3])
        assert_same(*both(method, *case, seed))


def test_the_point_mass_token_is_left_out_wherever_it_falls():
    """A deterministic draft's residual is p without x: the excluded token in a whole lane, in
    the tail, in the first and the last chunk; one row of a uniform p, a coin that rejects."""
    vocab = 2 * 1024 + 9
    target = torch.full((1, 2, vocab), 1.0 / vocab)
    for token in (0, 5, 1023, 1024, 2047, 2048, vocab - 1):
        for seed in range(20):
            native, reference = both("token", torch.tensor([[token]]), None, target,
                                     torch.tensor([1]), seed)
            assert_same(native, reference)
            assert native[1].item() == 1 or native[0][0, 0].item() != token


@pytest.mark.parametrize("method", ["token", "block"])
def test_degenerate_cases_agree(method):
    vocab, width = 40, 3
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, width + 1, vocab, generator=generator) * 2, -1)
    tokens = torch.tensor([[3, 7, 11]])
    equal = (tokens, probs[:, :width].clone(), probs, torch.tensor([width]))  # p == q
    no_target = probs.clone()
    no_target[0, 1, 7] = 0.0  # p(x_2) = 0: always rejected there
    zero_target = (tokens, probs[:, :width].clone(), no_target, torch.tensor([width]))
    no_draft = probs[:, :width].clone()
    no_draft[0, 0, 3] = 0.0  # q(x_1) = 0 < p(x_1): kept
    zero_draft = (tokens, no_draft, probs, torch.tensor([width]))
    for case in (equal, zero_target, zero_draft):
        for seed in range(50):
            assert_same(*both(method, *case, seed))
    for seed in range(20):
        native, _ = both(method, *equal, seed)
        assert native[1].item() == width


@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_a_row_without_mass_is_refused_like_the_reference(bad):
    target = torch.full((2, 2, 8), bad)
    target[0] = 1.0 / 8  # row 0 is fine, row 1 has zeros or NaN
    for method in ("token", "block"):
        native, reference = both(method, torch.tensor([[1], [1]]), None, target,
                                 torch.tensor([0, 0]), 0)
        assert native[2].tolist() == reference[2].tolist() == [True, False]
    with pytest.raises(ValueError, match="positive mass"):
        rejection_sample(torch.tensor([[1], [1]]), None, target)


def test_a_draft_token_outside_the_vocabulary_is_a_clear_error():
    target = torch.full((1, 3, 8), 1.0 / 8)
    with pytest.raises(ValueError, match=r"draft tokens must be in \[0, 8\)"):
        block_verify(torch.tensor([[1, 8]]), None, target)
    with pytest.raises(ValueError, match=r"draft tokens must be in \[0, 8\)"):
        verify_rows(torch.tensor([-2]), [0, 1], None, target[0, :2],
                    [RowVerification("token", torch.Generator())])


def test_verify_rows_reads_ragged_rows_in_place_as_the_reference_gathers_them(monkeypatch):
    """A mixed batch (block, token, greedy rows of different lengths) through the native path
    equals the same batch with the native path off."""
    vocab, lengths = 300, [3, 0, 2, 5, 1]
    generator = torch.Generator().manual_seed(1)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    draft = torch.softmax(torch.randn(offsets[-1], vocab, generator=generator) * 2, -1)
    target = torch.softmax(torch.randn(offsets[-1] + len(lengths), vocab, generator=generator)
                           * 2, -1)
    tokens = torch.multinomial(draft, 1, generator=generator)[:, 0]
    methods = ["block", "token", "block", "greedy", "token"]

    def run():
        rows = [RowVerification(method, torch.Generator().manual_seed(10 + b))
                for b, method in enumerate(methods)]
        return verify_rows(tokens, offsets, draft, target, rows)

    for _ in range(30):
        compiled = run()
        monkeypatch.setattr(native, "runs", lambda *tensors: False)
        reference = run()
        monkeypatch.undo()
        assert compiled == reference
        other = torch.randint(0, vocab, (offsets[-1],), generator=generator)
        tokens = torch.where(torch.rand(offsets[-1], generator=generator) < 0.3, other, tokens)


# --- The output law, by Monte Carlo, through the C++ path -----------------------------------


def as_float32(verifier):
    def verify(draft_tokens, draft_probs, target_probs, generator):
        return verifier(draft_tokens, None if draft_probs is None else draft_probs.float(),
                        target_probs.float(), generator)
    return verify


@pytest.mark.parametrize("verifier", [block_verify, rejection_sample])
def test_output_law_is_the_targets(verifier):
    target, draft = tables(4), tables(14)
    counts = first_three(as_float32(verifier), target, draft, 4)
    assert chi2_pvalue(counts, exact_first_three(target)) > 1e-3
    # control: the same counts are told apart from the draft's own law
    assert chi2_pvalue(counts, exact_first_three(draft)) < 1e-6


def test_negative_control_draft_rows_off_by_one_position_fail():
    """Power: the C++ path reading q of the wrong position (a ragged-layout index slip) gives
    another law, and the same test detects it."""
    target, draft = tables(4), tables(14)

    def misread(draft_tokens, draft_probs, target_probs, generator):
        rows, width = draft_tokens.shape
        coins, next_uniform = chains.uniforms(rows, width, generator, torch.device("cpu"))
        flat_target, target_at, flat_draft, draft_at = _flat(
            draft_probs.float().contiguous(), target_probs.float().contiguous())
        tokens, _, _ = chains.verify_chains(
            "block", draft_tokens, torch.full((rows,), width), coins, next_uniform, flat_target,
            target_at, flat_draft, draft_at.roll(1, dims=1))
        return tokens, None

    counts = first_three(misread, target, draft, 4)
    assert chi2_pvalue(counts, exact_first_three(target)) < 1e-6


def test_the_float32_path_runs_natively_in_these_tests(monkeypatch):
    calls = []
    original = native.verify_chains
    monkeypatch.setattr(native, "verify_chains",
                        lambda *args: calls.append(args[0]) or original(*args))
    draft_tokens, draft_probs, target_probs, generator = draft_round(tables(0), tables(1), 0)
    block_verify(draft_tokens[:10], draft_probs[:10].float(), target_probs[:10].float(),
                 generator)
    rejection_sample(draft_tokens[:10], draft_probs[:10].float(), target_probs[:10].float(),
                     generator)
    assert calls == ["block", "token"]
