"""A round's drafts against its target logits: greedy chains by their argmax, sampled chains
through one ragged call, trees row by row, each row by its own method and generator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.drafters.drafter import Draft
from verispec.params import SamplingParams
from verispec.sampling import greedy_tokens, warp
from verispec.verify.rows import RowVerification, verify_rows
from verispec.verify.trees import (
    greedy_verify_tree,
    invariant_verify_tree,
    rejection_sample_tree,
    walk_tree,
)


@dataclass(frozen=True, slots=True)
class Verified:
    """A row's verified round: the tokens it emits and how many draft tokens were accepted."""

    tokens: list[int]
    accepted: int
    drafted: int  # the draft's depth (a tree counts as a chain of its depth)


@dataclass(frozen=True, slots=True)
class RowState:
    """What a row's verification reads besides its draft and logits."""

    params: SamplingParams
    generator: torch.Generator | None  # the row's own (sampled rows)
    position: int  # the absolute position of the row's first draft token: its history length


def verify_drafts(drafts: Sequence[Draft], logits: Sequence[torch.Tensor],
                  rows: Sequence[RowState]) -> list[Verified]:
    """Verify every row's draft against its target logits [K'+1, V] (raw: sampled rows are
    warped here by their params). Greedy chains follow their argmax row by row, sampled chains
    go through one ragged call (`verify_rows`: one host sync), trees row by row; each row's
    draws come from its own generator, so they do not depend on the other rows."""
    verified: list[Verified | None] = [None] * len(drafts)
    # 1. Greedy chains, row by row: the target's argmax at each position, followed while the
    #    draft agrees (what verify_rows' greedy procedure emits, without its ragged layout: a
    #    lone greedy row spent ~0.5 ms a round on its small tensor ops, right after a pass).
    for i, draft in enumerate(drafts):
        if draft.parents is None and rows[i].params.greedy:
            verified[i] = _follow_argmax(draft, logits[i])
    # 2. Sampled chains, flattened with offsets: draft tokens [T], target rows [T + B, V].
    chains = [i for i, draft in enumerate(drafts)
              if draft.parents is None and verified[i] is None]
    if chains:
        offsets, targets, tokens, probs, settings = [0], [], [], [], []
        with_probs = any(drafts[i].probs is not None for i in chains)
        for i in chains:
            draft, row = drafts[i], rows[i]
            offsets.append(offsets[-1] + len(draft))
            tokens.append(draft.tokens)
            targets.append(warp(logits[i], row.params))
            has_probs = draft.probs is not None
            if with_probs:  # rows without (lookups) are ignored: zeros stand in
                probs.append(draft.probs if has_probs else
                             logits[i].new_zeros(len(draft), logits[i].shape[-1]))
            settings.append(RowVerification(row.params.method, row.generator, row.params.seed,
                                            row.position, has_probs))
        emitted, accepted = verify_rows(torch.cat(tokens), offsets,
                                        torch.cat(probs) if with_probs else None,
                                        torch.cat(targets), settings)
        for i, row_tokens, row_accepted in zip(chains, emitted, accepted, strict=True):
            verified[i] = Verified(row_tokens, row_accepted, len(drafts[i]))
    # 3. Trees, row by row.
    for i, draft in enumerate(drafts):
        if verified[i] is None:
            verified[i] = _verify_tree(draft, logits[i], rows[i])
    return verified


def _follow_argmax(draft: Draft, target_logits: torch.Tensor) -> Verified:
    """A greedy row's chain: target_logits [K' + 1, V]; accepted while each draft token is the
    argmax before it, then the argmax after the last accepted one."""
    if target_logits.dim() != 2 or target_logits.shape[0] != len(draft) + 1:
        raise ValueError(f"a chain of {len(draft)} tokens needs [{len(draft) + 1}, V] target "
                         f"logits, got {tuple(target_logits.shape)}")
    chain = list(range(-1, len(draft) - 1))  # each token's parent: the one before it
    tokens, path = walk_tree(draft.tokens.tolist(), chain, greedy_tokens(target_logits).tolist())
    return Verified(tokens, len(path), len(draft))


def _verify_tree(draft: Draft, target_logits: torch.Tensor, row: RowState) -> Verified:
    """One row's token tree: target_logits [K'+1, V]. Greedy rows follow the target's argmax;
    invariant rows its position-keyed draws; other sampled rows keep the multi-candidate rule
    (recursive rejection sampling over siblings)."""
    params = row.params
    if params.greedy:
        tokens, path = greedy_verify_tree(draft.tokens, draft.parents, target_logits)
    elif params.verify == "invariant":
        tokens, path = invariant_verify_tree(draft.tokens, draft.parents,
                                             warp(target_logits, params), params.seed,
                                             row.position)
    else:
        if draft.probs is None:
            raise ValueError("a sampled token tree needs the draft's probabilities")
        tokens, path = rejection_sample_tree(draft.tokens, draft.parents, draft.probs,
                                             warp(target_logits, params), row.generator)
    return Verified(tokens, len(path), draft.depth)
