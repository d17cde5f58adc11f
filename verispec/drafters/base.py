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

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def truncated(self, length: int) -> Draft:
        if length >= len(self):
            return self
        probs = None if self.probs is None else self.probs[:length]
        return Draft(self.tokens[:length], probs, self.source)


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
