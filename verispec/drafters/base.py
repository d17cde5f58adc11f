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

    def __len__(self) -> int:
        return int(self.tokens.numel())


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


def empty_draft() -> Draft:
    return Draft(torch.empty(0, dtype=torch.long), None)
