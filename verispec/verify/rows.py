"""Ragged batches: every row of a round's chains verified in one call, each by its own method,
with one host sync (as vLLM's rejection sampler takes offsets instead of padding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.sampling import greedy_tokens
from verispec.verify.chains import (
    PAD_TOKEN,
    follow,
    invariant_choice,
    is_int,
    procedure,
    uniforms,
    verify_chains,
)

METHODS = ("greedy", "token", "block", "invariant")


@dataclass(frozen=True, slots=True)
class RowVerification:
    """How one row of a ragged batch is verified, and the state its draws come from.

    method "greedy": argmax matching (no draws); "token": token-wise, "block": block
    verification (verify.chains; both draw from `generator`, the row's own: its uniforms in
    the shapes a batch of one draws them); "invariant": the target's own draws keyed by `seed`
    and the absolute position (`start_position`: that of the row's first draft token, its
    history length), a draft token accepted when it equals the draw. draft_has_probs=False:
    the row's draft is deterministic (n-gram lookup; q a point mass), its rows of draft_probs
    are ignored.
    """

    method: str
    generator: torch.Generator | None = None
    seed: int | None = None
    start_position: int = 0
    draft_has_probs: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "invariant" and not is_int(self.seed):
            raise ValueError(f"invariant verification needs an integer seed, got {self.seed!r}")
        if not is_int(self.start_position) or self.start_position < 0:
            raise ValueError(f"start_position must be an integer >= 0, got "
                             f"{self.start_position!r}")


def verify_rows(
    draft_tokens: torch.Tensor,  # [T] long: row b's draft is draft_tokens[cu[b]:cu[b+1]]
    cu_num_draft: Sequence[int] | torch.Tensor,  # [B+1] offsets, on the host: cu[0] = 0, cu[B] = T
    draft_probs: torch.Tensor | None,  # [T, V] float, or None: every row deterministic
    target_probs: torch.Tensor,  # [T+B, V]: row b's K_b + 1 rows at cu[b] + b ... cu[b+1] + b
    rows: Sequence[RowVerification],  # [B]
) -> tuple[list[list[int]], list[int]]:
    """Verify a ragged batch, each row by its own method, with one host sync (at the end).
    Returns (each row's emitted tokens: accepted + recovered or bonus; each row's number of
    accepted draft tokens). Row b's result is what it gets in a batch of one, token for token,
    whatever else is in the batch: its uniforms are drawn from its own generator (coins
    [1, K_b], then the next token's [1, 1]), and its procedure sees only its own rows.

    target_probs holds warped probabilities for sampled rows; a greedy row's rows are only
    argmaxed, so they may hold its logits. Trees are verified one row at a time
    (rejection_sample_tree, greedy_verify_tree, invariant_verify_tree).

    Example: cu [0, 2, 2], rows (block, greedy): row 0 has 2 draft tokens and target rows 0..2,
    row 1 none and target row 3 (its plain step).
    """
    offsets = cu_num_draft.tolist() if isinstance(cu_num_draft, torch.Tensor) else list(
        cu_num_draft)
    lengths = _check_ragged(draft_tokens, offsets, draft_probs, target_probs, rows)
    batch_size, device = len(rows), target_probs.device
    longest = max(lengths, default=0)
    # 1. Each row's uniforms, in row order, in the shapes a batch of one draws them.
    draws = {b: uniforms(1, lengths[b], row.generator, device)
                for b, row in enumerate(rows) if row.method in ("token", "block")}
    # 2. Rows grouped by procedure, each group in a padded layout [G, K_g].
    groups: dict[tuple[str, bool], list[int]] = {}
    for b, row in enumerate(rows):
        groups.setdefault((procedure(row.method, lengths[b]),
                           row.draft_has_probs and draft_probs is not None),
                          []).append(b)
    tokens_out = torch.full((batch_size, longest + 1), PAD_TOKEN, dtype=torch.long, device=device)
    accepted_out = torch.zeros(batch_size, dtype=torch.long, device=device)
    ok_out = torch.ones(batch_size, dtype=torch.bool, device=device)
    for (method, has_probs), members in groups.items():
        group_k = max(lengths[b] for b in members)
        num_draft = torch.tensor([lengths[b] for b in members], device=device)
        if method in ("token", "block"):  # read in place: no gathered copies of the rows
            draft_at, target_at = _positions(offsets, lengths, members, group_k, device)
            coins = torch.cat([torch.cat([draws[b][0], draws[b][0].new_zeros(
                1, group_k - lengths[b])], dim=1) for b in members])  # [G, K_g]
            next_uniform = torch.cat([draws[b][1] for b in members])  # [G, 1]
            out, accepted, ok = verify_chains(method, draft_tokens[draft_at], num_draft, coins,
                                        next_uniform, target_probs, target_at,
                                        draft_probs if has_probs else None, draft_at)
            at = torch.tensor(members, device=device)
            tokens_out[at, : group_k + 1] = out
            accepted_out[at], ok_out[at] = accepted, ok
            continue
        tokens, probs, targets = _padded(draft_tokens, draft_probs if has_probs else None,
                                         target_probs, offsets, lengths, members, group_k)
        if method == "greedy":
            out, accepted = follow(tokens, greedy_tokens(targets), num_draft)
            ok = torch.ones_like(num_draft, dtype=torch.bool)
        elif method == "invariant":
            choice, ok_at = invariant_choice(targets, [rows[b].seed for b in members],
                                              [rows[b].start_position for b in members])
            out, accepted = follow(tokens, choice, num_draft)
            beyond = torch.arange(group_k + 1, device=device) > num_draft[:, None]
            ok = (ok_at | beyond).all(dim=-1)
        at = torch.tensor(members, device=device)
        tokens_out[at, : group_k + 1] = out
        accepted_out[at], ok_out[at] = accepted, ok
    # 3. The one host sync.
    table = torch.cat([tokens_out, accepted_out[:, None], ok_out[:, None].long()], dim=1).tolist()
    if not all(row[-1] for row in table):
        bad = [b for b, row in enumerate(table) if not row[-1]]
        raise ValueError(f"verify_rows() needs positive target mass; rows {bad} have a row of "
                         "zeros or NaN")
    return [row[: row[-2] + 1] for row in table], [row[-2] for row in table]


def _check_ragged(draft_tokens, offsets, draft_probs, target_probs, rows) -> list[int]:
    """Each row's draft length, after checking that the ragged layout is consistent."""
    total = int(draft_tokens.shape[0]) if draft_tokens.dim() == 1 else -1
    if total < 0:
        raise ValueError(f"draft_tokens must be [T], got shape {tuple(draft_tokens.shape)}")
    if len(offsets) != len(rows) + 1 or offsets[0] != 0 or offsets[-1] != total or any(
            b < a for a, b in zip(offsets[:-1], offsets[1:], strict=True)):
        raise ValueError(f"cu_num_draft must rise from 0 to T = {total} over B + 1 = "
                         f"{len(rows) + 1} entries, got {offsets}")
    if target_probs.dim() != 2 or target_probs.shape[0] != total + len(rows):
        raise ValueError(f"target_probs must be [T + B, V] = [{total + len(rows)}, V], got "
                         f"{tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (total, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [T, V] = [{total}, {target_probs.shape[1]}], "
                         f"got {tuple(draft_probs.shape)}")
    return [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def _padded(draft_tokens, draft_probs, target_probs, offsets, lengths, members, group_k):
    """A group's rows as [G, K_g] tokens, [G, K_g, V] draft and [G, K_g + 1, V] target
    tensors: views when the group is the whole batch at one K, else gathered copies (slots
    past a row's length repeat its last draft row and its bonus row; they are masked)."""
    batch_size, vocab = len(lengths), target_probs.shape[1]
    if len(members) == batch_size and len(set(lengths)) == 1:
        tokens = draft_tokens.reshape(batch_size, group_k)
        probs = None if draft_probs is None else draft_probs.reshape(batch_size, group_k, vocab)
        return tokens, probs, target_probs.reshape(batch_size, group_k + 1, vocab)
    draft_at, target_at = _positions(offsets, lengths, members, group_k, target_probs.device)
    probs = None if draft_probs is None else draft_probs[draft_at]
    return draft_tokens[draft_at], probs, target_probs[target_at]


def _positions(offsets, lengths, members, group_k, device):
    """A group's rows of the ragged layout: draft_at [G, K_g] (indices into draft_tokens and
    draft_probs) and target_at [G, K_g + 1] (into target_probs); slots past a row's length
    repeat its last draft row and its bonus row (they are masked)."""
    last = max(offsets[-1] - 1, 0)
    draft_at = torch.tensor([[min(offsets[b] + min(i, max(lengths[b] - 1, 0)), last)
                              for i in range(group_k)] for b in members],
                            dtype=torch.long).reshape(len(members), group_k)
    target_at = torch.tensor([[offsets[b] + b + min(i, lengths[b]) for i in range(group_k + 1)]
                              for b in members], dtype=torch.long)
    return draft_at.to(device), target_at.to(device)
