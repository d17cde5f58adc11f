"""How many tokens to draft each round: fixed, HF's heuristic schedule, or chosen from costs.

A policy belongs to one request. It learns from that request's verified rounds (`update`,
`update_tree`) and decides from the prices the round planner hands it (verispec.planner): it
holds no prices of its own, so the planner can price a row by the batch it is in without
touching the policy.

`AdaptiveK` picks the K that maximises the expected speedup
    expected_tokens(gamma, K) / (K * c + v(K + 1))
with gamma a running per-request estimate of the acceptance rate (kept per kind of proposal),
c the draft step cost and v(n) the cost of a target pass over n positions, both relative to a
one-token target step and measured on this machine (verispec.costs). K = 0 (a plain decoding
step) when nothing pays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from verispec.config import MAX_TREE_NODES, DecodeConfig
from verispec.costs import CostModel
from verispec.theory import batch_optimal_k, expected_speedup, optimal_k


class KPolicy(Protocol):
    """prices: this row's cost model for the round (its share of the pass, at its context), or
    None where the decoder has no prices (fixed K, heuristic); width: the width of the trees
    the row's draft model proposes this round (1: chains)."""

    def next_k(self, prices: CostModel | None, width: int = 1, free: bool = False) -> int:
        """How many tokens to ask the drafter for; free=True: for a proposal that costs nothing
        to make (a lookup), which keep() then cuts by its kind."""
        ...

    def keep(self, prices: CostModel | None, width: int, source: int, proposed: int) -> int:
        """How many proposed tokens (a tree: depths) to verify, by the kind of proposal
        (Draft.source)."""
        ...

    def update(self, source: int, num_drafted: int, num_accepted: int) -> None:
        """After verification: num_drafted tokens of this source were verified."""
        ...

    def tree_size(self, prices: CostModel | None, scores: torch.Tensor, depth: int = 1) -> int:
        """How many of a token tree's tokens to verify (its likeliest, by the drafter's
        cumulative log-probabilities `scores`; the tree is `depth` deep)."""
        ...

    def update_tree(self, expected: float, num_accepted: int) -> None:
        """After verifying a tree the drafter expected to yield `expected` tokens."""
        ...


class WholeTrees:
    """For policies that do not price trees: verify a tree whole (at most MAX_TREE_NODES)."""

    __slots__ = ()

    def tree_size(self, prices: CostModel | None, scores: torch.Tensor, depth: int = 1) -> int:
        return min(int(scores.numel()), MAX_TREE_NODES)

    def update_tree(self, expected: float, num_accepted: int) -> None:
        pass


@dataclass(slots=True)
class FixedK(WholeTrees):
    k: int

    def next_k(self, prices: CostModel | None, width: int = 1, free: bool = False) -> int:
        return self.k

    def keep(self, prices: CostModel | None, width: int, source: int, proposed: int) -> int:
        return proposed

    def update(self, source: int, num_drafted: int, num_accepted: int) -> None:
        pass


@dataclass(slots=True)
class HeuristicK(WholeTrees):
    """Transformers' schedule for assistant models: +2 after a round whose draft was accepted
    whole, -1 otherwise, within [1, k_max]."""

    k: int
    k_max: int = 16

    def next_k(self, prices: CostModel | None, width: int = 1, free: bool = False) -> int:
        return self.k

    def keep(self, prices: CostModel | None, width: int, source: int, proposed: int) -> int:
        return proposed

    def update(self, source: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        step = 2 if num_accepted == num_drafted else -1
        self.k = min(self.k_max, max(1, self.k + step))


@dataclass(slots=True)
class AcceptanceEstimate:
    """gamma = (accepted_w + prior * prior_weight) / (checked_w + prior_weight), where the
    weighted counts decay at every update: recent rounds matter most, and rounds without
    evidence let the estimate drift back to the prior, so a K of 0 is eventually retried."""

    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.85
    accepted_w: float = 0.0
    checked_w: float = 0.0
    idle: int = 0  # rounds since the last evidence (`AdaptiveK`'s probes)
    probe_gap: int = 16  # rounds without evidence before the next probe (`AdaptiveK`)

    @property
    def gamma(self) -> float:
        return ((self.accepted_w + self.prior * self.prior_weight)
                / (self.checked_w + self.prior_weight))

    @property
    def probing(self) -> bool:
        """Whether it has gone its probe gap without evidence: its next proposal is a probe."""
        return self.idle >= self.probe_gap

    @property
    def observed(self) -> float:
        """The acceptance its evidence alone says (decay keeps the ratio, so rounds without
        evidence do not pull it toward the prior); the prior while it has none."""
        return self.accepted_w / self.checked_w if self.checked_w > 0.0 else self.prior

    def update(self, num_checked: int, num_accepted: int) -> None:
        self.accepted_w = self.decay * self.accepted_w + num_accepted
        self.checked_w = self.decay * self.checked_w + num_checked
        self.idle = 0 if num_checked else self.idle + 1


@dataclass(slots=True)
class AdaptiveK:
    """K from the round's prices and running acceptance estimates, one per kind of proposal.

    A costly drafter (a draft model) gets its K before drafting, from the estimate for its one
    source. A free drafter (n-gram lookup) is asked for up to k_max tokens, and then only as many
    are verified as pay off for that proposal's source: a long n-gram match is accepted far more
    often than a one-token match, and earns a longer K. A drafter with both kinds (hybrid) asks
    for both: next_k(free=True) for its lookup, next_k() for its draft model.

    The draft model's proposals may be token trees (source 0): K is then their depth, priced by
    the tree's nodes (CostModel.tree), with gamma the acceptance per depth.
    """

    config: DecodeConfig = field(default_factory=DecodeConfig)
    estimates: dict[int, AcceptanceEstimate] = field(default_factory=dict)
    # How many tokens a tree yields against what its drafter's probabilities promise (a ratio,
    # starting at 1): the tree's size is chosen each round from the promise (`tree_size`).
    calibration: AcceptanceEstimate = field(
        default_factory=lambda: AcceptanceEstimate(prior=1.0))
    # A sampled row's: its drafted tokens cost CostModel.sampling_step more each, and its
    # trees are drafted whole (their shape is fixed before the draws), so a depth is priced by
    # the tree's full width. A greedy row's trees are cut by `tree_size` before verifying: a
    # depth is priced by the nodes the cut has been keeping per depth (`kept`, starting as a
    # chain: 1), so where a wide pass is dear drafting still pays as a narrow tree.
    sampling: bool = False
    kept: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(prior=1.0))
    # The share of the output's tokens that come from the draft model's rounds (no lookup or
    # prediction proposed): how much of the output a draft model that lags behind would speed
    # up once it has caught up, and how much of it, written by the others, it would have to
    # read on the way (`catch_up_pays`). A row with a prediction starts low: the prediction is
    # expected to write most of its output. Estimated over about as long as it is extrapolated
    # to (`lasting_estimate`).
    model_rounds: AcceptanceEstimate = field(default_factory=lambda: lasting_estimate(1.0))
    # The draft model's acceptance over about as many rounds (`lasting_estimate`): what a
    # catch-up, paid once and repaid over the rest of the output, is priced with
    # (`catch_up_pays`), where K each round follows the last few rounds (`gamma`).
    lasting: AcceptanceEstimate | None = None
    # Acceptance by source over the decoder's earlier requests (shared by their policies, one
    # table per kind of row): a new request's estimate of a source starts from it instead of
    # the fixed prior, so a short request already trusts the long lookups others found good.
    shared: dict[int, AcceptanceEstimate] | None = None

    @classmethod
    def for_request(cls, config: DecodeConfig, sampling: bool = False,
                    predicted: bool = False,
                    shared: dict[int, AcceptanceEstimate] | None = None) -> AdaptiveK:
        """A request's policy; predicted: it brings a prediction, expected to propose most of
        its rounds (a quarter left to its draft model, until its rounds say otherwise);
        shared: the decoder's acceptance by source over earlier requests (`shared_estimates`)."""
        policy = cls(config, sampling=sampling, shared=shared)
        if predicted:
            policy.model_rounds = lasting_estimate(0.25)
        return policy

    def gamma(self, source: int = 0) -> float:
        return self._estimate(source).gamma

    def next_k(self, prices: CostModel | None, width: int = 1, free: bool = False) -> int:
        prices = _require(prices)
        if free or prices.draft_step < self.config.cheap_draft:  # lookups: priced in keep()
            return prices.k_max
        best = self._best_k(prices, self.gamma(0), width)
        return self._probed(0, best, best or self._best_k(prices, SURE, width) > 0)

    def keep(self, prices: CostModel | None, width: int, source: int, proposed: int) -> int:
        prices = _require(prices)
        if source != 0:  # a lookup's tokens (a prediction's too) cost nothing to draft: only
            # their place in the target pass is priced, not the row's draft-model step
            prices, width = lookup_prices(prices), 1
        best = self._best_k(prices, self.gamma(source), width)
        return min(proposed, self._probed(
            source, best, best or self._best_k(prices, SURE, width) > 0))

    def lookup_beats_model(self, prices: CostModel | None, width: int, source: int,
                           kept: int) -> bool:
        """Whether `kept` tokens of a lookup of this kind are worth more this round than the
        draft model's best proposal: expected tokens per target step, the lookup's priced
        without a draft step, the model's with its K draft steps. A row whose lookups are
        accepted less often than its draft model's tokens (short n-gram matches in code a model
        drafts well) drafts with the model instead. A kind not yet tried (no evidence in this
        request or in earlier ones), or one gone config.probe_every rounds without evidence,
        is tried rather than judged by its prior: no source starves."""
        prices = _require(prices)
        estimate = self._estimate(source)
        if estimate.probing or (
                estimate.checked_w == 0.0 and (self.shared is None or source not in self.shared)):
            return True
        lookup = lookup_prices(prices)
        lookup_rate = expected_speedup(self.gamma(source), kept, 0.0, lookup.v(kept + 1))
        model = self.tree_costs(prices.sampled() if self.sampling else prices, width)
        gamma = self.gamma(0)
        k = optimal_k(gamma, model.draft_step, model.verify, model.k_max)
        return k == 0 or lookup_rate >= expected_speedup(gamma, k, model.draft_step,
                                                         model.v(k + 1))

    def update(self, source: int, num_drafted: int, num_accepted: int) -> None:
        for other, estimate in self.estimates.items():
            if other != source:
                estimate.idle += 1
        checked = min(num_accepted + 1, num_drafted)
        estimate = self._estimate(source)
        probed = estimate.probing
        estimate.update(checked, num_accepted)
        if checked:  # evidence: after a probe the next waits twice as long, else the least
            every = self.config.probe_every
            estimate.probe_gap = min(2 * estimate.probe_gap, MAX_PROBE_GAPS * every) \
                if probed else every
        if source == 0 and checked:
            if self.lasting is None:
                self.lasting = lasting_estimate(self._estimate(0).prior)
            self.lasting.update(checked, num_accepted)
        written = num_accepted + 1  # the round's tokens: the accepted ones and the target's
        self.model_rounds.update(written, written if source == 0 else 0)
        if self.shared is not None and checked:
            self.shared.setdefault(source, shared_estimate(self._prior(source))).update(
                checked, num_accepted)

    def catch_up_pays(self, prices: CostModel | None, lag: int, remaining: int,
                      batch_margin: float | None = None, rows: int = 1) -> bool:
        """Whether a draft model `lag` tokens behind the row (a prompt it has not read, or what
        lookups and a prediction added while it waited) should read them and draft this round:
        what it would save over the rest of the output (`remaining` tokens, at most
        config.catch_up_horizon, in the share of the output its rounds write, at the speedup of
        its best K at its acceptance over its last ~50 rounds, `lasting_estimate`) beats what
        the reading costs (`CostModel.catch_up`): the lag now, and the rest of those tokens,
        which lookups and a prediction will write and it must read before it drafts again. A
        lag a round's own draft step absorbs (up to k_max + 1 tokens) is never in question.

        Example: a row with a prediction that writes 87% of the output, a 215-token prompt
        unread, reading at 0.04 steps a token and the model's rounds at 1.6x plain: over 512
        tokens it would save 0.13 * 512 * (1 - 1 / 1.6) = 25 steps for 8.6 + 0.87 * 512 * 0.04
        = 26 steps of reading, so it does not catch up; drafting alone it would (192 steps
        saved against 8.6).

        batch_margin: the row is one of a batch, `prices` the whole batch's, and the batch
        drafts only above this speedup (`theory.batch_optimal_k`). Its draft model is then
        priced by what its rounds have shown (`AcceptanceEstimate.observed`), not by an
        estimate drifting back to the prior while it sat out: every lagging row of a batch
        catches up at once, and on an Intel Xeon a batch of 4 that re-entered on the prior's
        pull every ~15 rounds spent 0.1-0.3 s catching up each time for a round or two of
        drafting before its evidence priced it out again.

        rows: the batch's size. The whole batch waits while one row's draft model reads, but
        what the row saves is its own share of the batch's passes: one pass in `rows` is its,
        so its saving counts 1/rows of a batch step a round. (On an Intel Xeon a batch of 4
        with 64-token answers spent 1.4 s of an 11.6 s run catching its draft models up on
        their prompts, priced as if each saved whole batch steps: 0.94x plain.)"""
        prices = _require(prices)
        if lag <= prices.k_max + 1 or prices.draft_catch_up_s <= 0.0:
            return True
        if batch_margin is None:
            gamma = self.gamma(0) if self.lasting is None else self.lasting.gamma
            k = self._best_k(prices, gamma, 1)
        else:
            gamma = self._estimate(0).observed
            prices = prices.sampled() if self.sampling else prices
            k = batch_optimal_k([gamma], prices.draft_step, prices.verify, prices.k_max,
                                min_speedup=batch_margin)
        if k == 0:
            return False
        rate = expected_speedup(gamma, k, prices.draft_step, prices.v(k + 1))
        horizon = min(remaining, self.config.catch_up_horizon)
        share = self.model_rounds.gamma
        saved = share * horizon * (1.0 - 1.0 / rate) / rows
        return saved > prices.catch_up(lag) + prices.catch_up(1) * (1.0 - share) * horizon

    def tree_size(self, prices: CostModel | None, scores: torch.Tensor, depth: int = 1) -> int:
        """The n maximising (1 + a * sum of the n likeliest tokens' probabilities) / v(n + 1):
        each token is on the accepted path with about the probability the drafter gives its
        path, times a (`calibration`, learnt from the rounds so far); the tree is drafted
        already, so only the target pass is priced. depth: the tree's (for `kept`)."""
        prices = _require(prices)
        ratio = self.calibration.gamma
        probs = scores.float().exp().sort(descending=True).values[:MAX_TREE_NODES].tolist()
        # a probe (`_probed`) verifies at least the likeliest token: cut to nothing, it would
        # learn nothing, and the next round would probe again
        source = self._estimate(0)
        best, best_rate, expected = int(source.probing), 0.0, 1.0
        for n, prob in enumerate(probs, start=1):
            expected += ratio * prob
            rate = expected / prices.v(n + 1)
            if rate > max(best_rate, 1.0):
                best, best_rate = n, rate
        self.kept.update(max(1, depth), best)
        return best

    def update_tree(self, expected: float, num_accepted: int) -> None:
        self.calibration.update(expected, num_accepted)

    def tree_costs(self, prices: CostModel, width: int) -> CostModel:
        """prices for this policy's trees `width` wide, by depth."""
        # at least a chain's node: rounds the cut leaves empty verify nothing, but gamma is
        # learnt from the rounds that verified something
        nodes = width if self.sampling else min(width, max(1.0, self.kept.gamma))
        return prices.tree(width, nodes=nodes)

    def _best_k(self, prices: CostModel, gamma: float, width: int) -> int:
        prices = self.tree_costs(prices.sampled() if self.sampling else prices, width)
        return optimal_k(gamma, prices.draft_step, prices.verify, prices.k_max)

    def _probed(self, source: int, k: int, pays_when_accepted: bool) -> int:
        """k, or one token where k is 0 and the source has gone its probe gap without
        evidence: a source its prior prices out is still tried now and then (its first
        proposal at once), so its acceptance is learnt rather than assumed; never one that
        would not pay even if always accepted. A probe costs one extra position (and draft
        step) every probe_every rounds, then, while probes keep finding it priced out, every
        2, 4, .. 16 times as many (`update`)."""
        estimate = self._estimate(source)
        if k == 0 and pays_when_accepted and estimate.probing:
            return 1
        return k

    def _prior(self, source: int) -> float:
        """A source's estimate before this request's evidence: source 0 the draft model's,
        others lookups' (and a prediction's)."""
        return self.config.draft_prior if source == 0 else 0.5

    def _estimate(self, source: int) -> AcceptanceEstimate:
        if source not in self.estimates:
            prior = self._prior(source)
            if self.shared is not None and source in self.shared:
                prior = min(max(self.shared[source].gamma, 0.01), 0.99)
            self.estimates[source] = AcceptanceEstimate(prior, self.config.prior_weight,
                                                        self.config.estimate_decay,
                                                        idle=self.config.probe_every,
                                                        probe_gap=self.config.probe_every)
        return self.estimates[source]


# A probe that finds its source still priced out doubles the wait before the next, up to this
# many times DecodeConfig.probe_every.
MAX_PROBE_GAPS = 16


# How fast `lasting_estimate` forgets (a round's weight): ~50 rounds.
LASTING_DECAY = 0.98


def lasting_estimate(prior: float) -> AcceptanceEstimate:
    """A rate over about a row's last 50 rounds, for what is extrapolated over many rounds
    where the acceptance K follows weighs the last few:
    - the share of the output the draft model's rounds write (`AdaptiveK.model_rounds`), over
      up to catch_up_horizon tokens. Estimated over the last few rounds, it followed every
      stretch a prediction had nothing for (a changed line of a code edit) and called the
      draft model back to read all the prediction had written since it last drafted: on three
      code edits the 1.5B's 0.5B draft read 397 tokens in five such rounds, 1.1 s, for 25
      tokens;
    - the draft model's acceptance that prices a catch-up, paid once and repaid over many
      rounds (`AdaptiveK.lasting`). Priced by the last few rounds, after a hard stretch the
      row ran without its draft model, the draft fell behind by what the next rounds wrote,
      and the catching up looked worse with every round it waited (on one code prompt the
      Qwen2.5-Coder pair's 0.5B fell to 0.50 for a moment, 0.61 over its rounds, and did not
      draft again in the remaining 49 tokens)."""
    return AcceptanceEstimate(prior, prior_weight=2.0, decay=LASTING_DECAY)


def shared_estimate(prior: float) -> AcceptanceEstimate:
    """A source's acceptance over many requests: a slow decay (the last ~100 rounds)."""
    return AcceptanceEstimate(prior, prior_weight=2.0, decay=0.99)


# The acceptance a probe is priced at: a source that would not pay even at this is never tried.
SURE = 0.99


def lookup_prices(prices: CostModel) -> CostModel:
    """prices for proposals that cost nothing to make (lookups, predictions): no draft-model
    step (a sampled row still pays sampling_step a token for verifying it)."""
    return dataclasses.replace(prices, draft_step=0.0, long_draft_step=None)


def _require(prices: CostModel | None) -> CostModel:
    if prices is None:
        raise ValueError("k='auto' needs the round's prices (a cost model)")
    if prices.long_verify is not None:
        raise ValueError("price a round at its context: costs.at(context)")
    return prices
