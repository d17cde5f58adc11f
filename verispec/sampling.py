"""Logits -> probabilities, and drawing tokens from them.

The same `warp` is applied to the target's and the draft's logits. Speculative decoding is
then exact for the *warped* target distribution: the output is distributed as if every token
had been sampled from `warp(target_logits)`.

Two ways to draw: from a generator's stream (`sample`: a row's draws depend on how many came
before), or drafter-invariant (`invariant_sample`: the draw at an absolute position depends on
(seed, position, probabilities) alone).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

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
# A seeded request draws the token at absolute position t (its index in prompt + output) as
# argmax_x(log p(x) + G[x]), with Gumbel noise G that depends on (seed, t, x) alone: a
# counter-based hash (SplitMix64's finaliser), not a generator's stream. So a token's draw
# does not depend on how many draws came before it, on K, on a tree, or on the batch, and a
# draft that draws with the same noise proposes the very token the target will draw wherever
# their distributions agree enough (Daliri, Musco, Suresh 2024).

_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio, odd)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_SEED_SALT = 0x5851F42D4C957F2D  # separates the seed's stream from the positions'


def wrap_int64(value: int) -> int:
    """An integer taken mod 2^64, as the signed int64 with those bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in place on int64 bit patterns (multiplication wraps mod 2^64;
    torch's >> on int64 is arithmetic, so each shift is masked to a logical one). In place,
    with one scratch tensor: over a 49k vocabulary fresh allocations cost more than the
    arithmetic."""
    for bits, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(x, bits, out=scratch)
        x ^= scratch.bitwise_and_((1 << (64 - bits)) - 1)
        if multiplier is not None:
            x *= wrap_int64(multiplier)
    return x


def _as_int64(values: int | Sequence[int] | torch.Tensor, device: torch.device | str | None
              ) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"seeds and positions must be integers, got {values.dtype}")
        return values.to(device=device, dtype=torch.int64)
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
        shape: tuple[int, ...] = ()
    else:
        values, shape = list(values), (len(values),)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"seeds and positions must be integers, got {values!r}")
    return torch.tensor([wrap_int64(v) for v in values], dtype=torch.int64,
                        device=device).reshape(shape)


def position_noise(seed: int | Sequence[int] | torch.Tensor,
                   position: int | Sequence[int] | torch.Tensor,
                   vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Gumbel noise [..., V] float64 for the tokens at absolute positions `position`
    (an int, or integers [...]) of a request with `seed` (an int, or integers broadcastable to
    position's shape). A pure function of (seed, position, token): every call, batch, device
    and drafter gets the same noise for the same triple (up to float64 rounding of log).

    Per triple: key = mix(mix(seed ^ salt) + (position + 1) * golden), bits = mix(key +
    (token + 1) * golden); the top 52 bits give u = (bits + 1/2) / 2^52 in (0, 1), E = -log u
    (an Exp(1) draw) and G = -log E.
    """
    return -torch.log(_position_exponentials(seed, position, vocab_size, device))


def _position_exponentials(seed: int | Sequence[int] | torch.Tensor,
                           position: int | Sequence[int] | torch.Tensor,
                           vocab_size: int, device: torch.device | str | None) -> torch.Tensor:
    """E = exp(-G) [..., V] float64 > 0, i.i.d. Exp(1) across (seed, position, token)."""
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if isinstance(position, int) and position < 0:
        raise ValueError(f"a position must be >= 0, got {position}")
    seeds, positions = _as_int64(seed, device), _as_int64(position, device)
    seeds, positions = torch.broadcast_tensors(seeds.to(positions.device), positions)
    key = _mix64_(seeds ^ wrap_int64(_SEED_SALT), torch.empty_like(seeds))
    key = _mix64_(key + (positions + 1) * wrap_int64(_GOLDEN), torch.empty_like(key))  # [...]
    bits = key.unsqueeze(-1) + _token_counters(vocab_size, key.device)  # [..., V]
    scratch = torch.empty_like(bits)
    _mix64_(bits, scratch)
    torch.bitwise_right_shift(bits, 12, out=scratch).bitwise_and_((1 << 52) - 1)
    uniform = scratch.double().add_(0.5).mul_(2.0 ** -52)  # [..., V] in (0, 1)
    return uniform.log_().neg_()


@functools.lru_cache(maxsize=8)
def _token_counters(vocab_size: int, device: torch.device) -> torch.Tensor:
    """(token + 1) * golden for every token [V] int64: the per-token half of the hash's input,
    the same for every position (kept, not rebuilt every draw)."""
    return torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device) * wrap_int64(_GOLDEN)


def invariant_draw(probs: torch.Tensor, seed: int | Sequence[int] | torch.Tensor,
                   positions: int | Sequence[int] | torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`invariant_sample` without its check: (tokens [...], ok [...] bool: the drawn token has
    positive mass; False for a row of zeros or NaN). For callers that fold the check into the
    host sync they make anyway."""
    exponentials = _position_exponentials(seed, positions, probs.shape[-1], probs.device)
    # argmax(log p + G) = argmax(p / E), G = -log E: one log over V instead of three.
    tokens = (probs.double() / exponentials).max(dim=-1).indices  # [...]
    ok = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) > 0
    return tokens, ok


def invariant_sample(probs: torch.Tensor, seed: int | Sequence[int] | torch.Tensor,
                     positions: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Drafter-invariant sampling: probs [..., V] (warped; each row's sum > 0) -> tokens [...],
    argmax(log p + G) with G = position_noise(seed, positions): token x with probability
    p(x) / sum, as the Gumbel-max trick gives, and the same token for the same (seed, position,
    probs) everywhere. Plain decoding, drafters and `verify.invariant_verify` all draw through
    this one function, so a speculative run's output equals a plain run's token for token.

    Example: probs [[.5, .5, 0]], seed 7, positions [3] -> 0 or 1 (never 2), the same every call.
    """
    tokens, ok = invariant_draw(probs, seed, positions)
    if not bool(ok.all()):
        raise ValueError("invariant_sample() needs every row to have positive mass; got a row "
                         "of zeros or NaN")
    return tokens


def draw(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
         position: int) -> torch.Tensor:
    """A drafter's draw of the token at absolute `position`: probs [1, V] (warped) -> [1].
    Under verify="invariant" with the request's position-keyed noise, so the draft agrees with
    the target's own draw as often as the coupling allows; otherwise from the row's generator."""
    if params.verify == "invariant" and params.seed is not None:
        return invariant_sample(probs, params.seed, [position])
    return sample(probs, generator)
