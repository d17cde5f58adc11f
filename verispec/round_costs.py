"""What rounds really cost: the cost model's prices corrected by the rounds' own timings.

A cost model (verispec.costs) is the fastest of a few timings of each pass and draft step in
a tight loop. A draft inside decoding costs more than that: it reads what the target wrote since
its last proposal, its caches are cold after the target's pass, and its proposal goes through
the round's bookkeeping. On an Intel Xeon (AMX, 2 cores) the embedded SmolLM2's feature draft
took 0.40-0.55 target steps a proposal in its rounds where its cost model said 0.26, so K = 1,
priced at 1.1x plain, ran at 0.9x; priced by what its rounds took it is not drafted, and the
feature draft alone went from 0.89x to 0.96x plain (the same process, alternating).

`ObservedCosts` keeps the last rounds a lone greedy row ran, and corrects the measured model's
draft step c by the median of what the draft model's proposals took against what it said they
would take:

    step     seconds of a plain round (one position, nothing drafted): the unit
    drafts   a draft model's proposal of depth d: seconds / step, against d * c and the
             catching up on what lookups wrote since its last (`CostModel.catch_up`)

It corrects feature drafts only: their head (a layer and an 8k-token head, 18 MB) stays in
cache through a tight loop of its own steps and is evicted by the target's pass in rounds. A
draft model streams its weights from memory either way (the 0.5B's 250 MB), and its correction,
which also charged it for catching up in short passes, cost the Qwen2.5-Coder pair 2-4% on code
prompts (the same process, alternating).

Medians, so that a round spoilt by a burst of machine noise (a page fault, another process)
moves nothing. The passes are left as measured: what a pass over n positions took in the
rounds beyond v(n) was a few hundredths of a step in SmolLM2's, and adding it priced n-gram
lookups 2-3% slower. Only greedy rows are priced by it: their output is the same at any K,
while a seeded sampled row's draws depend on its K, which must not depend on how long the
rounds before it took.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from verispec.costs import CostModel


@dataclass(slots=True)
class ObservedCosts:
    """What a lone greedy row's rounds took, against its measured cost model (`record`), and
    that model corrected by it (`corrected`). One for a decoder's cost table: every engine of
    the decoder learns into it and prices by it."""

    window: int = 31  # rounds of each kind kept (the latest)
    min_rounds: int = 8  # plain rounds before a proposal is priced, and proposals before c is
    step_s: deque = field(init=False)  # seconds of plain rounds
    drafts: deque = field(init=False)  # observed / priced draft proposals

    def __post_init__(self) -> None:
        if not 1 <= self.min_rounds <= self.window:
            raise ValueError(f"min_rounds must be in [1, window], got {self.min_rounds} "
                             f"(window {self.window})")
        self.step_s, self.drafts = deque(maxlen=self.window), deque(maxlen=self.window)

    def record(self, measured: CostModel, positions: int, pass_s: float, draft_depth: int = 0,
               draft_s: float = 0.0, lag: int = 1) -> None:
        """One round of a lone row: its target pass over `positions` positions took pass_s
        seconds, and its draft model's proposal of `draft_depth` tokens draft_s (0: the draft
        model did not propose), `lag` tokens behind its row when it began (the one a draft
        step reads, and what lookups wrote meanwhile, priced by the model's catch-up rate).
        measured: the measured model at the row's context, as the round was priced before any
        correction."""
        if positions < 1 or pass_s <= 0.0:
            raise ValueError(f"a round has positions >= 1 and a time > 0, got {positions}, "
                             f"{pass_s}")
        if positions == 1 and draft_depth == 0:
            self.step_s.append(pass_s)  # a plain round: the unit
            return
        if len(self.step_s) < self.min_rounds:
            return
        if draft_depth > 0 and draft_s > 0.0 and measured.draft_step > 0.0:
            priced = draft_depth * measured.draft_step + measured.catch_up(max(0, lag - 1))
            self.drafts.append(draft_s / median(self.step_s) / priced)

    def corrected(self, measured: CostModel) -> CostModel:
        """`measured` with c scaled by the median ratio of what the draft model's proposals
        took to what it priced them at, once it has min_rounds of them."""
        prices = measured
        if len(self.drafts) >= self.min_rounds:
            ratio = median(self.drafts)
            long_draft = prices.long_draft_step
            prices = dataclasses.replace(
                prices, draft_step=prices.draft_step * ratio,
                long_draft_step=None if long_draft is None else long_draft * ratio)
        return prices

