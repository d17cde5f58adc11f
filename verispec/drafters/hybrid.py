"""Prompt lookup where the context repeats itself, a draft model (or a feature draft)
everywhere else."""

from __future__ import annotations

import torch

from verispec.drafters.drafter import (
    Draft,
    cache_bytes,
    catch_up,
    copy_state,
    follow_target,
    limit_growth,
    position_bytes,
    unread,
)
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.params import SamplingParams


class HybridDrafter:
    """Propose what followed the last occurrence of the current n-gram when an n-gram of at
    least `min_match` tokens recurs (copying from the prompt: summaries, extraction, code
    edits), in the request's own text or in earlier requests' (`SuffixDrafter`), and the draft
    model's tokens otherwise. The draft model may be a feature draft: it
    reads the target's features of every position it skipped when it drafts next.

    Each proposal keeps its own kind (Draft.source: the n-gram length, or 0 for the model), so
    the adaptive K policy learns separate acceptance rates for them. A lookup draft is
    deterministic (no probabilities), a model draft carries its q: verification is exact for
    either, round by round.
    """

    name = "hybrid"

    def __init__(self, model: ModelDrafter | FeatureDrafter, min_match: int = 2,
                 max_ngram: int = 5, lookup: SuffixDrafter | None = None) -> None:
        """lookup: the lookup to share (a fork's: one cache of earlier requests for all the
        process's rows); None: a new one."""
        self.model = model
        self.lookup = lookup or SuffixDrafter(max_match=max_ngram, min_match=min_match)

    def follow(self, runner) -> None:
        """Tie a feature draft to the target runner of this sequence (nothing for a model)."""
        follow_target(self.model, runner)

    def catch_up(self, prefix_ids: torch.Tensor) -> None:
        """The draft model reads the prompt so far (the lookup keeps no state)."""
        catch_up(self.model, prefix_ids)

    def unread(self, history: torch.Tensor) -> int:
        """What the draft model has not read of history [L] (verispec.drafters.drafter.unread)."""
        return unread(self.model, history)

    def reset(self) -> None:
        self.model.reset()

    def copy_state(self, source: HybridDrafter, length: int) -> bool:
        """The draft model's cached prefix from another hybrid's (the lookup keeps no state)."""
        return isinstance(source, HybridDrafter) and copy_state(self.model, source.model, length)

    def cache_bytes(self) -> int:
        """The draft model's cache (the lookup's text is bounded on its own)."""
        return cache_bytes(self.model)

    def bytes_per_position(self) -> int:
        return position_bytes(self.model)

    def limit_growth(self, positions: int | None) -> None:
        limit_growth(self.model, positions)

    def fork(self) -> HybridDrafter:
        return HybridDrafter(self.model.fork(), lookup=self.lookup.fork())

    def retire(self, history: torch.Tensor, params: SamplingParams) -> None:
        """A request leaves: its lookup's cache of earlier requests takes its text in."""
        self.lookup.retire(history, params)

    def propose(
        self,
        history: torch.Tensor,  # [L] long
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        draft = self.lookup.propose(history, k, params, generator)
        if len(draft):
            return draft
        return self.model.propose(history, k, params, generator)


def tree_width_of(drafter, params: SamplingParams) -> int:
    """How wide the token trees are that a drafter proposes for rows with these params (1:
    chains)."""
    if isinstance(drafter, HybridDrafter):
        drafter = drafter.model
    return drafter.width_for(params) if isinstance(drafter, FeatureDrafter) else 1
