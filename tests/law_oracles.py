"""Exact laws of one verification round of each procedure (token-wise, block, invariant), for
given per-prefix target and draft distributions over a small vocabulary, by enumeration: the
oracles the distribution tests compare verispec's samplers against (`round_law`,
`expected_accepted`, `gumbel_agreement`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from verispec.params import VERIFY_METHODS

# A next-token distribution given the prefix after the round's start: prefix -> V numbers
# (floats or fractions.Fraction, for exact arithmetic). The same for p (target) and q (draft).
Distribution = Callable[[tuple[int, ...]], Sequence]



def iid(probs: Sequence) -> Distribution:
    """The same distribution at every position, whatever the prefix."""
    return lambda prefix: probs


def round_law(target: Distribution, draft: Distribution, k: int, method: str
              ) -> dict[tuple[int, ...], object]:
    """The exact law of one round's emitted tokens (accepted draft tokens, then the recovered or
    bonus token) when the drafter proposes k tokens and `method` verifies them: {tokens:
    probability}. "token" and "block": the draft is drawn from q, x_i ~ q(. | x_<i);
    "invariant": draft and target draw with shared Gumbel noise at each position, and a draft
    token is accepted exactly when it equals the target's draw.

    A lossless method's law, continued by plain sampling from the target to k + 1 tokens, is the
    target's law of k + 1 tokens (tests check it exactly). Example: p = (1/3, 2/3),
    q = (2/3, 1/3) i.i.d., k = 1, "token": the draft is 0 (chance 2/3, kept half the time) or 1
    (kept always) -> {(1,): 1/3, (0, 0): 1/9, (0, 1): 2/9, (1, 0): 1/9, (1, 1): 2/9}.
    """
    if method not in VERIFY_METHODS:
        raise ValueError(f"method must be one of {VERIFY_METHODS}, got {method!r}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    law: dict[tuple[int, ...], object] = defaultdict(int)
    if method == "invariant":
        _invariant_round(target, draft, k, (), 1, law)
        return dict(law)
    for drafted, chance in _drafts(draft, k, (), 1):
        outcomes = (_token_outcomes if method == "token" else _block_outcomes)(
            target, draft, drafted)
        for stop, stop_chance, next_probs in outcomes:
            for token, mass in enumerate(next_probs):
                if stop_chance * mass:
                    law[drafted[:stop] + (token,)] += chance * stop_chance * mass
    return dict(law)


def expected_accepted(target: Distribution, draft: Distribution, k: int, method: str):
    """E[accepted draft tokens] of one round (tokens per target pass minus one), exactly.

    Example (Sun et al. 2025's toy case): p = (1/3, 2/3), q = (2/3, 1/3) at every position, k = 2:
    token-wise 10/9, block 11/9 (as Fractions, exactly).
    """
    return sum((len(tokens) - 1) * chance
               for tokens, chance in round_law(target, draft, k, method).items())


def gumbel_agreement(target_probs: Sequence, draft_probs: Sequence) -> list:
    """P(both draw y) [V] when p and q draw by Gumbel-max with the same noise:
    1 / sum_j max(p_j / p_y, q_j / q_y) (0 where p_y or q_y is 0). Its sum is invariant
    verification's acceptance chance at a position, at least (1 - TV) / (1 + TV)."""
    agreement = []
    for p_y, q_y in zip(target_probs, draft_probs, strict=True):
        if p_y <= 0 or q_y <= 0:
            agreement.append(0)
            continue
        agreement.append(1 / sum(max(p_j / p_y, q_j / q_y)
                                 for p_j, q_j in zip(target_probs, draft_probs, strict=True)))
    return agreement


def _drafts(draft: Distribution, k: int, prefix: tuple[int, ...], chance):
    """Every draft of k tokens with positive chance under q, with that chance."""
    if len(prefix) == k:
        yield prefix, chance
        return
    for token, mass in enumerate(draft(prefix)):
        if mass > 0:
            yield from _drafts(draft, k, prefix + (token,), chance * mass)


def _residual(target_probs: Sequence, draft_probs: Sequence, scale=1) -> list:
    """max(0, scale p - q) normalised; p itself where it has no mass (as verify.residual)."""
    excess = [max(0, scale * p - q) for p, q in zip(target_probs, draft_probs, strict=True)]
    mass = sum(excess)
    return [e / mass for e in excess] if mass > 0 else list(target_probs)


def _token_outcomes(target: Distribution, draft: Distribution, drafted: tuple[int, ...]):
    """(tau, chance, next-token law) of token-wise verification of one draft."""
    kept = 1
    for i, token in enumerate(drafted):
        p, q = target(drafted[:i]), draft(drafted[:i])
        accept = min(1, p[token] / q[token])
        if kept * (1 - accept):
            yield i, kept * (1 - accept), _residual(p, q)
        kept *= accept
    if kept:
        yield len(drafted), kept, target(drafted)


def _block_outcomes(target: Distribution, draft: Distribution, drafted: tuple[int, ...]):
    """(tau, chance, next-token law) of block verification of one draft (verify.chains.block):
    P(tau = t) = h_t prod_{j > t} (1 - h_j), h_0 = 1."""
    k = len(drafted)
    weights, stops = [1], [1]  # p_0 = 1; h_0 = 1 (no coin: the fallback)
    for i, token in enumerate(drafted):
        p, q = target(drafted[:i]), draft(drafted[:i])
        weights.append(min(1, weights[-1] * p[token] / q[token]))
    for i in range(1, k + 1):
        if i == k:
            stops.append(weights[k])
            break
        p, q = target(drafted[:i]), draft(drafted[:i])
        mass = sum(max(0, weights[i] * p_x - q_x) for p_x, q_x in zip(p, q, strict=True))
        stops.append(mass / (mass + 1 - weights[i]) if mass > 0 else 0)
    later = 1  # prod_{j > t} (1 - h_j)
    for t in range(k, -1, -1):
        chance = stops[t] * later
        if chance:
            next_probs = (target(drafted) if t == k else
                          _residual(target(drafted[:t]), draft(drafted[:t]), weights[t]))
            yield t, chance, next_probs
        later *= 1 - stops[t]


def _invariant_round(target, draft, k, prefix, chance, law) -> None:
    """Walk the prefixes on which draft and target agree (shared noise per position)."""
    p = target(prefix)
    if len(prefix) == k:
        for token, mass in enumerate(p):
            if mass:
                law[prefix + (token,)] += chance * mass
        return
    agreement = gumbel_agreement(p, draft(prefix))
    for token, (mass, both) in enumerate(zip(p, agreement, strict=True)):
        if mass - both:  # the target drew `token`, the draft another: the correction
            law[prefix + (token,)] += chance * (mass - both)
        if both:
            _invariant_round(target, draft, k, prefix + (token,), chance * both, law)
