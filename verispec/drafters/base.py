"""The drafter protocol and what a drafter returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: torch.Tensor  # [k'] long, k' <= k (a drafter may propose fewer, even none)
    probs: torch.Tensor | None  # [k', V] the warped draft distribution, or None if deterministic
    # What kind of proposal this is, for acceptance statistics kept per kind (n-gram drafts: the
    # length of the matched n-gram, since longer matches are accepted far more often).
    source: int = 0
    # A token tree instead of a chain: [k'] long, each token's parent among the tokens before
    # it, -1 for a child of the history's last token; tokens in order of depth. Greedy only.
    parents: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def depths(self) -> list[int]:
        """Each token's depth: 1 for the history's next token (a chain: 1, 2, ..., k')."""
        if self.parents is None:
            return list(range(1, len(self) + 1))
        depths: list[int] = []
        for parent in self.parents.tolist():
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def truncated(self, depth: int) -> Draft:
        """The tokens up to this depth (a chain's first `depth` tokens)."""
        if depth >= self.depth:
            return self
        length = sum(1 for d in self.depths if d <= depth)
        probs = None if self.probs is None else self.probs[:length]
        parents = None if self.parents is None else self.parents[:length]
        return Draft(self.tokens[:length], probs, self.source, parents)


class Drafter(Protocol):
    name: str

    def propose(
        self,
        history: torch.Tensor,  # [L] long: prompt + output so far
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft: ...

    def reset(self) -> None:
        """Forget cached state (a draft model's KV cache); the next proposal starts cold."""
        ...

    def fork(self) -> Drafter:
        """A drafter for another sequence decoded at the same time (batches): shares the
        weights, keeps its own state."""
        ...


def empty_draft() -> Draft:
    return Draft(torch.empty(0, dtype=torch.long), None)


def follow_target(drafter: Drafter | None, runner) -> None:
    """Tie a drafter that reads the target's hidden states (one with `follow`, as
    FeatureDrafter) to the target runner of its sequence; other drafters need nothing."""
    follow = getattr(drafter, "follow", None)
    if follow is not None:
        follow(runner)
