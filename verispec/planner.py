"""The round planner: how much every row of a round drafts and verifies.

One plan a round, for the whole batch (a lone prompt is a batch of one):
  prices     the batch's cost model at its rows' mean length (`decoder.batch_costs`), and each
             row's share of it for its own extra positions (`CostModel.row_share`); a lone
             greedy row's corrected by what its rounds have taken (verispec.round_costs), its
             draft model held back where its rounds lose to plain ones;
  K          a row alone: its policy's best K at its prices; a batch: one K for all rows
             (`theory.batch_optimal_k`), 0 where the bigger pass stops paying;
  lookups    asked for up to k_max tokens (they cost nothing to propose), then cut by kind;
  trees      their width (greedy rows draft trees only in small batches), then pruned to the
             tokens that pay (`KPolicy.tree_size`);
  the batch  every row's chain cut at the whole batch's prices (`theory.batch_allocation`).
Policies are read and asked, never re-priced: the planner hands each its prices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verispec.config import MAX_TREE_NODES, DecodeConfig
from verispec.costs import CostModel
from verispec.drafters.drafter import ChainCut, Draft, empty_draft, unread
from verispec.drafters.hybrid import HybridDrafter, tree_width_of
from verispec.policy import AdaptiveK, KPolicy
from verispec.request import Request
from verispec.round_costs import ObservedCosts
from verispec.theory import batch_allocation, batch_optimal_k

# What a draft model has left to read after a round of its own: the target's next token, and
# its own last draft token where all of them were accepted.
CAUGHT_UP = 2
# A row's first round leaves its draft model out where that would read more than this many
# tokens first (a prompt it has not seen): the first token comes after the prompt pass alone,
# and the draft model catches up from the next round, where that pays.
FIRST_ROUND_READ = 32


@dataclass(frozen=True, slots=True)
class RowPlan:
    k: int  # draft-model tokens to ask for (0: the draft model does not run for this row)
    free_k: int  # lookup tokens to ask for
    width: int  # the width of the trees its draft model proposes (1: chains)
    prices: CostModel | None  # its share of the pass at the batch's context; None: unpriced
    cut: ChainCut | None = None  # where its greedy draft-model chain may stop early


@dataclass(frozen=True, slots=True)
class RoundPlan:
    rows: tuple[RowPlan, ...]
    greedy_trees: bool  # whether greedy rows draft token trees this round
    batch_prices: CostModel | None  # the whole batch's, for the batch-wide cut
    # a lone greedy row's measured model at its context, before any correction by rounds:
    # what its round's times are recorded against (`RoundPlanner.observe`); None: not recorded
    measured: CostModel | None = None


def tree_room(request: Request) -> int:
    """The tree nodes the row's cache has room for: its pass writes the last token and each
    node in a slot of its own, within the context (a chain's depth is held by the budget)."""
    runner = request.runner
    return MAX_TREE_NODES if runner is None else runner.max_positions - request.context


def fitted(draft: Draft, room: int) -> Draft:
    """A token tree cut to at most `room` nodes: its likeliest ones where it has scores (a
    greedy tree), else none (a sampled tree's shape is fixed before its draws; dropping it
    whole depends on its size alone). Chains are returned as they are."""
    if draft.parents is None or len(draft) <= room:
        return draft
    count = room
    while draft.scores is not None and count > 0:
        smaller = draft.pruned(count)
        if len(smaller) <= room:
            return smaller
        count -= 1  # ancestors tied on score came along: ask for fewer
    return empty_draft()


class RoundPlanner:
    def __init__(self, drafter, config: DecodeConfig,
                 batch_costs: Callable[[int], CostModel],
                 observed: ObservedCosts | None = None) -> None:
        """drafter: the decoder's (None: plain decoding); batch_costs(n): the cost model of a
        batch of n rows, measured or estimated (never measured while a round waits);
        observed: what lone greedy rows' rounds have taken against it (None: prices are the
        models as measured)."""
        self.drafter, self.config, self.batch_costs = drafter, config, batch_costs
        self.observed = observed
        self._row: KPolicy | None = None  # the policy of the row last planned alone

    def plan(self, requests: Sequence[Request]) -> RoundPlan:
        rows = len(requests)
        greedy_trees = rows <= self.config.tree_max_batch
        if not rows or (self.drafter is None and
                        all(r.prediction is None for r in requests)):
            return RoundPlan(tuple(RowPlan(0, 0, 1, None) for _ in requests), greedy_trees, None)
        widths = [tree_width_of(self.drafter, r.params) if greedy_trees or not r.params.greedy
                  else 1 for r in requests]
        batch_prices = row_prices = measured = None
        if all(isinstance(r.policy, AdaptiveK) for r in requests):
            context = sum(r.context for r in requests) // rows
            batch_prices = self.batch_costs(rows).at(context)
            if rows == 1 and requests[0].params.greedy and self.observed is not None:
                measured, batch_prices = batch_prices, self.observed.corrected(batch_prices)
            row_prices = batch_prices.row_share(rows)
        # 1. K: a row alone takes its own best; a batch shares one (a tree's depth where rows
        #    draft trees, priced as the widest row's policy prices its trees).
        if batch_prices is None or rows == 1:
            ks = [r.policy.next_k(row_prices, width)
                  for r, width in zip(requests, widths, strict=True)]
        else:
            ks = [self._batch_k(requests, widths, batch_prices)] * rows
        #    A draft model far behind its row (a long prompt, or what a lookup or prediction
        #    added while it waited) drafts only where what it saves pays for catching up.
        #    A batch's rows catch up together, priced at the batch's prices.
        if row_prices is not None:
            alone = row_prices if rows == 1 else None
            ks = [k if k == 0 or self.catch_up_pays(r, unread(r.drafter, r.history), alone,
                                                    rows)
                  else 0 for r, k in zip(requests, ks, strict=True)]
        #    Nor before a row's first token (FIRST_ROUND_READ).
        ks = [0 if k and r.generated == 0 and unread(r.drafter, r.history) > FIRST_ROUND_READ
              else k for r, k in zip(requests, ks, strict=True)]
        # 2. Lookups: as many as a lookup may propose; keep() cuts them by kind.
        free_ks = [r.policy.next_k(row_prices, width, free=True)
                   for r, width in zip(requests, widths, strict=True)]
        #    A lone greedy row's draft model whose rounds on this row have given fewer tokens a
        #    second than plain rounds sits the round out (but for its probes).
        if measured is not None and requests[0].policy is not self._row:
            self._row = requests[0].policy
            self.observed.new_row()
        if measured is not None and ks[0] and self.observed.holds_back():
            ks = [0]
        # 3. A greedy chain stops early where the drafter's own confidence no longer pays at
        #    the row's prices.
        cut = None if row_prices is None else ChainCut(row_prices.draft_step,
                                                       row_prices.verify)
        plans = tuple(RowPlan(r.draft_budget(k), r.draft_budget(free_k), width, row_prices,
                              cut if r.params.greedy and width == 1 else None)
                      for r, k, free_k, width in zip(requests, ks, free_ks, widths, strict=True))
        return RoundPlan(plans, greedy_trees, batch_prices, measured)

    def observe(self, plan: RoundPlan, positions: int, pass_s: float, draft_depth: int,
                draft_s: float, lag: int, round_s: float, tokens: int) -> None:
        """A lone greedy row's round took pass_s seconds for its target pass over `positions`
        positions and draft_s for its draft model's proposal of draft_depth tokens (0: none),
        `lag` tokens behind the row: recorded against the model it was priced by
        (`ObservedCosts.record`). The whole round took round_s and gave `tokens`: recorded
        where the draft model proposed (kept or cut) with no more to read than a round leaves
        it, or nothing was verified but the next token (`ObservedCosts.record_round`). A
        round that caught the draft model up on a prompt, or on what lookups wrote, is not
        its steady rate: that catching up is priced apart (`catch_up_pays`), and counted
        here it held the Qwen2.5-Coder pair's draft model back on code it drafts well
        (1.06x plain against 1.17x)."""
        if plan.measured is None or self.observed is None:
            return
        self.observed.record(plan.measured, positions, pass_s, draft_depth, draft_s, lag)
        if (draft_depth and lag <= CAUGHT_UP) or (not draft_depth and positions == 1):
            self.observed.record_round(draft_depth > 0, round_s, tokens)

    def catch_up_pays(self, request: Request, lag: int, prices: CostModel | None = None,
                      rows: int = 1) -> bool:
        """Whether the row's draft model should read the `lag` tokens it is behind (priced by
        the row's policy: `AdaptiveK.catch_up_pays`). Alone (rows 1) at `prices`, default its
        own at its context; one of a batch of `rows` at the batch's prices at its context
        (`prices` unused), by what its draft model's rounds have shown, with the batch's
        margin, saving one row's share of the batch's passes. Unpriced rows always catch
        up."""
        if getattr(request.drafter, "unread", None) is None or \
                not isinstance(request.policy, AdaptiveK):
            return True  # no draft model to catch up (a feature draft reads as it goes)
        remaining = request.budget - request.generated
        if rows > 1:
            return request.policy.catch_up_pays(self.batch_costs(rows).at(request.context),
                                                lag, remaining, self.config.batch_margin,
                                                rows)
        if prices is None:
            prices = self.batch_costs(1).at(request.context)
        return request.policy.catch_up_pays(prices, lag, remaining)

    def lookup_keep(self, request: Request, row: RowPlan) -> Callable[[Draft], int]:
        """How many of a lookup's (or a prediction's) tokens the row would verify
        (propose_batch asks, to let a hybrid row fall back to its draft model when it would
        verify none, or when its draft model, which drafts this round (row.k > 0), is worth
        more: `AdaptiveK.lookup_beats_model`)."""
        policy = request.policy
        weighs_model = row.k > 0 and isinstance(request.drafter, HybridDrafter) and \
            isinstance(policy, AdaptiveK)

        def keep(draft: Draft) -> int:
            kept = policy.keep(row.prices, row.width, draft.source, len(draft))
            if kept and weighs_model and \
                    not policy.lookup_beats_model(row.prices, row.width, draft.source, kept):
                return 0
            return kept
        return keep

    def keep(self, requests: Sequence[Request], drafts: Sequence[Draft],
             plan: RoundPlan) -> list[Draft]:
        """Each row's draft cut to what it pays for: by its kind of proposal, a tree pruned to
        its likeliest tokens, then every chain cut at the whole batch's prices."""
        kept = []
        for request, draft, row in zip(requests, drafts, plan.rows, strict=True):
            draft = draft.truncated(request.policy.keep(row.prices, row.width, draft.source,
                                                        draft.depth))
            if draft.scores is not None:
                draft = draft.pruned(request.policy.tree_size(row.prices, draft.scores,
                                                              draft.depth))
            kept.append(fitted(draft, tree_room(request)))
        if plan.batch_prices is not None and len(requests) > 1:
            kept = self._allocate(requests, kept, plan.batch_prices)
        return kept

    def _batch_k(self, requests: Sequence[Request], widths: list[int],
                 prices: CostModel) -> int:
        widest = max(range(len(requests)), key=lambda i: widths[i])
        costs = requests[widest].policy.tree_costs(prices, widths[widest])
        if costs.draft_step < self.config.cheap_draft:
            return costs.k_max
        gammas = [r.policy.gamma(0) for r in requests]
        return batch_optimal_k(gammas, costs.draft_step, costs.verify, costs.k_max,
                               min_speedup=self.config.batch_margin)

    def _allocate(self, requests: Sequence[Request], drafts: list[Draft],
                  prices: CostModel) -> list[Draft]:
        """Every row's chain cut to what pays for the whole batch (`theory.batch_allocation`:
        a token is verified while its chance of acceptance, gamma^j by its kind of proposal,
        beats what its place in the pass costs all the rows). Trees are kept whole: their
        size was priced when they were pruned."""
        rows = len(requests)
        chain = [d.parents is None for d in drafts]
        fixed = sum(len(d) for d, is_chain in zip(drafts, chain, strict=True) if not is_chain)
        gains = []  # one list per row (every row emits a token: the rate's base)
        for request, draft, is_chain in zip(requests, drafts, chain, strict=True):
            if not is_chain or not len(draft):
                gains.append([])
                continue
            gamma = request.policy.gamma(draft.source)
            gains.append([gamma ** (j + 1) for j in range(len(draft))])
        kept = batch_allocation(gains, lambda extra: prices.v(1 + (fixed + extra) / rows))
        return [d.truncated(count) if is_chain else d
                for d, count, is_chain in zip(drafts, kept, chain, strict=True)]
