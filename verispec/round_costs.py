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

It corrects feature drafts' c only (`corrects_draft`): their head (a layer and an 8k-token
head, 18 MB) stays in cache through a tight loop of its own steps and is evicted by the
target's pass in rounds. A draft model streams its weights from memory either way (the 0.5B's
250 MB), and its correction, which also charged it for catching up in short passes, cost the
Qwen2.5-Coder pair 2-4% on code prompts (the same process, alternating).

Beside the prices, it keeps what whole rounds (plan, draft, pass, verification) gave: tokens
a second of plain rounds (one position verified, no draft model asked) and of rounds the draft
model proposed in (its proposal kept or cut), each a running sum that forgets its older
rounds (`record_round`). A draft model whose rounds give fewer tokens a second than plain
rounds drafts at a loss whatever the prices say, and sits rounds out (`holds_back`), all but
one in `probe_every`, which learn its rate again as the text changes. Its rate is judged on
each row's own drafting rounds (`new_row`); the plain rate carries over. On AMD Zen 4 the
embedded SmolLM2's feature draft, priced at c 0.13-0.15 and v(2) 1.00, took 1.8 ms of
drafting and a pass 1.17 times a plain one in its rounds: 6.4 ms a token against plain
decoding's 5.9; priced by its proposals and held back, it went from 0.92x to 0.95x plain
(the same process, alternating), the default beside lookups from 1.15x to 1.16x; the
Qwen2.5-Coder pair's default, whose draft model pays, stayed within 2%. Lookups are not held
back: their rounds cost what their pass costs, which the prices already see, and holding them
back cost n-gram lookup 2% there.

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
class RoundYield:
    """Tokens and seconds of one kind of round, each round keeping `decay` of the sums before
    it (the recent rounds count most), and how many rounds there were."""

    rounds: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, seconds: float, tokens: int, decay: float) -> None:
        self.rounds += 1
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds


@dataclass(slots=True)
class ObservedCosts:
    """What a lone greedy row's rounds took, against its measured cost model (`record`), and
    that model corrected by it (`corrected`). One for a decoder's cost table: every engine of
    the decoder learns into it and prices by it."""

    window: int = 31  # rounds of each kind kept (the latest)
    min_rounds: int = 8  # plain rounds before a proposal is priced, and proposals before c is
    corrects_draft: bool = True  # whether `corrected` scales c (feature drafts: cost_table)
    decay: float = 0.95  # the weight a running rate keeps of its earlier rounds
    probe_every: int = 16  # a draft model held back still drafts in one of this many rounds
    step_s: deque = field(init=False)  # seconds of plain rounds
    drafts: deque = field(init=False)  # observed / priced draft proposals
    plain: RoundYield = field(init=False)  # what plain rounds gave
    drafting: RoundYield = field(init=False)  # what rounds the draft model proposed in gave
    waited: int = field(init=False)  # rounds the draft model sat out since it last drafted

    def __post_init__(self) -> None:
        if not 1 <= self.min_rounds <= self.window:
            raise ValueError(f"min_rounds must be in [1, window], got {self.min_rounds} "
                             f"(window {self.window})")
        if not 0.0 < self.decay < 1.0 or self.probe_every < 1:
            raise ValueError(f"decay must be in (0, 1) and probe_every >= 1, got {self.decay}, "
                             f"{self.probe_every}")
        self.step_s, self.drafts = deque(maxlen=self.window), deque(maxlen=self.window)
        self.plain, self.drafting, self.waited = RoundYield(), RoundYield(), 0

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
        if self.corrects_draft and len(self.drafts) >= self.min_rounds:
            ratio = median(self.drafts)
            long_draft = prices.long_draft_step
            prices = dataclasses.replace(
                prices, draft_step=prices.draft_step * ratio,
                long_draft_step=None if long_draft is None else long_draft * ratio)
        return prices

    def record_round(self, drafted: bool, seconds: float, tokens: int) -> None:
        """A lone greedy row's whole round (plan to verification) took `seconds` and gave
        `tokens`; drafted: its draft model proposed (else the round was plain)."""
        if seconds <= 0.0 or tokens < 1:
            raise ValueError(f"a round takes a time > 0 and gives a token, got {seconds}, "
                             f"{tokens}")
        (self.drafting if drafted else self.plain).add(seconds, tokens, self.decay)

    def rate(self, drafted: bool) -> float | None:
        """Tokens a second of recent draft-model (or plain) rounds, once there are min_rounds
        of them; else None."""
        sums = self.drafting if drafted else self.plain
        return None if sums.rounds < self.min_rounds else sums.tokens / sums.seconds

    def at_a_loss(self) -> bool:
        """Whether the draft model's rounds have given fewer tokens a second than plain ones."""
        plain, drafting = self.rate(False), self.rate(True)
        return plain is not None and drafting is not None and drafting < plain

    def new_row(self) -> None:
        """A lone row other than the last one planned alone: its draft model's rounds are
        judged on its own text (a row that comes back alone after sharing rounds with others
        keeps its record, unless another row ran alone in between). What plain rounds give is
        the machine's and carries over; what drafting rounds give is the text's. Judged by the
        rounds of the request before, the Qwen2.5-Coder pair's 0.5B, slower than plain rounds
        on one code prompt (acceptance 0.59), sat out the next prompts from their first round,
        fell behind by what they wrote, and never drafted in them (acceptance 0.85-0.9 where it
        drafts): eight code prompts ran at 1.12x plain against the draft model alone's 1.31x.
        A feature draft's rounds cost more than its prices say on any text (`corrects_draft`):
        its rate carries over (judged afresh on each request, the embedded SmolLM2's default
        ran 2-4% slower)."""
        if not self.corrects_draft:
            self.drafting, self.waited = RoundYield(), 0

    def holds_back(self) -> bool:
        """Asked once a round the planner would have the draft model draft: whether it sits
        this one out (at a loss, and not its turn to probe)."""
        if not self.at_a_loss():
            self.waited = 0
            return False
        self.waited += 1
        if self.waited >= self.probe_every:
            self.waited = 0
            return False
        return True
