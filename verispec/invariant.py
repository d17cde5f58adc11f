"""Drafter-invariant sampling: the token at an absolute position drawn by (seed, position,
probabilities) alone.

A seeded request under verify="invariant" draws the token at absolute position t (its index
in prompt + output) as argmax_x(log p(x) + G[x]), with Gumbel noise G that depends on (seed,
t, x) alone: a counter-based hash (SplitMix64's finaliser), not a generator's stream. So a
token's draw does not depend on how many draws came before it, on K, on a tree, or on the
batch, and a draft that draws with the same noise proposes the very token the target will draw
wherever their distributions agree enough (Daliri, Musco, Suresh 2024). Plain decoding,
drafters and invariant verification (verispec.verify's chains and trees) all draw through
`invariant_draw` / `invariant_sample` here, with the one hash `mix64_`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio, odd)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_SEED_SALT = 0x5851F42D4C957F2D  # separates the seed's stream from the positions'


def wrap_int64(value: int) -> int:
    """An integer taken mod 2^64, as the signed int64 with those bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


_ROUNDS = ((30, _MIX1), (27, _MIX2), (31, None))  # SplitMix64's finaliser: shift, multiplier


def mix64_(x: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, in place on a uint64 array (>> on uint64 is logical and
    multiplication wraps mod 2^64), with one scratch array of its shape: over a 49k vocabulary
    fresh allocations cost more than the arithmetic. The one implementation of the hash: every
    device's noise is computed here, on the CPU."""
    for bits, multiplier in _ROUNDS:
        np.right_shift(x, bits, out=scratch)
        x ^= scratch
        if multiplier is not None:
            np.multiply(x, np.uint64(multiplier), out=x)
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
    keys = _keys(seed, position, vocab_size, device)
    counters = _token_counters(vocab_size)
    return -torch.log(_exponentials(_token_bits(keys.unsqueeze(-1), counters)))


def _keys(seed: int | Sequence[int] | torch.Tensor, position: int | Sequence[int] | torch.Tensor,
          vocab_size: int, device: torch.device | str | None) -> torch.Tensor:
    """Each (seed, position)'s key [...] int64: mix(mix(seed ^ salt) + (position + 1) * golden)."""
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if isinstance(position, int) and position < 0:
        raise ValueError(f"a position must be >= 0, got {position}")
    seeds, positions = _as_int64(seed, "cpu"), _as_int64(position, "cpu")
    seeds, positions = torch.broadcast_tensors(seeds, positions)
    key = _u64(seeds) ^ np.uint64(_SEED_SALT)
    key = np.add(mix64_(key, np.empty_like(key)),
                 (_u64(positions) + np.uint64(1)) * np.uint64(_GOLDEN), out=key)
    key = mix64_(key, np.empty_like(key))
    return torch.from_numpy(key.view(np.int64)).reshape(seeds.shape).to(device)


def _token_bits(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The top 52 bits of mix(key + counter), int64 in [0, 2^52): keys and counters ((token +
    1) * golden, `_token_counters`) broadcast together; hashed on the CPU (NumPy's uint64
    kernels take about half torch's time), returned on the keys' device."""
    key, counter = _u64(keys.cpu()), _u64(counters)
    bits = np.add(key, counter, out=np.empty(np.broadcast_shapes(key.shape, counter.shape),
                                             np.uint64))
    mix64_(bits, np.empty_like(bits))
    bits = torch.from_numpy(np.right_shift(bits, 12, out=bits).view(np.int64))
    return bits.reshape(torch.broadcast_shapes(keys.shape, counters.shape)).to(keys.device)


def _u64(values: torch.Tensor) -> np.ndarray:
    """A CPU int64 tensor's bits as a uint64 array, not copied where it can be viewed (an
    array at least one-dimensional: NumPy's in-place ops need one; a 0-d tensor gives [1])."""
    return np.atleast_1d(values.numpy()).view(np.uint64).reshape(values.shape or (1,))


def _exponentials(bits: torch.Tensor) -> torch.Tensor:
    """E = -log u > 0 float64 from bits (`_token_bits`), u = (bits + 1/2) / 2^52 in (0, 1):
    i.i.d. Exp(1) across (seed, position, token). Elementwise, and torch's log gives an
    element the same bits at any place in any tensor: E at a few tokens is E over all there."""
    return bits.double().add_(0.5).mul_(2.0 ** -52).log_().neg_()


@functools.lru_cache(maxsize=8)
def _token_counters(vocab_size: int) -> torch.Tensor:
    """(token + 1) * golden for every token [V] int64: the per-token half of the hash's input,
    the same for every position (kept, not rebuilt every draw); on the CPU, where the hash
    runs."""
    return torch.arange(1, vocab_size + 1, dtype=torch.int64) * wrap_int64(_GOLDEN)


def invariant_draw(probs: torch.Tensor, seed: int | Sequence[int] | torch.Tensor,
                   positions: int | Sequence[int] | torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`invariant_sample` without its check: (tokens [...], ok [...] bool: the drawn token has
    positive mass; False for a row of zeros or NaN). For callers that fold the check into the
    host sync they make anyway."""
    vocab = probs.shape[-1]
    keys = _keys(seed, positions, vocab, probs.device)  # [...]
    shape = torch.broadcast_shapes(probs.shape[:-1], keys.shape)
    tokens = _noisy_argmax(probs.expand(*shape, vocab).reshape(-1, vocab),
                           keys.expand(shape).reshape(-1)).reshape(shape)
    ok = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) > 0
    return tokens, ok


def _noisy_argmax(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax_x probs[x] / E[x] per row, the first on ties, E the row's noise (`_exponentials`
    of `_token_bits(key, .)`): probs [N, V], keys [N] -> tokens [N]; argmax(log p + G) =
    argmax(p / E), G = -log E: one log over V instead of three.

    Bit for bit `(probs.double() / E).max(-1).indices`, in a fraction of the time on the CPU,
    where E and the ratio are taken only at the tokens that can win. The ratio at the most
    probable token, p* / E*, bounds the best from below, so a token under cut = p* / 1024
    needs E < cut / bound (= E* / 1024) to reach it: its bits above a threshold. The
    candidates are the tokens over the cut (a few to a few hundred on a language model's
    distributions) and those over the threshold (~0.1%); the hash is still taken over the
    whole vocabulary (`_candidates`). Margins cover the rounding of log, exp and the division
    (~1e-16 against 1e-9). Off the CPU, for no rows, or for a row without a positive finite
    maximum (it draws what it drew, and is refused by the caller), the plain form."""
    num_rows, vocab = probs.shape
    counters = _token_counters(vocab)  # [V]

    def plain() -> torch.Tensor:
        noise = _exponentials(_token_bits(keys.unsqueeze(-1), counters))  # [N, V]
        return (probs.double() / noise).max(dim=-1).indices

    if probs.device.type != "cpu" or not num_rows:
        return plain()
    if probs.dtype not in (torch.float32, torch.float64):
        probs = probs.float()  # exact, as probs.double() after it
    values = probs.detach().numpy()  # [N, V]
    top_token = np.argmax(values, axis=-1)  # [N]
    top = values[np.arange(num_rows), top_token]
    if not bool((np.isfinite(top) & (top > 0)).all()):
        return plain()
    key, counter = _u64(keys), _u64(counters)

    def ratio(rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """probs.double() / E at these (row, token) pairs: the same bits as over all."""
        bits = np.add(key[rows], counter[tokens])
        bits = np.right_shift(mix64_(bits, np.empty_like(bits)), 12, out=bits)
        noise = _exponentials(torch.from_numpy(bits.view(np.int64))).numpy()
        return values[rows, tokens].astype(np.float64) / noise

    # 1. A lower bound on the best ratio; the least bits a token under the cut needs.
    bound = ratio(np.arange(num_rows), top_token)  # [N]
    cut = top * 2.0 ** -10  # [N], exact
    reach = cut.astype(np.float64) / bound * (1.0 + 1e-9)  # the E it needs, at most
    least = np.floor(np.exp(-reach) * 2.0 ** 52) - 4  # u >= exp(-reach): bits >= least
    # 2. The exact ratio at the candidates (grouped by row, every row has its top); each
    #    row's first maximum among them.
    flat = _candidates(values, key, cut, least.clip(min=0).astype(np.uint64), counter)
    rows, tokens = np.divmod(flat, vocab)
    at = ratio(rows, tokens)
    starts = np.searchsorted(rows, np.arange(num_rows))
    best = np.maximum.reduceat(at, starts)  # [N]
    first = np.where(at == best[rows], tokens, vocab)
    return torch.from_numpy(np.minimum.reduceat(first, starts))


_CHUNK = 1 << 16  # tokens hashed at a time: the hash's passes stay in a core's L2


def _candidates(probs: np.ndarray, keys: np.ndarray, cut: np.ndarray, least: np.ndarray,
                counters: np.ndarray) -> np.ndarray:
    """Flat indices (row * V + token, ascending) of the tokens with probs[n] >= cut[n] or bits
    (`_token_bits(keys[n], counters)`) >= least[n]: probs [N, V], keys, least [N] uint64, cut
    [N], counters [V] uint64. A row and a chunk of tokens at a time: over [9, 49152] at once
    the hash's eight passes spill out of L2 (~4x slower)."""
    vocab = probs.shape[-1]
    size = min(_CHUNK, vocab)
    bits, scratch = np.empty(size, np.uint64), np.empty(size, np.uint64)
    hit, over = np.empty(size, bool), np.empty(size, bool)
    found = []
    for row in range(probs.shape[0]):
        floor = least[row] << np.uint64(12)  # bits >> 12 >= least  <=>  bits >= least << 12
        for start in range(0, vocab, _CHUNK):
            stop = min(start + _CHUNK, vocab)
            chunk = np.add(counters[start:stop], keys[row], out=bits[: stop - start])
            mix64_(chunk, scratch[: stop - start])
            reached = np.greater_equal(chunk, floor, out=hit[: stop - start])
            reached |= np.greater_equal(probs[row, start:stop], cut[row],
                                        out=over[: stop - start])
            found.append(np.flatnonzero(reached) + (row * vocab + start))
    return np.concatenate(found)


def invariant_sample(probs: torch.Tensor, seed: int | Sequence[int] | torch.Tensor,
                     positions: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Drafter-invariant sampling: probs [..., V] (warped; each row's sum > 0) -> tokens [...],
    argmax(log p + G) with G = position_noise(seed, positions): token x with probability
    p(x) / sum, as the Gumbel-max trick gives, and the same token for the same (seed, position,
    probs) everywhere. Plain decoding, drafters and invariant verification (`verify.rows`) all
    draw through this one function, so a speculative run's output equals a plain run's token
    for token.

    Example: probs [[.5, .5, 0]], seed 7, positions [3] -> 0 or 1 (never 2), the same every call.
    """
    tokens, ok = invariant_draw(probs, seed, positions)
    if not bool(ok.all()):
        raise ValueError("invariant_sample() needs every row to have positive mass; got a row "
                         "of zeros or NaN")
    return tokens
