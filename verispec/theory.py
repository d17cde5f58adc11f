"""The expected-tokens formula of speculative decoding and the choice of K it implies.

With per-token acceptance probability gamma (i.i.d. across positions) and K draft tokens, one
target pass emits on average (1 - gamma^(K+1)) / (1 - gamma) tokens (K + 1 at gamma = 1).
Example: gamma = 0.8, K = 5 -> (1 - 0.8^6) / 0.2 = 3.69 tokens per target pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def expected_tokens(gamma: float, k: int) -> float:
    """Expected tokens emitted per target pass: (1 - gamma^(k+1)) / (1 - gamma)."""
    _check_gamma(gamma)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if gamma == 1.0:
        return float(k + 1)
    return (1.0 - gamma ** (k + 1)) / (1.0 - gamma)


def expected_speedup(gamma: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over plain decoding: expected_tokens / (k * c + verify_cost).

    cost_ratio c is the time of one draft step over one target step; verify_cost is the time of
    the target pass over k + 1 positions, in units of a one-token target step.
    """
    if cost_ratio < 0 or verify_cost <= 0:
        raise ValueError("cost_ratio must be >= 0 and verify_cost > 0")
    return expected_tokens(gamma, k) / (k * cost_ratio + verify_cost)


def optimal_k(
    gamma: float,
    cost_ratio: float,
    verify_cost: float | Sequence[float] = 1.0,
    k_max: int = 16,
) -> int:
    """The K in [0, k_max] with the highest expected speedup; 0 when speculation does not pay
    (K = 0 is plain decoding, speedup 1 by definition).

    verify_cost is one number for every K, or a sequence where verify_cost[k] is the cost of a
    target pass over k + 1 positions (verify_cost[0] == 1 by definition); K is then capped at
    len(verify_cost) - 1.
    """
    if isinstance(verify_cost, int | float):
        costs = [1.0] + [float(verify_cost)] * k_max
    else:
        costs = [float(c) for c in verify_cost][: k_max + 1]
    best_k, best = 0, 1.0
    for k in range(1, len(costs)):
        speedup = expected_speedup(gamma, k, cost_ratio, costs[k])
        if speedup > best + 1e-12:
            best_k, best = k, speedup
    return best_k


def batch_optimal_k(
    gammas: Sequence[float],
    cost_ratio: float,
    verify_cost: Sequence[float],
    k_max: int = 16,
    min_speedup: float = 1.0,
) -> int:
    """The K one batch shares: the K in [0, k_max] maximising the batch's expected tokens per
    unit of time, mean_i E(gamma_i, K) / (K c + v(K + 1)), with c and v measured at this batch
    size relative to a plain batched step; 0 when that does not beat plain batched decoding
    by at least min_speedup (a margin for what the model leaves out: drafting bookkeeping).

    Example: gammas [0.9, 0.1], c 0, v = [1, 1.1, 1.2] -> K = 2: mean E = (2.71 + 1.11) / 2
    = 1.91, / 1.2 = 1.59, against K = 1: 1.5 / 1.1 = 1.36.
    """
    if not gammas:
        return 0
    for gamma in gammas:
        _check_gamma(gamma)
    costs = [float(c) for c in verify_cost][: k_max + 1]
    best_k, best = 0, min_speedup
    for k in range(1, len(costs)):
        gain = sum(expected_tokens(g, k) for g in gammas) / len(gammas)
        speedup = gain / (k * cost_ratio + costs[k])
        if speedup > best + 1e-12:
            best_k, best = k, speedup
    return best_k


def batch_allocation(gains: Sequence[Sequence[float]],
                     pass_cost: Callable[[float], float]) -> list[int]:
    """How many of each row's proposed tokens a batch verifies: the counts maximising the
    batch's expected tokens per unit of time, (rows + sum of the kept gains) / pass_cost(kept),
    where gains[i][j] is the chance that row i's token j + 1 is accepted (not increasing along
    a row: gamma^(j+1) for a chain) and pass_cost(E) prices a pass holding E extra positions
    (pass_cost(0) is a plain step). Tokens are taken best first, a row's in order, and the best
    prefix of that order is kept: a token is worth its place while its gain beats what the
    pass's extra price would earn at the batch's current rate, so one row's long lookup does
    not slow fifteen others for a few tokens.

    Example: gains [[0.9, 0.8], [0.2]], pass_cost(E) = 1 + 0.1 E -> [2, 0]: (2 + 1.7) / 1.2
    = 3.08 beats (2 + 0.9) / 1.1 = 2.64 and (2 + 1.9) / 1.3 = 3.0.
    """
    for row in gains:
        for gain, after in zip(row[:-1], row[1:], strict=True):
            if after > gain + 1e-12:
                raise ValueError(f"a row's gains must not increase along it, got {list(row)}")
    order = sorted(((gain, i, j) for i, row in enumerate(gains) for j, gain in enumerate(row)),
                   key=lambda item: (-item[0], item[1], item[2]))
    tokens = float(len(gains))
    best_count, best_rate = 0, tokens / pass_cost(0)
    for count, (gain, _, _) in enumerate(order, start=1):
        tokens += gain
        rate = tokens / pass_cost(count)
        if rate > best_rate + 1e-12:
            best_count, best_rate = count, rate
    kept = [0] * len(gains)
    for _, i, _ in order[:best_count]:
        kept[i] += 1
    return kept


def sampled_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The chance that rejection sampling accepts one token drawn from the draft:
    sum over x of min(p(x), q(x)) = 1 - TV(p, q), for probs [..., V] -> [...].

    Example: p = [.5, .5, 0], q = [.25, .25, .5] -> .25 + .25 + 0 = .5.
    """
    return torch.minimum(target_probs, draft_probs).sum(dim=-1)


def _check_gamma(gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
