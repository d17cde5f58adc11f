"""rejection_sample and greedy_verify: table tests, the exact identity, Monte Carlo."""

import pytest
import torch
from padded_verify import block_verify, greedy_verify, invariant_verify, rejection_sample
from scipy.stats import chisquare

from verispec.verify import (
    PAD_TOKEN,
    RowVerification,
    greedy_verify_tree,
    rejection_sample_tree,
    residual,
    verify_rows,
)

V = 6


def always_accept(draft_tokens, draft_probs, target_probs, generator):
    """Negative control for the distribution tests: a verifier that accepts every draft token,
    so its output follows the draft's distribution, not the target's."""
    batch, k = draft_tokens.shape
    bonus = torch.multinomial(target_probs[:, -1], 1, generator=generator)
    return torch.cat([draft_tokens, bonus], 1), torch.full((batch,), k)


def one_hot(*tokens, eps=0.0):
    """Near one-hot rows: mass 1 - eps on the token, eps spread over the rest."""
    probs = torch.full((len(tokens), V), eps / (V - 1), dtype=torch.float64)
    for row, token in enumerate(tokens):
        probs[row, token] = 1.0 - eps
    return probs


def run(draft_tokens, draft_probs, target_probs, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return rejection_sample(torch.tensor([draft_tokens]),
                            None if draft_probs is None else draft_probs.unsqueeze(0),
                            target_probs.unsqueeze(0), generator)


def test_early_mismatch_rejects_and_recovers_the_target_token():
    # The target is certain of 1, 4, ...; the draft proposes 1, 2, 3 (certain of its own).
    tokens, accepted = run([1, 2, 3], one_hot(1, 2, 3), one_hot(1, 4, 5, 0))
    assert accepted.tolist() == [1]
    assert tokens.tolist() == [[1, 4, PAD_TOKEN, PAD_TOKEN]]


def test_full_accept_adds_the_bonus_token():
    tokens, accepted = run([1, 2, 3], one_hot(1, 2, 3), one_hot(1, 2, 3, 5))
    assert accepted.tolist() == [3]
    assert tokens.tolist() == [[1, 2, 3, 5]]


def test_first_position_rejection():
    tokens, accepted = run([0, 2], one_hot(0, 2), one_hot(3, 2, 1))
    assert accepted.tolist() == [0]
    assert tokens.tolist() == [[3, PAD_TOKEN, PAD_TOKEN]]


def test_deterministic_draft_accepts_with_target_probability():
    tokens, accepted = run([1, 2], None, one_hot(1, 2, 4))
    assert tokens.tolist() == [[1, 2, 4]] and accepted.tolist() == [2]
    # p(x) = 0 always rejects, and the recovered token never repeats the draft token.
    target = one_hot(1, 2, 4, eps=0.5)
    target[0, 3] = 0.0
    target[0] /= target[0].sum()
    for seed in range(50):
        tokens, accepted = run([3, 2], None, target, seed)
        assert accepted.item() == 0 and tokens[0, 0].item() != 3


def test_draft_token_with_zero_draft_probability_is_accepted_if_target_allows():
    draft = one_hot(1, 2)
    tokens, accepted = run([3, 2], draft, one_hot(3, 2, 0, eps=0.1))
    assert accepted.item() >= 1 and tokens[0, 0].item() == 3


def test_equal_distributions_always_accept():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, V, dtype=torch.float64, generator=generator), -1)
    for seed in range(50):
        _, accepted = run([0, 1, 2], probs[:3], probs, seed)
        assert accepted.item() == 3


def test_k_zero_is_plain_sampling():
    tokens, accepted = run([], one_hot()[:0], one_hot(4))
    assert tokens.tolist() == [[4]] and accepted.tolist() == [0]
    tokens, accepted = run([], None, one_hot(2))
    assert tokens.tolist() == [[2]]


def test_rows_with_different_outcomes():
    draft_tokens = torch.tensor([[1, 2], [1, 2], [3, 3]])
    draft_probs = torch.stack([one_hot(1, 2), one_hot(1, 2), one_hot(3, 3)])
    target_probs = torch.stack([one_hot(1, 2, 0), one_hot(1, 5, 0), one_hot(4, 4, 4)])
    tokens, accepted = rejection_sample(draft_tokens, draft_probs, target_probs)
    assert accepted.tolist() == [2, 1, 0]
    assert tokens.tolist() == [[1, 2, 0], [1, 5, PAD_TOKEN], [4, PAD_TOKEN, PAD_TOKEN]]


def test_exact_identity_accept_plus_residual_equals_target():
    """q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) residual(x) = p(x), exactly."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        alpha = torch.rand(1, generator=generator).item() * 2 + 0.05
        gamma = torch.distributions.Dirichlet(torch.full((V,), alpha))
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        target, draft = gamma.sample().double(), gamma.sample().double()
        draft[torch.randint(0, V, (1,))] = 0.0  # exercise q(x) = 0
        draft, target = draft / draft.sum(), target / target.sum()
        ratio = torch.where(draft > 0, target / draft, torch.zeros_like(draft))
        accept_mass = draft * ratio.clamp(max=1.0)  # q(x) min(1, p(x)/q(x))
        reject_mass = 1.0 - accept_mass.sum()
        total = accept_mass + reject_mass * residual(target, draft)
        torch.testing.assert_close(total, target, rtol=0, atol=1e-12)


def test_residual_of_equal_distributions_falls_back_to_target():
    probs = one_hot(2, eps=0.3)[0]
    assert torch.equal(residual(probs, probs), probs)


def test_greedy_verify_table():
    logits = torch.full((1, 4, V), -1.0)
    for position, token in enumerate([5, 1, 2, 4]):
        logits[0, position, token] = 1.0
    tokens, accepted = greedy_verify(torch.tensor([[5, 1, 3]]), logits)
    assert tokens.tolist() == [[5, 1, 2, PAD_TOKEN]] and accepted.tolist() == [2]
    tokens, accepted = greedy_verify(torch.tensor([[5, 1, 2]]), logits)
    assert tokens.tolist() == [[5, 1, 2, 4]] and accepted.tolist() == [3]
    tokens, accepted = greedy_verify(torch.empty(1, 0, dtype=torch.long), logits[:, :1])
    assert tokens.tolist() == [[5]] and accepted.tolist() == [0]


def test_greedy_verify_tree_follows_the_targets_argmax_through_any_child():
    # root -> {5 (0), 6 (1)}; 6 -> {7 (2), 8 (3)}; 8 -> {9 (4)}
    tokens, parents = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 1, 1, 3])
    logits = torch.full((6, 12), -1.0)  # after the root, then after each node
    for row, token in enumerate([6, 0, 8, 0, 9, 4]):
        logits[row, token] = 1.0
    assert greedy_verify_tree(tokens, parents, logits) == ([6, 8, 9, 4], [1, 3, 4])
    logits[4] = -1.0
    logits[4, 2] = 1.0  # after 8 the target wants 2, which is not 8's child (9)
    assert greedy_verify_tree(tokens, parents, logits) == ([6, 8, 2], [1, 3])
    logits[0] = -1.0
    logits[0, 3] = 1.0  # no child of the root: plain greedy's token, nothing accepted
    assert greedy_verify_tree(tokens, parents, logits) == ([3], [])
    # a chain as a tree gives what greedy_verify gives
    chain = torch.tensor([6, 8, 9])
    chain_logits = logits[[0, 2, 4, 5]].clone()
    chain_logits[0] = logits[1] * 0 - 1
    chain_logits[0, 6] = 1.0
    expected, accepted = greedy_verify(chain[None], chain_logits[None])
    got, path = greedy_verify_tree(chain, torch.tensor([-1, 0, 1]), chain_logits)
    assert got == expected[0, : int(accepted[0]) + 1].tolist() and len(path) == int(accepted[0])


# --- Monte Carlo through the real function --------------------------------------------------

N = 200_000


def random_pair(seed):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.softmax(torch.randn(3, V, generator=generator, dtype=torch.float64) * 1.5, -1)
    target = torch.softmax(torch.randn(4, V, generator=generator, dtype=torch.float64) * 1.5, -1)
    return draft, target  # [K, V], [K+1, V]


def emitted_first_tokens(sampler, draft, target, seed):
    """Draw N drafts from q, verify each, return the first emitted token of every row."""
    generator = torch.Generator().manual_seed(seed)
    draft_tokens = torch.multinomial(draft, N, replacement=True, generator=generator).T  # [N, K]
    tokens, _ = sampler(draft_tokens, draft.expand(N, -1, -1), target.expand(N, -1, -1),
                        generator)
    return tokens


def chi2_pvalue(samples, probs):
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() / probs.double().sum() * len(samples)
    return chisquare(counts.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_token_is_distributed_as_target(seed):
    draft, target = random_pair(seed)
    tokens = emitted_first_tokens(rejection_sample, draft, target, seed)
    assert chi2_pvalue(tokens[:, 0], target[0]) > 1e-3


def test_second_token_given_first_accepted_is_distributed_as_target():
    # Positions are independent here, so the second emitted token must follow target[1].
    draft, target = random_pair(7)
    tokens = emitted_first_tokens(rejection_sample, draft, target, 7)
    second = tokens[:, 1][tokens[:, 1] != PAD_TOKEN]
    assert len(second) > N // 10
    assert chi2_pvalue(second, target[1]) > 1e-3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_negative_control_always_accept_fails_the_same_test(seed):
    draft, target = random_pair(seed)
    tokens = emitted_first_tokens(always_accept, draft, target, seed)
    assert chi2_pvalue(tokens[:, 0], target[0]) < 1e-6


def test_deterministic_draft_monte_carlo():
    _, target = random_pair(3)
    generator = torch.Generator().manual_seed(3)
    draft_tokens = torch.full((N, 2), 4, dtype=torch.long)  # always proposes token 4
    tokens, _ = rejection_sample(draft_tokens, None, target[:3].expand(N, -1, -1), generator)
    assert chi2_pvalue(tokens[:, 0], target[0]) > 1e-3


def test_distance_to_target_shrinks_with_samples():
    draft, target = random_pair(5)
    distances = []
    for n in (1_000, 10_000, 100_000):
        generator = torch.Generator().manual_seed(n)
        draft_tokens = torch.multinomial(draft, n, replacement=True, generator=generator).T
        tokens, _ = rejection_sample(draft_tokens, draft.expand(n, -1, -1),
                                     target.expand(n, -1, -1), generator)
        empirical = torch.bincount(tokens[:, 0], minlength=V).double() / n
        distances.append(0.5 * (empirical - target[0].double()).abs().sum().item())
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 0.01


def textbook_rejection_sample(draft_tokens, draft_probs, target_probs, generator):
    """Token-wise rejection sampling written out row by row, from the draws the verifier
    takes in order (coins [B, K] float32, then one float64 uniform per row): accept x_i while
    coin * q(x_i) < p(x_i); the next token is the first whose cumulative mass of
    max(0, p - q) (after a rejection) or of p (after K accepted) exceeds uniform * its sum."""
    batch, k = draft_tokens.shape
    coins = torch.rand((batch, k), generator=generator).tolist()
    uniform = torch.rand((batch, 1), generator=generator, dtype=torch.float64)[:, 0].tolist()
    rows = []
    for b in range(batch):
        p, q, x = target_probs[b].tolist(), draft_probs[b].tolist(), draft_tokens[b].tolist()
        accepted = 0
        while accepted < k and coins[b][accepted] * q[accepted][x[accepted]] < \
                p[accepted][x[accepted]]:
            accepted += 1
        mass = p[accepted] if accepted == k else [max(0.0, a - c) for a, c in
                                                  zip(p[accepted], q[accepted], strict=True)]
        bound, cumulative, token = uniform[b] * sum(mass), 0.0, len(mass) - 1
        for index, value in enumerate(mass):
            cumulative += value
            if cumulative > bound:
                token = index
                break
        rows.append(x[:accepted] + [token] + [PAD_TOKEN] * (k - accepted))
    return rows


@pytest.mark.parametrize("seed", [11, 12])
def test_a_seeds_draws_give_the_textbook_algorithms_tokens(seed):
    """The tokens for a seed are those the algorithm written out by hand gives from that
    seed's draws, row for row: the output depends on the seed alone, drawn in a stated order."""
    draft, target = random_pair(9)
    rows = 2_000
    draft_tokens = torch.multinomial(draft, rows, replacement=True,
                                     generator=torch.Generator().manual_seed(seed)).T
    draft_probs, target_probs = draft.expand(rows, -1, -1), target.expand(rows, -1, -1)
    tokens, accepted = rejection_sample(draft_tokens, draft_probs, target_probs,
                                        torch.Generator().manual_seed(seed))
    expected = textbook_rejection_sample(draft_tokens, draft_probs, target_probs,
                                         torch.Generator().manual_seed(seed))
    assert tokens.tolist() == expected
    assert accepted.tolist() == [sum(t != PAD_TOKEN for t in row) - 1 for row in expected]
    assert int((accepted == 0).sum()) > 0 and int((accepted == 3).sum()) > 0  # both ends


# --- Sampled token trees ------------------------------------------------------------------------

TREE_N = 40_000


def markov_tree_law(seed):
    """A target where the next token depends on the last one only: p0 [V], T [V, V]; a draft
    q0, Q [V, V] unlike it. Exact joint of the first two tokens: p0(a) T[a, b]."""
    generator = torch.Generator().manual_seed(seed)

    def law(*shape):
        return torch.softmax(torch.randn(*shape, V, generator=generator, dtype=torch.float64)
                             * 1.5, -1)

    return law(), law(V), law(), law(V)


def first_two_tokens(verify, seed, width=3):
    """Draw a tree (width children of the root from q0 without replacement, one child each
    from Q), verify it, and complete a lone first token with a draw from T (the next round's
    plain step)."""
    p0, transition, q0, q = markov_tree_law(seed)
    generator = torch.Generator().manual_seed(seed + 100)
    parents = torch.tensor([-1] * width + list(range(width)))
    pairs = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(TREE_N):
        first = torch.multinomial(q0, width, replacement=False, generator=generator)
        second = torch.stack([torch.multinomial(q[t], 1, generator=generator)[0]
                              for t in first.tolist()])
        tokens = torch.cat([first, second])
        draft_probs = torch.cat([q0.expand(width, -1), q[first]])
        target_probs = torch.cat([p0[None], transition[tokens]])
        emitted, _ = verify(tokens, parents, draft_probs, target_probs, generator)
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(transition[emitted[0]], 1,
                                                 generator=generator)[0]))
        pairs[emitted[0], emitted[1]] += 1
    return pairs, p0[:, None] * transition


def pair_pvalue(counts, joint):
    expected = joint.flatten() / joint.sum() * counts.sum()
    return chisquare(counts.flatten().numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("seed", [0, 1])
def test_a_sampled_trees_first_two_tokens_follow_the_target(seed):
    counts, joint = first_two_tokens(rejection_sample_tree, seed)
    assert pair_pvalue(counts, joint) > 1e-3


def test_negative_control_accepting_the_first_child_fails_the_same_test():
    def first_child(tokens, parents, draft_probs, target_probs, generator):
        path = [0, int((parents == 0).nonzero()[0, 0])]
        return [int(tokens[i]) for i in path], path

    counts, joint = first_two_tokens(first_child, 0)
    assert pair_pvalue(counts, joint) < 1e-6


def test_tree_rejection_sampling_table():
    # root children [0, 1] from q = [.5, .5, 0, ...], p = [.25, .25, .5, ...]: 0 passes half the
    # time; else p becomes [0, 0, 1] and q [0, 1, 0], so 1 fails and the next token is 2
    q = torch.tensor([0.5, 0.5, 0, 0, 0, 0], dtype=torch.float64)
    p = torch.tensor([0.25, 0.25, 0.5, 0, 0, 0], dtype=torch.float64)
    outcomes = []
    for seed in range(60):
        tokens, path = rejection_sample_tree(torch.tensor([0, 1]), torch.tensor([-1, -1]),
                                             torch.stack([q, q]), torch.stack([p, p, p]),
                                             torch.Generator().manual_seed(seed))
        assert (path == [0] and tokens[0] == 0) or (path == [] and tokens == [2])
        outcomes.append(tuple(path))
    assert 15 < outcomes.count((0,)) < 45


# --- Ragged batches: verify_rows equals each row's one-row call ------------------------------


def one_row(method, tokens, draft, target, row):
    """The one-row function verify_rows must reproduce, on that row's [1, K_b] slice."""
    generator = None if row.generator is None else torch.Generator().manual_seed(
        row.generator.initial_seed())
    if method == "greedy":
        out, accepted = greedy_verify(tokens[None], target[None])
    elif method == "invariant":
        out, accepted = invariant_verify(tokens[None], target[None], row.seed, row.start_position)
    else:
        verify = block_verify if method == "block" else rejection_sample
        out, accepted = verify(tokens[None], None if draft is None else draft[None], target[None],
                               generator)
    return out[0, : int(accepted) + 1].tolist(), int(accepted)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_rows_equals_per_row_calls(seed):
    rng = torch.Generator().manual_seed(seed)
    methods = ["greedy", "token", "block", "invariant"]
    batch = 12
    lengths = torch.randint(0, 5, (batch,), generator=rng).tolist()
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    total = offsets[-1]
    draft_tokens = torch.randint(0, V, (total,), generator=rng)
    draft_probs = torch.softmax(torch.randn(total, V, generator=rng, dtype=torch.float64), -1)
    target_probs = torch.softmax(torch.randn(total + batch, V, generator=rng,
                                             dtype=torch.float64) * 0.5, -1)
    rows = [RowVerification(methods[b % 4], torch.Generator().manual_seed(100 * seed + b),
                            seed=b, start_position=3 * b, draft_has_probs=b % 3 != 0)
            for b in range(batch)]
    tokens, accepted = verify_rows(draft_tokens, offsets, draft_probs, target_probs, rows)
    for b, row in enumerate(rows):
        own = slice(offsets[b], offsets[b + 1])
        draft = draft_probs[own] if row.draft_has_probs else None
        expected = one_row(row.method, draft_tokens[own], draft,
                           target_probs[offsets[b] + b : offsets[b + 1] + b + 1], row)
        assert (tokens[b], accepted[b]) == expected, (b, row.method)


def test_verify_rows_one_method_one_k_and_no_draft_probs():
    rng = torch.Generator().manual_seed(5)
    target_probs = torch.softmax(torch.randn(4 * 3, V, generator=rng), -1)
    draft_tokens = torch.randint(0, V, (4 * 2,), generator=rng)
    rows = [RowVerification("block", torch.Generator().manual_seed(b)) for b in range(4)]
    tokens, accepted = verify_rows(draft_tokens, [0, 2, 4, 6, 8], None, target_probs, rows)
    for b in range(4):
        expected = one_row("block", draft_tokens[2 * b : 2 * b + 2], None,
                           target_probs[3 * b : 3 * b + 3], rows[b])
        assert (tokens[b], accepted[b]) == expected


def test_verify_rows_refuses_inconsistent_input():
    rows = [RowVerification("token"), RowVerification("greedy")]
    tokens, probs = torch.zeros(3, dtype=torch.long), torch.full((3, V), 1.0 / V)
    with pytest.raises(ValueError, match="cu_num_draft"):
        verify_rows(tokens, [0, 1, 2], probs, torch.full((5, V), 0.2), rows)
    with pytest.raises(ValueError, match="target_probs"):
        verify_rows(tokens, [0, 1, 3], probs, torch.full((4, V), 0.2), rows)
    with pytest.raises(ValueError, match="positive"):
        verify_rows(tokens, [0, 1, 3], probs, torch.zeros(5, V), rows)
    with pytest.raises(ValueError, match="method"):
        RowVerification("typical")
    with pytest.raises(ValueError, match="seed"):
        RowVerification("invariant")


def test_greedy_chains_give_what_the_ragged_call_gives():
    """verify_drafts follows a greedy chain's argmax row by row: the same tokens and counts as
    verify_rows' greedy procedure, over drafts that match wholly, partly or not at all, logits
    full of ties (the first maximal index wins), float32 and float64, beside sampled rows."""
    from verispec import SamplingParams
    from verispec.drafters.drafter import Draft
    from verispec.verify.drafts import RowState, verify_drafts

    rng = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        for _ in range(30):
            lengths = torch.randint(0, 6, (5,), generator=rng).tolist()
            logits = [torch.randint(0, 3, (k + 1, V), generator=rng).to(dtype)  # ties
                      for k in lengths]
            drafts = []
            for k, rows_logits in zip(lengths, logits, strict=True):
                path = rows_logits.argmax(-1)[:k].clone()  # the target's own choices
                cut = int(torch.randint(0, k + 1, (1,), generator=rng))
                if cut < k:  # depart from them at `cut`
                    path[cut] = (path[cut] + 1 + int(torch.randint(0, V - 1, (1,),
                                                                   generator=rng))) % V
                drafts.append(Draft(path, None))
            greedy = SamplingParams()
            states = [RowState(greedy, None, 10)] * len(drafts)
            got = verify_drafts(drafts, logits, states)
            offsets = [0]
            for k in lengths:
                offsets.append(offsets[-1] + k)
            tokens, accepted = verify_rows(torch.cat([d.tokens for d in drafts]), offsets,
                                           None, torch.cat(logits),
                                           [RowVerification("greedy")] * len(drafts))
            assert [(v.tokens, v.accepted, v.drafted) for v in got] == [
                (t, a, k) for t, a, k in zip(tokens, accepted, lengths, strict=True)]
    with pytest.raises(ValueError, match="needs"):
        verify_drafts([Draft(torch.tensor([1, 2]), None)], [torch.zeros(2, V)],
                      [RowState(SamplingParams(), None, 0)])
