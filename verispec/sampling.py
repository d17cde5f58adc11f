"""Logits -> probabilities, and drawing tokens from them.

The same `warp` is applied to the target's and the draft's logits. Speculative decoding is
then exact for the *warped* target distribution: the output is distributed as if every token
had been sampled from `warp(target_logits)`.

Two ways to draw: from a generator's stream (`sample`: a row's draws depend on how many came
before), or drafter-invariant (`verispec.invariant.invariant_sample`: the draw at an absolute
position depends on (seed, position, probabilities) alone).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from verispec.invariant import invariant_sample
from verispec.params import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into probabilities [..., V] (float32) under temperature, top-k,
    top-p and min-p, applied in that order.

    Example: logits [2., 1., 0.] with temperature 1 and top_k 2 -> softmax([2., 1.]) on the first
    two entries, 0 on the third: [0.731, 0.269, 0.].
    """
    if params.greedy:
        raise ValueError("warp() is for sampling; temperature 0 is greedy (use argmax)")
    logits = logits.float() / params.temperature
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the first token is always kept.
        drop_sorted = mass_before >= params.top_p
        # A top_p under float32's smallest number compares as 0, which would drop the top too.
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension: logits [..., V] -> tokens [...] long, the first
    maximal index on ties (as argmax). Greedy decoding takes one per position verified or
    drafted, per row: float32 on the CPU goes through NumPy's argmax (~4 us over 49k logits,
    where torch's reduction, with its fixed cost, took ~27-66 us: ~8% of plain decoding's time
    at batch 16); elsewhere `max(dim).indices`, 2-4x faster than `argmax` (the same index)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.numel():
        choice = np.asarray(np.argmax(logits.numpy(force=True), axis=-1), dtype=np.int64)
        return torch.from_numpy(choice)
    return logits.max(dim=-1).indices


def has_mass(probs: torch.Tensor) -> bool:
    """Whether probs [..., V] can be drawn from: a finite, positive total (a draft whose weights
    went to NaN gives NaN; `sample` refuses it). A drafter whose distribution cannot be drawn
    from proposes nothing more: verification is exact for any draft, so the target's output
    is unchanged."""
    total = float(probs.sum())
    return math.isfinite(total) and total > 0.0


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row: probs [B, V] (each row's sum > 0; need not be 1) -> tokens [B]
    long, token i with probability probs[i] / sum.

    By the inverse of the cumulative distribution, in float64: a uniform u in [0, total) picks
    the first token whose cumulative mass exceeds u, so a token of probability 0 (an empty
    interval) is never drawn. On the CPU this is ~20x faster than torch.multinomial over a
    49k vocabulary (~50 us against ~1 ms a draw), which speculative sampling calls once per
    drafted token and once per round.
    """
    cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [B, V]
    total = cumulative[:, -1:]  # [B, 1]
    if not bool((total > 0).all()):  # as torch.multinomial, refuse rather than draw past V
        raise ValueError("sample() needs every row to have positive mass; got a row of zeros "
                         "or NaN")
    uniform = torch.rand(total.shape, generator=generator, dtype=torch.float64,
                         device=probs.device)  # [B, 1] in [0, 1)
    return _pick(cumulative, uniform)


def sample_distinct(probs: torch.Tensor, count: int, generator: torch.Generator | None
                    ) -> list[int]:
    """Draw up to `count` distinct tokens from probs [V] without replacement: each from probs
    with the tokens drawn before it removed, renormalised (fewer where fewer tokens have
    mass)."""
    remaining, drawn = probs.clone(), []
    for _ in range(min(count, int((probs > 0).sum()))):
        token = int(sample(remaining.unsqueeze(0), generator)[0])
        drawn.append(token)
        remaining[token] = 0.0
    return drawn


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token each row's uniform picks: probs [B, V] (sum > 0; need not be 1), uniform
    [B, 1] float64 in [0, 1) -> tokens [B] long, the first token whose cumulative mass exceeds
    uniform * sum. `sample` is this with a uniform from the generator; verifiers that draw
    their uniforms ahead (one row's draws the same alone or in a batch) call it directly."""
    return _pick(torch.cumsum(probs, dim=-1, dtype=torch.float64), uniform)


def _pick(cumulative: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """cumulative [B, V] float64, uniform [B, 1] -> tokens [B]."""
    total = cumulative[:, -1:]  # [B, 1]
    # u < total even where rounding would make uniform * total reach it.
    u = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, u, right=True).squeeze(-1)  # [B]


# --- Position-keyed noise: drafter-invariant sampling ---------------------------------------
#
def draw(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
         position: int) -> torch.Tensor:
    """A drafter's draw of the token at absolute `position`: probs [1, V] (warped) -> [1].
    Under verify="invariant" with the request's position-keyed noise, so the draft agrees with
    the target's own draw as often as the coupling allows; otherwise from the row's generator."""
    if params.verify == "invariant" and params.seed is not None:
        return invariant_sample(probs, params.seed, [position])
    return sample(probs, generator)
