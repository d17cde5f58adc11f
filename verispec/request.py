"""One request being decoded, and what it asks of the target in a round.

A `Request` carries everything that belongs to one prompt: its history (prompt + output so
far), token budget, K policy, random generator, stats, text stream, and, while it runs, the
target runner and drafter that hold its KV caches. The engine (verispec.engine) drives
requests round by round; a lone prompt is a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.drafters.drafter import Draft, Drafter
from verispec.drafters.prediction import PredictionLookup
from verispec.params import SamplingParams
from verispec.policy import KPolicy
from verispec.runtime import Runner
from verispec.stats import StatsRecorder
from verispec.text import TextStream


@dataclass(frozen=True, slots=True)
class Round:
    """What a row asks of the target this round: logits for the last num_logits of ids."""

    draft: Draft
    ids: torch.Tensor  # [L + K'] history + draft tokens
    num_logits: int  # K' + 1

    @property
    def parents(self) -> torch.Tensor | None:
        """The draft's tree links, for the target pass (None: a chain)."""
        return self.draft.parents


@dataclass(slots=True)
class Request:
    request_id: int
    prompt_ids: torch.Tensor  # [L] long, on the cpu
    params: SamplingParams
    policy: KPolicy
    generator: torch.Generator | None
    stats: StatsRecorder
    text: TextStream
    budget: int  # tokens it may still generate: max_new_tokens within the model's context
    history: torch.Tensor = field(init=False)  # [L + generated] long: prompt + output
    generated: int = 0
    finished: bool = False
    prompt_fed: int = 0  # prompt tokens in its target cache (a long prompt is fed in chunks)
    prediction: PredictionLookup | None = None  # Predicted Outputs: a lookup over it
    runner: Runner | None = None  # set while it runs: its target KV cache
    drafter: Drafter | None = None  # set while it runs, where the decoder has a drafter

    def __post_init__(self) -> None:
        self.history = self.prompt_ids
        self.finished = self.budget <= 0

    @property
    def context(self) -> int:
        return int(self.history.numel())

    def draft_budget(self, k: int) -> int:
        """Draft tokens worth asking for: a round emits at least one token of its own, so
        drafting past the budget's last token is wasted."""
        return max(0, min(k, self.budget - self.generated - 1))

    def append(self, new_tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
        """Add a verified round's tokens, cut at the budget and after EOS; return those kept."""
        new_tokens = new_tokens[: self.budget - self.generated]
        if not self.params.ignore_eos:
            for i, token in enumerate(new_tokens):
                if token in eos_ids:
                    new_tokens, self.finished = new_tokens[: i + 1], True
                    break
        self.history = torch.cat([self.history, torch.tensor(new_tokens, dtype=torch.long)])
        self.generated += len(new_tokens)
        self.finished = self.finished or self.generated >= self.budget
        return new_tokens
