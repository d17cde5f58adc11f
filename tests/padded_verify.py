"""The padded one-call verification functions ([B, K] drafts, [B, K+1, V] targets), kept as
the tests' reference: each runs `verispec.verify.chains` on a padded batch the way a caller
would, so `verify_rows` (the ragged form the engine calls) can be checked against it row by
row, and the procedures' laws checked in the layout the papers state them in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.sampling import greedy_tokens
from verispec.verify.chains import (
    follow,
    invariant_choice,
    is_int,
    procedure,
    uniforms,
    verify_chains,
)


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] float, or None for a deterministic draft
    target_probs: torch.Tensor,  # [B, K+1, V] float
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-wise verification (verify.chains.token_wise) of a padded batch. Returns (tokens
    [B, K+1] long padded with -1, num_accepted [B])."""
    batch_size, num_draft = draft_tokens.shape
    coins, next_uniform = uniforms(batch_size, num_draft, generator, target_probs.device)
    tokens, num_accepted, ok = verify_chains(
        "token", draft_tokens, draft_lengths(batch_size, num_draft, None, draft_tokens), coins,
        next_uniform, *_flat(draft_probs, target_probs))
    check_mass(ok)
    return tokens, num_accepted


def _flat(draft_probs, target_probs):
    """[B, K, V] and [B, K+1, V] as rows and row indices (target, target_at, draft, draft_at),
    as verify_chains reads them."""
    batch_size, positions, vocab = target_probs.shape
    device = target_probs.device
    target_at = torch.arange(batch_size * positions, device=device).view(batch_size, positions)
    if draft_probs is None:
        return target_probs.reshape(-1, vocab), target_at, None, None
    draft_at = torch.arange(batch_size * (positions - 1), device=device)
    return (target_probs.reshape(-1, vocab), target_at, draft_probs.reshape(-1, vocab),
            draft_at.view(batch_size, positions - 1))


def block_verify(
    draft_tokens: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] float, or None for a deterministic draft
    target_probs: torch.Tensor,  # [B, K+1, V] float
    generator: torch.Generator | None = None,
    num_draft: Sequence[int] | torch.Tensor | None = None,  # [B]: real draft tokens per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (verify.chains.block; one draft token: token-wise, as
    `procedure` says). Returns, as rejection_sample, (tokens [B, K+1] long padded with -1,
    num_accepted [B]). num_draft: row b's tokens past num_draft[b] are padding (any values);
    its bonus distribution is then target_probs[b, num_draft[b]]. Random draws:
    torch.rand((B, K)) for the coins, then one float64 uniform [B, 1] for the next token, from
    `generator`: a row verified alone draws what it draws in `verify_rows`."""
    batch_size, num_positions = draft_tokens.shape
    coins, next_uniform = uniforms(batch_size, num_positions, generator, target_probs.device)
    tokens, num_accepted, ok = verify_chains(
        procedure("block", num_positions), draft_tokens,
        draft_lengths(batch_size, num_positions, num_draft, draft_tokens), coins, next_uniform,
        *_flat(draft_probs, target_probs))
    check_mass(ok)
    return tokens, num_accepted


def greedy_verify(
    draft_tokens: torch.Tensor,  # [B, K] long
    target_logits: torch.Tensor,  # [B, K+1, V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy counterpart: accept while the draft equals the target's argmax.

    Returns (tokens [B, K+1] padded with -1, num_accepted [B]); the emitted tokens are exactly
    the target's argmax at positions 0..num_accepted, so the output is plain greedy decoding.

    Example: draft [[5, 7, 9]], target argmax [[5, 7, 2, 4]] -> tokens [[5, 7, 2, -1]], 2 accepted.
    """
    target_choice = greedy_tokens(target_logits)  # [B, K+1]
    batch_size, num_draft = draft_tokens.shape
    return follow(draft_tokens, target_choice, draft_lengths(batch_size, num_draft, None,
                                                         draft_tokens))


def invariant_verify(
    draft_tokens: torch.Tensor,  # [B, K] long
    target_probs: torch.Tensor,  # [B, K+1, V] float, warped
    seed: int | Sequence[int] | torch.Tensor,  # per request, or one for all rows
    start_position: int | Sequence[int] | torch.Tensor,  # [B]: absolute position of token 1
    num_draft: Sequence[int] | torch.Tensor | None = None,  # [B]: real draft tokens per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter-invariant verification: the target draws its own token at every position,
    `invariant_sample(target_probs[:, i], seed, start_position + i)`; a draft token is accepted
    exactly when it equals that draw; the draw at the first mismatch is the correction, and
    after K accepted tokens the draw at position start + K is the bonus. Returns, as
    rejection_sample, (tokens [B, K+1] padded with -1, num_accepted [B]).

    The emitted tokens are the target's draws along its own path, so they are exactly the
    tokens plain invariant sampling gives for this seed, whatever was drafted; no random state
    is consumed. A drafter maximises agreement by drawing its tokens with the same noise,
    `invariant_sample(draft_probs, seed, positions)` at the same absolute positions (the
    Gumbel coupling: agreement at least (1 - TV) / (1 + TV)); correctness does not depend on it.
    start_position is the row's history length (prompt + output so far).

    Example: target draws [5, 7, 2, 4] at positions 10..13, draft [5, 7, 9] -> tokens
    [5, 7, 2, -1], 2 accepted; the same call with any other draft gives a prefix of 5, 7, 2, 4.
    """
    batch_size, num_positions = draft_tokens.shape
    lengths = draft_lengths(batch_size, num_positions, num_draft, draft_tokens)
    choice, ok = invariant_choice(target_probs, seed, start_position)
    tokens, num_accepted = follow(draft_tokens, choice, lengths)
    check_mass(ok | (torch.arange(num_positions + 1, device=ok.device) > lengths[:, None]))
    return tokens, num_accepted


def draft_lengths(batch_size: int, num_positions: int, num_draft, draft_tokens) -> torch.Tensor:
    """num_draft [B] long on draft_tokens' device: K for every row when None."""
    device = draft_tokens.device
    if num_draft is None:
        return torch.full((batch_size,), num_positions, dtype=torch.long, device=device)
    values = num_draft.tolist() if isinstance(num_draft, torch.Tensor) else list(num_draft)
    if len(values) != batch_size or not all(is_int(v) and 0 <= v <= num_positions
                                            for v in values):
        raise ValueError(f"num_draft must be {batch_size} integers in [0, {num_positions}], "
                         f"got {values}")
    return torch.tensor(values, dtype=torch.long, device=device)


def check_mass(ok: torch.Tensor) -> None:
    if not bool(ok.all()):  # as torch.multinomial, refuse rather than draw past V
        raise ValueError("verification needs every distribution it draws from to have positive "
                         "mass; got a row of zeros or NaN")
