"""K policies: HF's heuristic schedule, the cost model, adaptive K, and exactness under them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import EOS_ID, perturbed_copy

from verispec import SamplingParams, SpeculativeDecoder
from verispec.config import DecodeConfig, parse_k
from verispec.costs import CostModel, measure_batch_costs, measure_costs, verify_curve
from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.policy import AcceptanceEstimate, AdaptiveK, FixedK, HeuristicK
from verispec.runtime import HFRunner
from verispec.theory import expected_speedup, optimal_k


def test_heuristic_schedule_plus_two_minus_one():
    policy = HeuristicK(k=5, k_max=8)
    ks = []
    for drafted_accepted in [(5, 5), (7, 2), (6, 6), (8, 8), (8, 0), (7, 0)]:
        policy.update(0, *drafted_accepted)
        ks.append(policy.next_k(None))
    assert ks == [7, 6, 8, 8, 7, 6]
    policy = HeuristicK(k=1)
    policy.update(0, 1, 0)
    assert policy.next_k(None) == 1  # never below 1


def costs(draft_step, verify):
    return CostModel(draft_step=draft_step, verify=tuple(verify), target_step_s=0.05)


class Priced:
    """An AdaptiveK with the prices the round planner would hand it bound in (at a context),
    so a test reads as one row's decisions round after round."""

    def __init__(self, prices: CostModel, estimates=None, tree_width: int = 1,
                 sampling: bool = False) -> None:
        self.prices, self.width = prices, tree_width
        self.policy = AdaptiveK(estimates=estimates if estimates is not None else {},
                                sampling=sampling)

    def next_k(self, free=False, context=0):
        return self.policy.next_k(self.prices.at(context), self.width, free)

    def keep(self, source, proposed, context=0):
        return self.policy.keep(self.prices.at(context), self.width, source, proposed)

    def tree_size(self, scores, context=0, depth=1):
        return self.policy.tree_size(self.prices.at(context), scores, depth)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def test_adaptive_k_follows_acceptance():
    # a draft model: K chosen up front (4 at the prior's 0.8, 6 at 0.95)
    policy = Priced(costs(0.05, [1.0, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0]))
    start = policy.next_k()
    for _ in range(10):
        k = policy.next_k()
        policy.update(0, k, k)  # every draft accepted
    assert policy.next_k() > start and policy.gamma() > 0.9
    for _ in range(30):
        policy.update(0, max(policy.next_k(), 1), 0)  # every draft rejected at its first token
    assert policy.gamma() < 0.2 and policy.next_k() <= 1


def test_adaptive_k_is_zero_when_speculation_cannot_pay():
    policy = Priced(costs(1.0, [1.0, 2.0, 3.0, 4.0]))  # a draft as slow as the target
    assert policy.next_k() == 0


def test_a_weak_drafts_estimate_settles_near_its_acceptance_and_it_stops_drafting():
    """The prior's pull must not hold a weak draft's estimate above break-even: a draft model
    accepted 21% of the time (K = 1 each round, so 1 in 5 rounds accepts) with c = 0.06 and
    v(2) = 1.12 breaks even at gamma ~0.18; its estimate must settle close to 0.21, and K at 0
    after a few rounds of K = 0 plus a retry."""
    policy = Priced(costs(0.064, [1.0, 1.12, 1.12, 1.35]))
    estimates = []
    for round in range(200):
        policy.update(0, 1, int(round % 5 == 0))  # one accepted in five
        estimates.append(policy.gamma())
    settled = sum(estimates[100:]) / 100
    # evidence weighs 1 / (1 - decay) ~ 6.7 rounds against the optimistic prior's 0.5 (0.8):
    # the estimate sits ~0.04 above the acceptance (at prior weight 2 it sat ~0.07 above)
    config = policy.config
    evidence = 1 / (1 - config.estimate_decay)
    pulled = (0.2 * evidence + config.draft_prior * config.prior_weight) / (
        evidence + config.prior_weight)
    assert abs(settled - pulled) < 0.02 and settled < 0.25
    assert optimal_k(0.2, 0.064 + 0.05, [1.0, 1.12]) == 0  # with a round's bookkeeping: a loss


def test_adaptive_k_probes_again_after_a_bad_patch():
    policy = Priced(costs(0.02, [1.0, 1.3, 1.5, 1.7, 1.9]))
    for _ in range(20):
        policy.update(0, 2, 0)
    assert policy.next_k() == 0
    for _ in range(40):
        policy.update(0, 0, 0)  # plain steps: no evidence, the estimate returns to the prior
    assert policy.next_k() > 0


def test_a_costly_draft_is_tried_and_retried():
    """A draft model whose step costs half a target step (Qwen2.5-Coder-0.5B for the 1.5B on a
    2-core CPU) pays only above gamma ~0.7: the optimistic prior makes it draft from the first
    round (at 0.5 it never drafted, so never learnt its acceptance), rejections stop it, and
    rounds without evidence bring it back."""
    policy = Priced(costs(0.5, [1.0, 1.2, 1.36, 1.59, 1.8, 1.91, 2.1, 2.27, 2.55]))
    assert policy.next_k() >= 1
    assert optimal_k(0.5, 0.5, [1.0, 1.2, 1.36]) == 0  # the old prior: K = 0 from the start
    for _ in range(3):
        policy.update(0, 2, 0)
    assert policy.next_k() == 0
    for _ in range(30):
        policy.update(0, 0, 0)
    assert policy.next_k() >= 1
    for _ in range(10):
        policy.update(0, 3, 3)  # a good draft keeps drafting, deeper
    assert policy.next_k() >= 2


def test_free_drafts_are_trimmed_per_source():
    """n-gram proposals cost nothing: ask for k_max, verify as many as the source earns."""
    policy = Priced(costs(0.001, [1.0, 1.2, 1.3, 1.5, 1.55, 1.6, 1.8, 1.9, 2.0]))
    assert policy.next_k() == 8
    for _ in range(20):
        policy.update(1, 1, 0)  # one-token matches: rejected
        policy.update(5, 8, 8)  # five-token matches: accepted whole
    assert policy.keep(1, 8) == 0
    assert policy.keep(5, 8) == 8
    assert policy.keep(5, 3) == 3  # never more than proposed
    assert policy.keep(3, 8) == policy.keep(4, 8)  # unseen lookup sources: the same prior


def test_a_lookup_next_to_a_costly_draft_still_proposes_the_most():
    """Hybrid drafting: a draft model that is rejected earns K = 0, but its lookup is free."""
    policy = Priced(costs(0.2, [1.0, 1.05, 1.1, 1.15, 1.2]))
    for _ in range(20):
        policy.update(0, 2, 0)  # the draft model's tokens: rejected
    assert policy.next_k() == 0
    assert policy.next_k(free=True) == 4


def test_a_row_of_a_batch_pays_its_share_of_the_bigger_pass():
    batch = costs(0.0, [1.0, 1.2, 1.4, 1.8])
    share = batch.row_share(4)
    assert share.verify == pytest.approx((1.0, 1.05, 1.1, 1.2))
    assert share.draft_step == batch.draft_step and share.target_step_s == batch.target_step_s
    # a lookup accepted 15% of the time does not pay for a pass where every row grows, and
    # pays for one token where only its row does
    assert optimal_k(0.15, 0.0, batch.verify) == 0 and optimal_k(0.15, 0.0, share.verify) == 1
    assert optimal_k(0.5, 0.0, batch.verify) == 1 and optimal_k(0.5, 0.0, share.verify) == 2


def test_trees_are_priced_by_their_nodes():
    chain = costs(0.05, [1.0, 1.02, 1.04, 1.06, 1.08])  # v(1..5), +0.02 a position
    tree = chain.tree(3)
    # depth k holds 3k nodes + the root: v(1), v(4), v(7) (past the table: along its last step)
    assert tree.verify == pytest.approx((1.0, 1.06, 1.12, 1.18, 1.24, 1.30))
    assert chain.tree(1) is chain and chain.tree(16).verify == pytest.approx((1.0, 1.32))
    # between measured positions along the line joining them
    assert chain.v(2.5) == pytest.approx(1.03)
    assert chain.tree(3, nodes=1.5).verify[:3] == pytest.approx((1.0, 1.03, 1.06))
    policy = Priced(chain, tree_width=3, sampling=True)  # sampled rows: trees drafted whole
    for _ in range(20):
        policy.update(0, 2, 1)  # half the depths accepted
    assert policy.next_k() == optimal_k(policy.gamma(0), 0.05, tree.verify, tree.k_max)
    assert policy.next_k() < Priced(chain, policy.estimates).next_k()  # dearer per depth
    assert policy.keep(3, 4) == Priced(chain, policy.estimates).keep(3, 4)  # lookups: chains


def test_cut_trees_are_priced_by_the_nodes_the_cut_keeps():
    """Greedy rows' trees are cut before verifying: a depth is priced by the nodes the cut has
    kept per depth (a chain's one at first), so a dear wide pass does not stop the drafting a
    narrow tree would pay for."""
    steep = costs(0.05, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8])  # +0.1 a position
    estimates = {0: AcceptanceEstimate(prior=0.5)}
    whole = Priced(steep, dict(estimates), tree_width=8, sampling=True)
    cut = Priced(steep, dict(estimates), tree_width=8)
    assert whole.next_k() == 0  # 8 nodes + root: v(9) = 1.8 for one depth
    assert cut.next_k() == optimal_k(0.5, 0.05, steep.tree(8, nodes=1).verify, 1) == 1
    three = torch.tensor([0.6, 0.3, 0.2, 0.01, 0.01]).log()
    for _ in range(30):
        assert cut.tree_size(three, depth=1) == 3  # the cut at these prices
    assert 2.4 < cut.kept.gamma < 3  # nodes kept per depth, drawn a little to the prior (1)
    assert cut.tree_costs(steep, 8).verify[1] == pytest.approx(steep.v(cut.kept.gamma + 1))
    assert cut.tree_costs(steep, 8).verify[1] < whole.tree_costs(steep, 8).verify[1]
    # a cut that keeps nothing round after round: a depth still costs at least a chain's node
    for _ in range(30):
        assert cut.tree_size(torch.tensor([0.01, 0.01]).log(), depth=1) == 0
    assert cut.kept.gamma < 1 and cut.tree_costs(steep, 8).verify[1] == pytest.approx(steep.v(2))


def test_costs_are_priced_at_the_sequences_context():
    two = CostModel(0.05, (1.0, 1.02, 1.04), 0.01, long_verify=(1.0, 1.12, 1.24),
                    contexts=(128, 1024))
    assert two.at(128).verify == pytest.approx((1.0, 1.02, 1.04))
    assert two.at(576).verify == pytest.approx((1.0, 1.07, 1.14))
    assert two.at(1920).verify == pytest.approx((1.0, 1.22, 1.44))  # along the line past it
    assert two.at(0).verify[1] >= 1.0 and two.at(576).long_verify is None
    assert two.row_share(4).at(1024).verify == pytest.approx((1.0, 1.03, 1.06))
    with pytest.raises(ValueError, match="at a context"):
        two.tree(3)
    # with the step's time at both contexts, each pass's time follows the context: here the
    # step 1.5x as long after 1,024 tokens, passes over 2 and 3 positions 1.68 and 1.86 short
    # steps, so at 1,920 tokens the step is 2.0 and they 2.34 and 2.68
    timed = dataclasses.replace(two, long_step=1.5)
    assert timed.at(128).verify == pytest.approx((1.0, 1.02, 1.04))
    assert timed.at(1024).verify == pytest.approx((1.0, 1.12, 1.24))
    assert timed.at(1920).verify == pytest.approx((1.0, 2.34 / 2.0, 2.68 / 2.0))
    # a curve whose longer context came out cheaper (noise): its ratios' line reaches v = 1
    # (every pass free) by 8,000 tokens; followed as times, a pass grows no slower than the
    # step (0.5 short steps per 896 tokens here), so v(3) 1.6 at 128 is 5.99 / 5.39 there
    noisy = CostModel(0.05, (1.0, 1.3, 1.6), 0.01, long_verify=(1.0, 1.1, 1.2),
                      contexts=(128, 1024))
    assert noisy.at(8000).verify == (1.0, 1.0, 1.0)
    far = dataclasses.replace(noisy, long_step=1.5).at(8000).verify
    weight = (8000 - 128) / 896
    assert far == pytest.approx((1.0, (1.3 + 0.5 * weight) / (1 + 0.5 * weight),
                                 (1.6 + 0.5 * weight) / (1 + 0.5 * weight)))
    # a long sequence drafts no deeper than a short one, and here less
    policy = Priced(two)
    for _ in range(20):
        policy.update(0, 4, 1)  # gamma ~ 0.5
    assert policy.next_k(context=2000) < policy.next_k(context=100)
    assert policy.keep(3, 8, context=2000) <= policy.keep(3, 8, context=100)


def test_a_draft_models_step_is_priced_at_the_context_where_it_was_timed_at_both():
    """A draft model attends over the context too: c timed after 128 and 1,024 tokens is
    interpolated like v, and a dearer c at length means a shallower K there."""
    two = CostModel(0.05, (1.0, 1.02, 1.04, 1.06), 0.01, long_verify=(1.0, 1.02, 1.04, 1.06),
                    contexts=(128, 1024), long_draft_step=0.25)
    assert two.at(128).draft_step == pytest.approx(0.05)
    assert two.at(576).draft_step == pytest.approx(0.15)
    assert two.at(576).long_draft_step is None
    flat = dataclasses.replace(two, long_draft_step=None)
    assert flat.at(1024).draft_step == pytest.approx(0.05)  # not timed there: unchanged
    estimates = {0: AcceptanceEstimate(prior=0.6)}
    assert Priced(two, dict(estimates)).next_k(context=1024) < \
        Priced(flat, dict(estimates)).next_k(context=1024)


def test_sampled_rows_pay_for_sampling_each_drafted_token():
    """A sampled round also warps and draws the draft's distribution and the target's at every
    checked position: priced per drafted token (CostModel.sampling_step), a sampled row drafts
    no deeper than a greedy one, and not at all where that eats the gain."""
    model = CostModel(0.05, (1.0, 1.05, 1.10, 1.15, 1.20), 0.01, sampling_step=0.2)
    assert model.sampled().draft_step == pytest.approx(0.25)
    assert model.sampled().sampling_step == 0.0
    estimates = {0: AcceptanceEstimate(prior=0.3)}
    greedy = Priced(model, dict(estimates))
    sampled = Priced(model, dict(estimates), sampling=True)
    assert greedy.next_k() >= 1 and sampled.next_k() == 0
    assert sampled.next_k() == optimal_k(0.3, 0.25, model.verify, model.k_max)


def test_a_trees_size_is_what_its_probabilities_pay_for():
    policy = Priced(costs(0.05, [1.0, 1.05, 1.10, 1.15, 1.20]))  # +0.05 a position
    confident = torch.tensor([0.9, 0.8, 0.05, 0.04, 0.03, 0.02]).log()
    assert policy.tree_size(confident) == 2  # the two likely tokens; the rest cost more
    unlikely = torch.tensor([0.01, 0.01]).log()
    assert policy.tree_size(unlikely) == 1  # nothing pays, but a probe verifies its likeliest
    policy.update(0, 2, 1)  # the probe's evidence
    assert policy.tree_size(unlikely) == 0  # nothing pays
    # a drafter that promises twice what it delivers gets smaller trees
    likely = torch.tensor([0.9, 0.1, 0.08]).log()
    assert policy.tree_size(likely) == 2
    for _ in range(30):
        policy.update_tree(2.0, 1)
    assert policy.calibration.gamma == pytest.approx(0.5, abs=0.1)
    assert policy.tree_size(likely) == 1
    assert FixedK(3).tree_size(None, confident) == 6


def test_optimal_k_with_a_verify_curve():
    assert optimal_k(0.8, 0.0, [1.0, 1.0, 1.0, 1.0]) == 3  # free verification: draft all
    assert optimal_k(0.8, 0.0, [1.0, 1.9, 2.8]) == 0  # every extra position costs ~ a step


class VirtualClock:
    """Seconds that pass only when the fakes below say a pass or a draft step took them."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


SHORT, LONG = 32, 64  # the contexts the measurement times at
# Pass seconds over n = 1..5 positions: at the short context one sample at 3 positions is
# cheaper than at 4 (noise), which the curve lowers to; the first timing of every pass is
# slowed by half (a burst of machine noise), which the fastest of the repeats leaves out.
PASS_S = {SHORT: [0.010, 0.012, 0.016, 0.015, 0.018], LONG: [0.020, 0.026, 0.032, 0.038, 0.044]}
DRAFT_S = {SHORT: 0.002, LONG: 0.005}  # one draft step after each context
SAMPLING_S = 0.0004  # a sampled draft step's extra
CATCH_UP_S = 0.0001  # per token an empty drafter reads before it proposes


class TimedTarget:
    """A Runner whose pass over n new positions takes PASS_S[context][n - 1] virtual seconds."""

    vocab_size, max_positions = 50, 2048

    def __init__(self, clock: VirtualClock) -> None:
        self.clock, self.seen = clock, set()

    def sibling(self) -> TimedTarget:
        return TimedTarget(self.clock)

    def logits(self, history: torch.Tensor, n: int) -> torch.Tensor:
        context = int(history.numel()) - n
        if context in PASS_S:
            seconds = PASS_S[context][n - 1]
            self.clock.now += seconds * (1.5 if (context, n) not in self.seen else 1.0)
            self.seen.add((context, n))
        return torch.zeros(n, self.vocab_size)


class TimedDrafter:
    """A drafter with a cache: a step after the tokens it has read costs DRAFT_S at its context;
    after a reset, reading the history first costs CATCH_UP_S a token."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock, self.cached = clock, 0

    def reset(self) -> None:
        self.cached = 0

    def propose(self, history, k, params, generator):
        length = int(history.numel())
        unread = length - min(self.cached, length - 1)
        context = min(DRAFT_S, key=lambda c: abs(c - length))
        self.clock.now += DRAFT_S[context] + (CATCH_UP_S * unread if unread > 1 else 0.0)
        self.clock.now += 0.0 if params.greedy else SAMPLING_S
        self.cached = length


def test_measure_costs_prices_what_the_passes_and_draft_steps_took(monkeypatch):
    """On a clock that moves only by known pass and step times, the measurement recovers them
    as prices in one-token target steps: v(n) at both contexts (a noisy dip lowered, not
    spread), c at both contexts, a sampled step's extra and the drafter's catch-up."""
    clock = VirtualClock()
    monkeypatch.setattr("verispec.costs.time", clock)
    measured = measure_costs(TimedTarget(clock), TimedDrafter(clock), k_max=4, context=SHORT,
                             repeats=3, long_context=LONG)
    short, long = PASS_S[SHORT], PASS_S[LONG]
    assert measured.verify == pytest.approx((1.0, 1.2, 1.5, 1.5, 1.8))  # 1.6 lowered to 1.5
    assert measured.long_verify == pytest.approx(tuple(s / long[0] for s in long))
    assert measured.target_step_s == pytest.approx(short[0])
    assert measured.contexts == (SHORT, LONG)
    assert measured.draft_step == pytest.approx(DRAFT_S[SHORT] / short[0])
    assert measured.long_draft_step == pytest.approx(DRAFT_S[LONG] / long[0])
    assert measured.sampling_step == pytest.approx(SAMPLING_S / short[0])
    assert measured.draft_catch_up_s == pytest.approx(CATCH_UP_S)
    assert measured.long_step == pytest.approx(long[0] / short[0])
    # the prices in use: each pass's and the draft step's time along the line between the
    # two contexts, over the one-token step's there
    step = 0.5 * (short[0] + long[0])
    assert measured.at(48).draft_step == pytest.approx(
        0.5 * (DRAFT_S[SHORT] + DRAFT_S[LONG]) / step)
    assert measured.at(48).verify[1] == pytest.approx(0.5 * (short[1] + long[1]) / step)


class SlowingDrafter(TimedDrafter):
    """A TimedDrafter on a machine that slows down to half speed as the drafter is first asked
    (after the target's passes were timed): from then on every draft step and every target
    pass (`SlowingTarget`) takes twice as long."""

    def propose(self, history, k, params, generator):
        self.clock.slow = 2.0
        before = self.clock.now
        super().propose(history, k, params, generator)
        self.clock.now += self.clock.now - before  # twice as long


class SlowingTarget(TimedTarget):
    def sibling(self) -> SlowingTarget:
        return SlowingTarget(self.clock)

    def logits(self, history: torch.Tensor, n: int) -> torch.Tensor:
        before = self.clock.now
        out = super().logits(history, n)
        self.clock.now += (getattr(self.clock, "slow", 1.0) - 1.0) * (self.clock.now - before)
        return out


def test_the_draft_step_is_priced_against_a_target_step_of_the_same_moment(monkeypatch):
    """c is a draft step over a one-token target pass timed in the same rounds: a machine that
    slows down between the target's passes and the draft's steps slows both alike (timed
    apart, c came out twice what the two cost at any one moment)."""
    clock = VirtualClock()
    monkeypatch.setattr("verispec.costs.time", clock)
    measured = measure_costs(SlowingTarget(clock), SlowingDrafter(clock), k_max=4,
                             context=SHORT, repeats=3, long_context=0)
    assert measured.target_step_s == pytest.approx(PASS_S[SHORT][0])  # timed before it slowed
    assert measured.draft_step == pytest.approx(DRAFT_S[SHORT] / PASS_S[SHORT][0])


class DriftingTarget(TimedTarget):
    """A TimedTarget on a machine that slows down as it goes: every pass after the first
    `steady` takes twice its time, and each pass it times is noted by its context."""

    def __init__(self, clock: VirtualClock, timed: list[int], steady: int) -> None:
        super().__init__(clock)
        self.timed, self.steady = timed, steady

    def sibling(self) -> DriftingTarget:
        return DriftingTarget(self.clock, self.timed, self.steady)

    def logits(self, history: torch.Tensor, n: int, parents=None) -> torch.Tensor:
        context = int(history.numel()) - n
        if context in PASS_S and (context, n) in self.seen:
            self.timed.append(context)
            if len(self.timed) > self.steady:  # the slower machine
                self.clock.now += PASS_S[context][n - 1]
        return super().logits(history, n)


def test_batch_costs_time_both_contexts_in_alternation(monkeypatch):
    """A batch's passes after both contexts are timed in alternation, as a lone row's: a
    machine that slows down half-way through the measurement slows both alike, so the step's
    growth with the context (`long_step`) and both curves come out as the passes took; timed
    one context after the other, the long context would have looked twice as dear."""
    clock, timed = VirtualClock(), []
    monkeypatch.setattr("verispec.costs.time", clock)
    rows, k_max, repeats = 2, 4, 4
    target = DriftingTarget(clock, timed, steady=rows * 2 * (k_max + 1) * repeats // 2)
    measured = measure_batch_costs(target, None, batch=rows, k_max=k_max, context=SHORT,
                                   repeats=repeats, long_context=LONG)
    short, long = PASS_S[SHORT], PASS_S[LONG]
    assert measured.long_step == pytest.approx(long[0] / short[0])
    assert measured.long_verify == pytest.approx(tuple(s / long[0] for s in long))
    assert measured.verify == pytest.approx((1.0, 1.2, 1.5, 1.5, 1.8))
    assert measured.target_step_s == pytest.approx(rows * short[0])  # each row's pass, here
    # alternated: both contexts timed in the first and in the last round
    first, last = timed[:len(timed) // repeats], timed[-len(timed) // repeats:]
    assert set(first) == set(last) == {SHORT, LONG}
    at = measured.at((SHORT + LONG) // 2)  # priced by time: each pass along the context
    assert at.verify[1] == pytest.approx((short[1] + long[1]) / (short[0] + long[0]))


def test_measure_costs_on_a_real_runtime(text_target):
    """The real runtime objects go through the same measurement: a curve over k_max + 1
    positions at both contexts, and no draft price without a drafter."""
    model = HFRunner(text_target)
    measured = measure_costs(model, NgramDrafter(), k_max=4, context=32, repeats=1,
                             long_context=64)
    assert len(measured.verify) == len(measured.long_verify) == 5
    assert measure_costs(model, None, k_max=4, context=32, repeats=1,
                         long_context=64).long_draft_step == 0.0


@pytest.mark.parametrize("k", ["auto", "heuristic"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_variable_k_speculates_and_keeps_greedy_exact(text_target, tokenizer, k, drafter):
    """Under k="auto" and "heuristic" the decoder must actually draft and accept tokens (a
    cheap draft's prices are given: measured, a same-size draft would price K to 0 and this
    would compare plain decoding with itself) and still emit plain greedy's tokens."""
    draft = (ModelDrafter(perturbed_copy(text_target, 0.02, 0), EOS_ID + 1)
             if drafter == "model" else NgramDrafter())
    cheap = CostModel(draft_step=0.05, verify=(1.0,) + (1.02,) * 8, target_step_s=0.01)
    spec = SpeculativeDecoder(text_target, tokenizer, draft, k=k, costs=cheap)
    plain = SpeculativeDecoder(text_target, tokenizer, None)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    drafted = accepted = 0
    for prompt in ["hello world, hello world", "abcabcabc"]:
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    assert drafted > 0 and accepted > 0
    assert out.stats.target_forwards < params.max_new_tokens  # fewer passes than tokens


@pytest.mark.parametrize("bad", [-1, "fast", 1.5, None])
def test_parse_k_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="k must be"):
        parse_k(bad)


def test_parse_k_accepts_cli_strings():
    assert parse_k("7") == 7 and parse_k("auto") == "auto" and parse_k(0) == 0


def test_verify_curve_lowers_a_noise_spike_instead_of_spreading_it():
    # a spike at 2 positions (seen in a benchmark: it made every K look twice as dear)
    assert verify_curve([0.040, 0.077, 0.042, 0.044]) == pytest.approx((1.0, 1.05, 1.05, 1.1))
    assert verify_curve([0.040, 0.038, 0.050]) == pytest.approx((1.0, 1.0, 1.25))


def test_lookup_tokens_are_not_charged_the_draft_models_step():
    """A row whose decoder also has a dear draft model (hybrid, or a prediction beside one)
    verifies a good lookup's tokens: only the target pass prices them."""
    dear_draft = costs(0.6, [1.0, 1.3, 1.6, 1.9, 2.2])
    free = costs(0.0, [1.0, 1.3, 1.6, 1.9, 2.2])
    policy = Priced(dear_draft)
    for _ in range(20):
        policy.update(-3, 4, 3)  # a prediction's 3-gram matches: mostly accepted
        policy.update(0, 1, 0)  # the draft model's tokens: rejected
    assert policy.next_k() == 0  # the draft model does not pay at c = 0.6
    assert policy.keep(-3, 4) == Priced(free, policy.estimates).keep(-3, 4) >= 2
    # while the draft model's own tokens are still priced with its step
    assert policy.keep(0, 4) == optimal_k(policy.gamma(0), 0.6, dear_draft.verify, 4)


def test_a_source_priced_out_by_its_prior_is_probed_now_and_then():
    """A prediction whose prior prices it out (a steep v) is still verified one token at its
    first proposal and every probe_every rounds without evidence, so a good one is found; a
    draft that would not pay even if always accepted is never tried."""
    steep = costs(0.0, [1.0, 1.6, 2.2, 2.8])  # gamma 0.5 does not pay for v(2) = 1.6
    policy = Priced(steep)
    every = policy.config.probe_every
    assert optimal_k(0.5, 0.0, steep.verify) == 0
    assert policy.keep(-4, 3) == 1  # its first proposal: a probe
    policy.update(-4, 1, 0)  # rejected
    kept = []
    for _ in range(50 * every):  # rounds without evidence, but for the probes
        kept.append(policy.keep(-4, 3))
        policy.update(-4, kept[-1], 0) if kept[-1] else policy.update(0, 0, 0)
    assert all(k <= 1 for k in kept)
    # each probe that finds it priced out doubles the wait, up to 16 times probe_every
    probes = [i for i, k in enumerate(kept) if k]
    gaps = [b - a for a, b in zip([-1] + probes, probes, strict=False)]
    assert gaps[:5] == [2 * every + 1, 4 * every + 1, 8 * every + 1, 16 * every + 1,
                        16 * every + 1]
    for _ in range(3):
        policy.update(-4, 3, 3)  # used on its merits (accepted): probed soon again
    assert policy.estimates[-4].probe_gap == every
    policy = Priced(steep)
    for _ in range(6):
        policy.update(-4, 3, 3)  # accepted: the estimate learns it pays
    assert policy.keep(-4, 3) == 3
    hopeless = Priced(costs(1.0, [1.0, 2.0, 3.0, 4.0]))
    for _ in range(3 * every):
        assert hopeless.next_k() == 0
        hopeless.update(0, 0, 0)


def test_a_draft_model_far_behind_catches_up_only_where_it_pays():
    """A draft model that has not read a long prompt (or what a prediction added) reads it
    only where what it would save over the rest of the output pays for the reading."""
    prices = dataclasses.replace(costs(0.3, [1.0, 1.05, 1.1, 1.15, 1.2]),
                                 draft_catch_up_s=0.004)  # 0.08 steps a token
    policy = AdaptiveK()
    assert policy.catch_up_pays(prices, lag=5, remaining=1)  # a round's own lag: always
    assert policy.catch_up_pays(prices, lag=100, remaining=256)  # a code prompt: 8 steps
    assert not policy.catch_up_pays(prices, lag=3000, remaining=128)  # a RAG prompt: 240
    assert not policy.catch_up_pays(prices, lag=100, remaining=10)  # nearly done
    predicted = AdaptiveK.for_request(policy.config, predicted=True)
    assert not predicted.catch_up_pays(prices, lag=300, remaining=256)
    for _ in range(20):
        predicted.update(0, 0, 0)  # rounds the prediction left to the draft model
    assert predicted.catch_up_pays(prices, lag=300, remaining=256)
    free = dataclasses.replace(prices, draft_catch_up_s=0.0)  # nothing measured: no limit
    assert AdaptiveK().catch_up_pays(free, lag=3000, remaining=8)


def test_a_draft_model_pays_for_reading_what_other_sources_write():
    """Once caught up, a draft model still reads every token a prediction or a lookup writes
    before it drafts again: a row whose prediction writes most of the output leaves a long
    prompt unread even where the draft model's own rounds would save more than the prompt
    costs to read, and a row the draft model drafts alone reads it."""
    prices = dataclasses.replace(costs(0.3, [1.0, 1.05, 1.1, 1.15, 1.2]),
                                 draft_catch_up_s=0.002)  # 0.04 steps a token
    alone = AdaptiveK()
    predicted = AdaptiveK()
    for _ in range(30):
        predicted.update(-16, 16, 16)  # the prediction writes 17 tokens a round
        predicted.update(0, 0, 0)  # a round left to the draft model writes 1
    share = predicted.model_rounds.gamma  # by tokens: ~1 in 18, and the prior's pull
    assert 0.03 < share < 0.15
    assert alone.catch_up_pays(prices, lag=215, remaining=512)
    assert not predicted.catch_up_pays(prices, lag=215, remaining=512)
    # without the reading to come, the saving would have paid for the prompt (8.6 steps)
    gamma = predicted.gamma(0)
    k = optimal_k(gamma, prices.draft_step, prices.verify, prices.k_max)
    rate = expected_speedup(gamma, k, prices.draft_step, prices.v(k + 1))
    assert share * 512 * (1 - 1 / rate) > prices.catch_up(215)


def test_a_catch_up_is_priced_by_the_draft_models_acceptance_over_many_rounds():
    """Reading what it fell behind by is paid once and repaid over the rest of the output, so
    it is priced by the draft model's acceptance over its last ~50 rounds, not by the last few
    rounds K follows: a model that met a few hard tokens after 40 good rounds still catches
    up (priced by the last few rounds it would not, and would never draft again in the row),
    and one rejected all along does not."""
    prices = dataclasses.replace(costs(0.3, [1.0, 1.2, 1.4, 1.6, 1.8]),
                                 draft_catch_up_s=0.004)  # 0.08 steps a token
    policy = AdaptiveK()
    for _ in range(40):
        policy.update(0, 3, 3)
    for _ in range(8):
        policy.update(0, 1, 0)  # a hard stretch: the first token rejected
    assert policy.gamma(0) < 0.6 < 0.85 < policy.lasting.gamma
    assert policy.catch_up_pays(prices, lag=80, remaining=200)
    gamma = policy.gamma(0)  # priced by the last few rounds alone
    k = optimal_k(gamma, prices.draft_step, prices.verify, prices.k_max)
    rate = expected_speedup(gamma, k, prices.draft_step, prices.v(k + 1))
    assert 200 * (1 - 1 / rate) < prices.catch_up(80)
    rejected = AdaptiveK()
    for _ in range(48):
        rejected.update(0, 1, 0)
    assert not rejected.catch_up_pays(prices, lag=80, remaining=200)


def test_a_few_rounds_a_prediction_leaves_do_not_call_the_draft_model_back():
    """The draft model's share of the output is taken over many rounds: a changed line of a
    code edit (a few rounds the prediction has nothing for) after a long copied stretch does
    not make it read the ~80 tokens the prediction wrote since it last drafted; a long
    stretch of such rounds does."""
    prices = dataclasses.replace(costs(0.25, [1.0, 1.05, 1.18, 1.3, 1.38]),
                                 draft_catch_up_s=0.0019, target_step_s=0.0335)
    predicted = AdaptiveK.for_request(DecodeConfig(), predicted=True)
    for _ in range(40):
        predicted.update(-32, 6, 6)  # the prediction writes 7 tokens a round
    for _ in range(8):
        predicted.update(0, 0, 0)  # a changed line: rounds left to the draft model
    assert not predicted.catch_up_pays(prices, lag=80, remaining=400)
    for _ in range(60):
        predicted.update(0, 0, 0)
    assert predicted.catch_up_pays(prices, lag=80, remaining=400)


def test_a_batch_catches_up_by_what_its_draft_model_has_shown_not_by_the_prior():
    """In a batch every lagging row's draft model catches up at once, at the batch's prices
    and margin. One whose rounds priced it out (acceptance ~2/3, where a batch of 4 needs
    ~0.76 to beat its 1.10 margin) stays out however long it sits idle, though its estimate
    drifts back toward the 0.8 prior meanwhile, which alone would call it back (and did, every
    ~15 rounds, catching up at a loss); a draft model whose rounds were good, or one not yet
    tried, catches up."""
    batch4 = dataclasses.replace(costs(0.39, [1.0, 1.22, 1.75, 2.17, 2.65]),
                                 target_step_s=0.056, draft_catch_up_s=0.00184)
    margin = DecodeConfig().batch_margin
    weak, strong = AdaptiveK(), AdaptiveK()
    for i in range(12):
        weak.update(0, 1, int(i % 3 != 0))  # two of three accepted
        strong.update(0, 1, int(i % 10 != 0))
    for _ in range(20):  # rounds the batch sat out (lookups or nothing drafted)
        weak.update(0, 0, 0)
        strong.update(0, 0, 0)
    assert weak.gamma(0) > 0.75 > weak._estimate(0).observed  # drifted, against its evidence
    assert weak.catch_up_pays(batch4, lag=20, remaining=100)  # as a lone row would: back in
    assert not weak.catch_up_pays(batch4, lag=20, remaining=100, batch_margin=margin)
    assert strong.catch_up_pays(batch4, lag=20, remaining=100, batch_margin=margin)
    assert AdaptiveK().catch_up_pays(batch4, lag=80, remaining=128, batch_margin=margin)
    assert weak.catch_up_pays(batch4, lag=5, remaining=100, batch_margin=margin)  # a round's


def test_a_batch_row_catches_up_only_for_its_own_share_of_the_saving():
    """The whole batch waits while one row's draft model reads its prompt, but drafting saves
    only that row's share of the batch's passes: a prompt a lone row would read pays in a batch
    of 4 only where a quarter of the saving beats the reading."""
    batch4 = dataclasses.replace(costs(0.24, [1.0, 1.28, 1.85, 2.31, 2.76]),
                                 target_step_s=0.0487, draft_catch_up_s=0.00156)
    margin = DecodeConfig().batch_margin
    policy = AdaptiveK()  # the prior: 0.8, K 1 at these prices, 1.18x
    reading = batch4.catch_up(100)  # 3.2 steps
    rate = expected_speedup(0.8, 1, batch4.draft_step, batch4.v(2))
    assert 64 * (1 - 1 / rate) / 4 < reading < 64 * (1 - 1 / rate)
    assert policy.catch_up_pays(batch4, lag=100, remaining=64, batch_margin=margin)
    assert not policy.catch_up_pays(batch4, lag=100, remaining=64, batch_margin=margin,
                                    rows=4)
    assert policy.catch_up_pays(batch4, lag=100, remaining=512, batch_margin=margin, rows=4)
    assert policy.catch_up_pays(batch4, lag=3, remaining=8, batch_margin=margin, rows=4)


def test_a_new_request_starts_from_what_earlier_requests_learnt_of_a_source():
    """Greedy requests of one decoder share acceptance by source: a new request's estimate of
    a lookup that was accepted whole before starts high, and one that never was starts low,
    instead of both at the fixed prior."""
    shared = {}
    first = AdaptiveK.for_request(AdaptiveK().config, shared=shared)
    for _ in range(30):
        first.update(5, 8, 8)  # five-token matches: accepted whole
        first.update(1, 4, 0)  # one-token matches: rejected
    second = AdaptiveK.for_request(first.config, shared=shared)
    assert second.gamma(5) > 0.9 and second.gamma(1) < 0.2
    assert AdaptiveK.for_request(first.config).gamma(5) == 0.5  # unshared: the prior
