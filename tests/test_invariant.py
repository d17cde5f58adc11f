"""Drafter-invariant sampling: position-keyed noise, invariant_verify (chains and trees) equal to
plain invariant sampling token for token, and the target's law (with negative controls)."""

import math
import random

import numpy as np
import pytest
import torch
from conftest import chi2_pvalue
from law_oracles import gumbel_agreement
from padded_verify import invariant_verify

from verispec.invariant import invariant_sample, mix64_, position_noise
from verispec.verify import PAD_TOKEN, invariant_verify_tree

V = 5
PROMPT_LENGTH = 7  # the first generated token is at absolute position 7


def splitmix64_reference(value: int) -> int:
    """SplitMix64's finaliser in plain Python integers (Steele, Lea, Flood 2014)."""
    mask = (1 << 64) - 1
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & mask
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & mask
    return value ^ (value >> 31)


def test_the_hash_is_splitmix64():
    values = [random.Random(0).getrandbits(64) for _ in range(500)] + [0, (1 << 64) - 1, 1 << 63]
    mixed = np.array(values, dtype=np.uint64)
    mix64_(mixed, np.empty_like(mixed))
    assert [int(v) for v in mixed] == [splitmix64_reference(v) for v in values]
    assert splitmix64_reference(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # its first output


def reference_noise(seed: int, position: int, token: int) -> float:
    """G for (seed, position, token) as `position_noise` documents it, in Python integers and
    floats: key = mix(mix(seed ^ salt) + (position + 1) * golden), bits = mix(key + (token + 1)
    * golden) >> 12, u = (bits + 1/2) / 2^52, G = -log(-log u)."""
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15
    key = splitmix64_reference((seed & mask) ^ 0x5851F42D4C957F2D)
    key = splitmix64_reference((key + (position + 1) * golden) & mask)
    bits = splitmix64_reference((key + (token + 1) * golden) & mask) >> 12
    return -math.log(-math.log((bits + 0.5) / 2 ** 52))


def test_the_noise_has_the_documented_bits():
    """Pinned by an independent implementation of its definition: a change to the hash, its
    constants or the float steps would move every invariant sample. (To the last bit or two:
    torch's vectorised log may round a last bit unlike Python's; a wrong bit of the hash moves
    a value by far more.)"""
    for seed, position in ((0, 0), (7, 3), (-1, 10_000), (1 << 40, 151_935)):
        noise = position_noise(seed, position, 64).tolist()
        expected = [reference_noise(seed, position, t) for t in range(64)]
        assert all(math.isclose(a, b, rel_tol=4e-16, abs_tol=1e-300)
                   for a, b in zip(noise, expected, strict=True)), (seed, position)


def test_noise_depends_on_seed_position_and_token_alone():
    together = position_noise(3, [5, 9, 5], 1000)
    assert torch.equal(together[0], position_noise(3, 5, 1000))
    assert torch.equal(together[1], position_noise(3, 9, 1000))
    assert torch.equal(together[0], together[2])
    per_row = position_noise(torch.tensor([3, 4]), torch.tensor([5, 5]), 1000)
    assert torch.equal(per_row[0], together[0]) and not torch.equal(per_row[1], per_row[0])
    assert torch.equal(position_noise(3, 5, 10), position_noise(3, 5, 1000)[:10])  # a prefix
    assert torch.equal(position_noise(-1, 5, 10), position_noise((1 << 64) - 1, 5, 10))
    with pytest.raises(ValueError, match="position"):
        position_noise(3, -1, 10)


def test_invariant_sample_draws_from_p_independently_across_positions():
    seeds = torch.arange(30_000)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    other = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4], dtype=torch.float64)
    first = invariant_sample(probs.expand(len(seeds), -1), seeds, 11)
    second = invariant_sample(other.expand(len(seeds), -1), seeds, 12)
    assert chi2_pvalue(torch.bincount(first, minlength=V).double(), probs) > 1e-3
    pairs = torch.bincount(first * V + second, minlength=V * V).double()
    assert chi2_pvalue(pairs, torch.outer(probs, other).flatten()) > 1e-3
    # negative controls: a 10% skew, and the same position drawn twice (shared noise)
    skewed = probs.clone()
    skewed[0] *= 1.1
    assert chi2_pvalue(torch.bincount(first, minlength=V).double(), skewed) < 1e-6
    again = invariant_sample(other.expand(len(seeds), -1), seeds, 11)
    pairs = torch.bincount(first * V + again, minlength=V * V).double()
    assert chi2_pvalue(pairs, torch.outer(probs, other).flatten()) < 1e-6


def test_shared_noise_agrees_as_the_gumbel_coupling_says():
    generator = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(V, generator=generator, dtype=torch.float64) * 1.5, -1)
    draft = torch.softmax(torch.randn(V, generator=generator, dtype=torch.float64) * 1.5, -1)
    seeds = torch.arange(40_000)
    drawn = invariant_sample(target.expand(len(seeds), -1), seeds, 3)
    drafted = invariant_sample(draft.expand(len(seeds), -1), seeds, 3)
    rate = (drawn == drafted).double().mean().item()
    exact = sum(gumbel_agreement(target.tolist(), draft.tolist()))
    tv = 0.5 * (target - draft).abs().sum().item()
    assert abs(rate - exact) < 4 * (exact * (1 - exact) / len(seeds)) ** 0.5
    assert exact >= (1 - tv) / (1 + tv) - 1e-12
    # negative control: unshared noise agrees only as independent draws do, sum p q
    unshared = invariant_sample(draft.expand(len(seeds), -1), seeds + 10**6, 3)
    independent = (drawn == unshared).double().mean().item()
    assert abs(independent - float((target * draft).sum())) < 0.015 and exact - independent > 0.1


# --- Speculative output equals plain invariant sampling ---------------------------------------


def markov(seed, sharp=1.5):
    """A law where the next token depends on the last only: first [V], after[V, V]."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.softmax(torch.randn(V, generator=generator, dtype=torch.float64) * sharp, -1)
    after = torch.softmax(torch.randn(V, V, generator=generator, dtype=torch.float64) * sharp, -1)
    return first, after


def next_law(law, history):
    first, after = law
    return first if not history else after[history[-1]]


def plain(target, seeds, length):
    """Plain invariant sampling of `length` tokens for each seed [S] -> [S, length]."""
    first, after = target
    tokens = [invariant_sample(first.expand(len(seeds), -1), seeds, PROMPT_LENGTH)]
    for position in range(PROMPT_LENGTH + 1, PROMPT_LENGTH + length):
        tokens.append(invariant_sample(after[tokens[-1]], seeds, position))
    return torch.stack(tokens, 1)


def propose(kind, draft, history, k, seed, rng):
    """A chain of k tokens: drawn with the shared noise from the draft's q ("shared"), random
    ("random"), or shared for a while and then random ("partial")."""
    tokens: list[int] = []
    good = k if kind == "shared" else (0 if kind == "random" else rng.randrange(k + 1))
    for i in range(k):
        position = PROMPT_LENGTH + len(history) + i
        if i < good:
            q = next_law(draft, history + tokens)
            tokens.append(int(invariant_sample(q[None], seed, [position])))
        else:
            tokens.append(rng.randrange(V))
    return tokens


def speculative(target, draft, seed, length, kind, rng):
    history: list[int] = []
    while len(history) < length:
        k = rng.randrange(6)
        tokens = propose(kind, draft, history, k, seed, rng)
        target_probs = torch.stack([next_law(target, history + tokens[:i]) for i in range(k + 1)])
        out, accepted = invariant_verify(torch.tensor([tokens], dtype=torch.long).view(1, k),
                                         target_probs[None], seed, PROMPT_LENGTH + len(history))
        history += out[0, : int(accepted) + 1].tolist()
    return history[:length]


def speculative_tree(target, draft, seed, length, rng):
    """Rounds of token trees: each node gets up to 3 children, one of them (sometimes) the
    shared-noise draw from q, the rest random."""
    history: list[int] = []
    while len(history) < length:
        tokens, parents, depth_of = [], [], []
        frontier = [-1]
        for depth in range(1, rng.randrange(1, 4) + 1):
            next_frontier = []
            for parent in frontier:
                path = []
                node = parent
                while node >= 0:
                    path.append(tokens[node])
                    node = parents[node]
                context = history + path[::-1]
                children = {rng.randrange(V) for _ in range(rng.randrange(1, 3))}
                if rng.random() < 0.7:
                    position = PROMPT_LENGTH + len(context)
                    children.add(int(invariant_sample(next_law(draft, context)[None], seed,
                                                      [position])))
                for child in sorted(children):
                    tokens.append(child)
                    parents.append(parent)
                    depth_of.append(depth)
                    next_frontier.append(len(tokens) - 1)
            frontier = next_frontier[:2]
        order = sorted(range(len(tokens)), key=lambda i: depth_of[i])  # in order of depth
        index = {old: new for new, old in enumerate(order)}
        tokens = [tokens[i] for i in order]
        parents = [index[parents[i]] if parents[i] >= 0 else -1 for i in order]
        rows = [next_law(target, history)]
        for node in range(len(tokens)):
            path, at = [], node
            while at >= 0:
                path.append(tokens[at])
                at = parents[at]
            rows.append(next_law(target, history + path[::-1]))
        out, _ = invariant_verify_tree(torch.tensor(tokens), torch.tensor(parents),
                                       torch.stack(rows), seed, PROMPT_LENGTH + len(history))
        history += out
    return history[:length]


SEEDS = 12  # per kind of drafter: 48 seeded runs, K 0..5 drawn per round


@pytest.mark.parametrize("kind", ["shared", "random", "partial", "tree"])
def test_speculative_output_is_plain_invariant_sampling_token_for_token(kind):
    target, draft = markov(0), markov(1)
    rng = random.Random(kind)
    expected = plain(target, torch.arange(SEEDS), 10).tolist()
    for seed in range(SEEDS):
        if kind == "tree":
            got = speculative_tree(target, draft, seed, 10, rng)
        else:
            got = speculative(target, draft, seed, 10, kind, rng)
        assert got == expected[seed], (seed, kind)


def test_rows_of_a_batch_are_verified_as_alone():
    generator = torch.Generator().manual_seed(2)
    target_probs = torch.softmax(torch.randn(6, 5, V, generator=generator), -1)
    draft_tokens = torch.randint(0, V, (6, 4), generator=generator)
    seeds, starts, lengths = [0, 1, 2, 3, 4, 5], [3, 9, 0, 40, 7, 7], [4, 0, 2, 4, 1, 3]
    tokens, accepted = invariant_verify(draft_tokens, target_probs, seeds, starts, lengths)
    for row in range(6):
        k = lengths[row]
        alone, count = invariant_verify(draft_tokens[row : row + 1, :k],
                                        target_probs[row : row + 1, : k + 1], seeds[row],
                                        starts[row])
        assert int(count) == int(accepted[row])
        assert tokens[row, : int(count) + 1].tolist() == alone[0, : int(count) + 1].tolist()
        assert (tokens[row, int(count) + 1 :] == PAD_TOKEN).all()


def test_table_a_draft_equal_to_the_targets_draws_is_accepted_whole():
    target_probs = torch.softmax(torch.randn(1, 4, V, dtype=torch.float64), -1)
    draws = invariant_sample(target_probs[0], 5, [10, 11, 12, 13])  # [4]
    tokens, accepted = invariant_verify(draws[None, :3], target_probs, 5, 10)
    assert accepted.tolist() == [3] and tokens[0].tolist() == draws.tolist()
    wrong = draws[:3].clone()
    wrong[1] = (wrong[1] + 1) % V
    tokens, accepted = invariant_verify(wrong[None], target_probs, 5, 10)
    assert accepted.tolist() == [1] and tokens[0].tolist() == draws[:2].tolist() + [PAD_TOKEN] * 2
    with pytest.raises(ValueError, match="positive"):
        invariant_verify(draws[None, :3], torch.zeros(1, 4, V), 5, 10)


# --- The law over seeds ------------------------------------------------------------------------

N = 30_000


def first_two(target, draft, verifier, draft_noise=0):
    """Counts [V * V] of the first two output tokens over N seeds: a round of K = 2 draft tokens
    drawn from q with the shared noise (draft_noise = 0; else the noise of seed + draft_noise),
    verified by `verifier`; a lone token is completed by the next round's plain invariant
    draw."""
    seeds = torch.arange(N)
    first_q = draft[0].expand(N, -1)
    drafted = [invariant_sample(first_q, seeds + draft_noise, PROMPT_LENGTH)]
    drafted.append(invariant_sample(draft[1][drafted[0]], seeds + draft_noise,
                                    PROMPT_LENGTH + 1))
    draft_tokens = torch.stack(drafted, 1)  # [N, 2]
    target_probs = torch.stack([target[0].expand(N, -1), target[1][drafted[0]],
                                target[1][drafted[1]]], 1)  # [N, 3, V]
    draft_probs = torch.stack([first_q, draft[1][drafted[0]]], 1)
    tokens, _ = verifier(draft_tokens, draft_probs, target_probs, seeds)
    lone = tokens[:, 1] == PAD_TOKEN
    tokens[lone, 1] = invariant_sample(target[1][tokens[lone, 0]], seeds[lone], PROMPT_LENGTH + 1)
    return torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).double()


def invariant(draft_tokens, draft_probs, target_probs, seeds):
    return invariant_verify(draft_tokens, target_probs, seeds, PROMPT_LENGTH)


def test_law_of_the_first_two_tokens_is_the_targets():
    target, draft = markov(3), markov(4)
    joint = (target[0][:, None] * target[1]).flatten()
    assert chi2_pvalue(first_two(target, draft, invariant), joint) > 1e-3


def test_negative_control_unshared_noise_checked_against_the_drafts_own_draw_fails():
    """The draft draws with its own noise, and a verifier compares each token with the
    draft's own draw (not the target's): it accepts everything, the output follows q, and the
    same test rejects it."""
    target, draft = markov(3), markov(4)

    def own_draw(draft_tokens, draft_probs, target_probs, seeds):
        own = torch.stack([invariant_sample(draft_probs[:, i], seeds + 10**6, PROMPT_LENGTH + i)
                           for i in range(2)], 1)
        accepted = (draft_tokens == own).long().cumprod(-1).sum(-1)
        assert (accepted == 2).all()
        bonus = invariant_sample(target_probs[:, 2], seeds, PROMPT_LENGTH + 2)
        return torch.cat([draft_tokens, bonus[:, None]], 1), accepted

    joint = (target[0][:, None] * target[1]).flatten()
    assert chi2_pvalue(first_two(target, draft, own_draw, draft_noise=10**6), joint) < 1e-6


def plain_invariant_draw(probs: torch.Tensor, seed: int, positions: list[int]) -> torch.Tensor:
    """invariant_sample's definition over the whole vocabulary, the hash in Python integers:
    argmax_x p(x) / E(x), E = -log u, u = ((bits >> 12) + 1/2) / 2^52 (torch's log: the one
    verispec takes)."""
    mask, golden, salt = (1 << 64) - 1, 0x9E3779B97F4A7C15, 0x5851F42D4C957F2D
    seed_key = splitmix64_reference((seed & mask) ^ salt)
    uniforms = []
    for position in positions:
        key = splitmix64_reference((seed_key + (position + 1) * golden) & mask)
        uniforms.append([((splitmix64_reference((key + (token + 1) * golden) & mask) >> 12)
                          + 0.5) * 2.0 ** -52 for token in range(probs.shape[-1])])
    noise = -torch.tensor(uniforms, dtype=torch.float64).log()
    return (probs.double() / noise).max(dim=-1).indices


def test_invariant_draws_equal_the_plain_argmax_over_the_vocabulary(monkeypatch):
    """invariant_sample takes E and p / E only at the tokens that can win (those over a cut
    under the top token's probability, and those whose noise is small enough to win from
    under it); its draws are the plain argmax's token for token: on rows whose mass is mostly
    under the cut (a 0.3 head over a flat tail), peaked, flat, sparse and unnormalised rows
    with ties, in float32, float64 and bfloat16. Control: without the small-noise candidates
    the tail's winners are missed."""
    import numpy as np

    from verispec import invariant

    vocab, generator = 4096, torch.Generator().manual_seed(0)
    head_tail = torch.full((8, vocab), 0.7 / (vocab - 1))
    head_tail[torch.arange(8), torch.randint(0, vocab, (8,), generator=generator)] = 0.3
    logits = torch.randn(4, vocab, generator=generator)
    sparse = torch.softmax(4 * logits, -1)
    sparse = sparse.masked_fill(sparse < sparse.topk(20, -1).values[:, -1:], 0.0)
    rows = torch.cat([head_tail, torch.softmax(4 * logits, -1), torch.softmax(0.3 * logits, -1),
                      sparse, (torch.softmax(2 * logits, -1) * 1000).round() + 1.0])  # [24, V]
    positions = list(range(100, 100 + rows.shape[0]))
    expected = plain_invariant_draw(rows, 12345, positions)
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(invariant_sample(rows.to(dtype), 12345, positions), expected)
    half = rows.bfloat16()
    assert torch.equal(invariant_sample(half, 12345, positions),
                       plain_invariant_draw(half, 12345, positions))
    one_by_one = [int(invariant_sample(rows[i:i + 1], 12345, [p])[0])
                  for i, p in enumerate(positions)]
    assert one_by_one == expected.tolist()
    assert invariant_sample(rows[:0], 12345, []).shape == (0,)

    candidates = invariant._candidates

    def without_small_noise(probs, keys, cut, least, counters):
        return candidates(probs, keys, cut, np.full_like(least, (1 << 52) - 1), counters)

    monkeypatch.setattr(invariant, "_candidates", without_small_noise)
    missed = invariant_sample(rows, 12345, positions) != expected
    assert missed[:8].sum() >= 3 and not missed[8:12].any()  # tail winners missed, peaked fine
