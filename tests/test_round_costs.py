"""Prices corrected by what rounds take (verispec.round_costs): a lone greedy row's draft step
is priced by what its draft model's proposals took once it has enough of them, and drafting the
measured model says pays, but the rounds say does not, stops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec.config import DecodeConfig
from verispec.cost_table import CostTable
from verispec.costs import CostModel
from verispec.drafters import FeatureDrafter, HybridDrafter, ModelDrafter, NgramDrafter
from verispec.params import SamplingParams
from verispec.planner import RoundPlanner
from verispec.policy import AcceptanceEstimate, AdaptiveK
from verispec.request import Request
from verispec.round_costs import ObservedCosts
from verispec.stats import StatsRecorder
from verispec.text import TextStream

# A tight loop's prices: a second position nearly free, a draft token at a quarter of a step.
MEASURED = CostModel(draft_step=0.25, verify=(1.0, 1.05, 1.18, 1.3, 1.45),
                     target_step_s=0.0035)
STEP_S = 0.004  # what a plain round takes inside decoding


def rounds_like(observed: ObservedCosts, rounds: int, v2: float, c: float) -> None:
    """Plain rounds and K = 1 rounds that take v2 steps for their pass and c for the draft."""
    for _ in range(rounds):
        observed.record(MEASURED, 1, STEP_S)
        observed.record(MEASURED, 2, v2 * STEP_S, draft_depth=1, draft_s=c * STEP_S)


def test_the_draft_step_is_corrected_by_what_proposals_take():
    observed = ObservedCosts()
    rounds_like(observed, 3, v2=1.23, c=0.45)
    assert observed.corrected(MEASURED) == MEASURED  # too few rounds: as measured
    rounds_like(observed, 30, v2=1.23, c=0.45)
    prices = observed.corrected(MEASURED)
    assert prices.draft_step == pytest.approx(0.45)
    assert prices.verify == MEASURED.verify  # passes as measured
    assert prices.target_step_s == MEASURED.target_step_s
    for _ in range(40):  # a tree of depth 3 priced 3 c, its proposal taking 3 * 0.3 steps
        observed.record(MEASURED, 1, STEP_S)
        observed.record(MEASURED, 4, 1.4 * STEP_S, draft_depth=3, draft_s=0.9 * STEP_S)
    assert observed.corrected(MEASURED).draft_step == pytest.approx(0.30)


def test_catching_up_on_what_lookups_wrote_is_not_charged_to_the_draft_step():
    """A draft model 11 tokens behind reads 10 before its step: priced by the model's
    catch-up rate (here 0.05 steps a token), not folded into c."""
    reading = dataclasses.replace(MEASURED, draft_catch_up_s=0.05 * MEASURED.target_step_s)
    observed = ObservedCosts()
    for _ in range(20):
        observed.record(reading, 1, STEP_S)
        observed.record(reading, 2, 1.1 * STEP_S, draft_depth=1,
                        draft_s=(0.25 + 0.5) * STEP_S, lag=11)
    assert observed.corrected(reading).draft_step == pytest.approx(0.25)


def test_both_contexts_are_corrected_and_a_spike_moves_nothing():
    long = CostModel(draft_step=0.25, verify=MEASURED.verify, target_step_s=0.0035,
                     long_verify=(1.0, 1.1, 1.3, 1.5, 1.7), long_draft_step=0.15)
    observed = ObservedCosts()
    rounds_like(observed, 40, v2=1.10, c=0.50)
    prices = observed.corrected(long)
    assert prices.draft_step == pytest.approx(0.50)
    assert prices.long_draft_step == pytest.approx(0.30)
    assert prices.long_verify == long.long_verify
    observed.record(MEASURED, 2, 100 * STEP_S, draft_depth=1, draft_s=100 * STEP_S)
    observed.record(MEASURED, 1, 100 * STEP_S)
    assert observed.corrected(long) == prices


def test_rounds_before_any_plain_round_teach_nothing():
    observed = ObservedCosts()
    for _ in range(20):
        observed.record(MEASURED, 3, 2 * STEP_S, draft_depth=2, draft_s=STEP_S)
    assert observed.corrected(MEASURED) == MEASURED
    with pytest.raises(ValueError):
        observed.record(MEASURED, 0, STEP_S)
    with pytest.raises(ValueError):
        ObservedCosts(window=4, min_rounds=8)


def lone_request(greedy: bool = True) -> Request:
    policy = AdaptiveK(DecodeConfig())
    gamma = 0.5  # settled: K = 1 pays at the measured c (1.5 / 1.3), not at 0.45 (1.5 / 1.5)
    policy.estimates[0] = AcceptanceEstimate(gamma, accepted_w=gamma * 1e6, checked_w=1e6)
    params = SamplingParams(max_new_tokens=64) if greedy else \
        SamplingParams(max_new_tokens=64, temperature=1.0, seed=0)
    request = Request(0, torch.arange(20), params, policy, None, StatsRecorder(k="auto"),
                      TextStream(None, ()), budget=64)
    request.drafter = CaughtUp()
    return request


class CaughtUp:
    """A draft model that has read its row's history (priced only: nothing is drafted)."""

    def unread(self, history: torch.Tensor) -> int:
        return 0


def test_a_lone_greedy_row_stops_drafting_where_its_rounds_say_it_loses():
    """K = 1 at the measured model's prices (1.15x), none once the rounds have shown what a
    draft really takes (1.5 / 1.5 = 1.0x); a sampled row keeps the measured prices, so its
    draws never depend on how long earlier rounds took."""
    observed = ObservedCosts()
    greedy, sampled = lone_request(), lone_request(greedy=False)
    planner = RoundPlanner(greedy.drafter, DecodeConfig(), lambda rows: MEASURED, observed)
    assert planner.plan([greedy]).rows[0].k == 1
    plan = planner.plan([greedy])
    assert plan.measured is not None
    for _ in range(40):  # (its rounds give more tokens a second than plain ones: 2 / 1.68)
        planner.observe(plan, 1, STEP_S, 0, 0.0, 0, STEP_S, 1)
        planner.observe(plan, 2, 1.23 * STEP_S, 1, 0.45 * STEP_S, 1, 1.68 * STEP_S, 2)
    assert not observed.at_a_loss()
    assert planner.plan([greedy]).rows[0].k == 0
    sampled_plan = planner.plan([sampled])
    assert sampled_plan.measured is None and sampled_plan.rows[0].k >= 1
    unobserved = RoundPlanner(greedy.drafter, DecodeConfig(), lambda rows: MEASURED)
    assert unobserved.plan([greedy]).rows[0].k == 1


def test_only_a_feature_draft_is_priced_by_its_rounds():
    """A feature head sits in cache through a tight loop of its own steps and not in rounds; a
    draft model streams its weights either way and keeps its measured c. Both are watched for
    drafting at a loss; lookups alone, plain decoding and a decoder handed a cost model are
    not."""
    def table(drafter, one_row=None):
        return CostTable(None, drafter, DecodeConfig(), one_row=one_row)

    feature = FeatureDrafter.__new__(FeatureDrafter)
    feature.model = object()  # (a feature drafter that follows its target has one)
    model = ModelDrafter.__new__(ModelDrafter)
    assert table(feature).observed.corrects_draft
    assert table(HybridDrafter(feature)).observed.corrects_draft
    assert table(feature, one_row=MEASURED).observed is None
    assert not table(model).observed.corrects_draft
    assert not table(HybridDrafter(model)).observed.corrects_draft
    assert table(NgramDrafter()).observed is None
    assert table(None).observed is None
    observed = ObservedCosts(corrects_draft=False)
    rounds_like(observed, 40, v2=1.23, c=0.45)
    assert observed.corrected(MEASURED) == MEASURED


def rounds_of(observed: ObservedCosts, drafted: bool, count: int, seconds: float,
              tokens: int) -> None:
    for _ in range(count):
        observed.record_round(drafted, seconds, tokens)


def test_a_draft_model_whose_rounds_give_fewer_tokens_a_second_than_plain_ones_sits_out():
    """Plain rounds: a token in a step. Draft-model rounds: 1.5 tokens in 1.75 steps, at a
    loss; it sits out all but one round in probe_every. Too few rounds of either kind decide
    nothing; rounds that gain more than they take are no loss."""
    observed = ObservedCosts()
    rounds_of(observed, True, 20, 1.5 * STEP_S, 1)
    assert not observed.at_a_loss()  # no plain rounds to compare with yet
    rounds_of(observed, False, 7, STEP_S, 1)
    assert not observed.at_a_loss()
    rounds_of(observed, False, 1, STEP_S, 1)
    assert observed.at_a_loss()
    observed = ObservedCosts()
    rounds_of(observed, False, 30, STEP_S, 1)
    for _ in range(30):
        observed.record_round(True, 1.75 * STEP_S, 1)
        observed.record_round(True, 1.75 * STEP_S, 2)
    assert observed.rate(True) == pytest.approx(1.5 / (1.75 * STEP_S), rel=0.05)
    assert observed.at_a_loss()
    asked = [observed.holds_back() for _ in range(3 * observed.probe_every)]
    assert asked.count(False) == 3 and asked[observed.probe_every - 1] is False
    gaining = ObservedCosts()
    rounds_of(gaining, False, 30, STEP_S, 1)
    rounds_of(gaining, True, 30, 1.2 * STEP_S, 2)
    assert not gaining.at_a_loss() and not any(gaining.holds_back() for _ in range(40))
    with pytest.raises(ValueError):
        observed.record_round(False, 0.0, 1)
    with pytest.raises(ValueError):
        observed.record_round(True, STEP_S, 0)
    with pytest.raises(ValueError):
        ObservedCosts(decay=1.0)


def test_a_draft_model_held_back_drafts_again_once_its_probes_gain():
    """Its running rate forgets its older rounds: probes on text it now drafts well (3 tokens
    in a step and a half) bring it back within a dozen of them."""
    observed = ObservedCosts()
    rounds_of(observed, False, 30, STEP_S, 1)
    rounds_of(observed, True, 30, 1.5 * STEP_S, 1)
    assert observed.at_a_loss()
    rounds_of(observed, True, 12, 1.5 * STEP_S, 3)
    assert not observed.at_a_loss() and not observed.holds_back()


def test_a_new_row_is_judged_on_its_own_drafting_rounds():
    """What a draft model's rounds give is the text's: a row that starts after rows at a loss
    is not held back until its own rounds lose; plain rounds' rate is the machine's and stays.
    A feature draft's rounds cost more than its prices say on any text: its rate carries."""
    observed = ObservedCosts(corrects_draft=False)
    rounds_of(observed, False, 30, STEP_S, 1)
    rounds_of(observed, True, 30, 1.5 * STEP_S, 1)
    assert observed.at_a_loss() and observed.holds_back()
    observed.new_row()
    assert not observed.at_a_loss() and not observed.holds_back()
    assert observed.rate(False) == pytest.approx(1 / STEP_S)
    rounds_of(observed, True, observed.min_rounds, 1.5 * STEP_S, 1)
    assert observed.at_a_loss()
    feature = ObservedCosts(corrects_draft=True)
    rounds_of(feature, False, 30, STEP_S, 1)
    rounds_of(feature, True, 30, 1.5 * STEP_S, 1)
    feature.new_row()
    assert feature.at_a_loss()


def test_the_planner_holds_back_a_losing_draft_model_for_a_lone_greedy_row_only():
    """The draft model priced to pay (K = 1 at the measured prices) sits out once its rounds
    lose, but for its probes; lookups are still asked for; a sampled row is planned at the
    measured prices whatever the rounds took."""
    observed = ObservedCosts(corrects_draft=False)  # a draft model's
    greedy, sampled = lone_request(), lone_request(greedy=False)
    planner = RoundPlanner(greedy.drafter, DecodeConfig(), lambda rows: MEASURED, observed)
    plan = planner.plan([greedy])
    assert plan.rows[0].k == 1
    for _ in range(30):
        planner.observe(plan, 1, STEP_S, 0, 0.0, 0, STEP_S, 1)
        planner.observe(plan, 2, 1.1 * STEP_S, 1, 0.25 * STEP_S, 1, 1.5 * STEP_S, 1)
        planner.observe(plan, 3, 1.2 * STEP_S, 0, 0.0, 0, 1.3 * STEP_S, 2)  # a lookup's
    assert observed.plain.rounds == 30 and observed.drafting.rounds == 30  # (not lookups)
    # a round that caught the draft model up on a prompt is not its steady rate
    planner.observe(plan, 2, 1.1 * STEP_S, 1, 20 * STEP_S, 300, 22 * STEP_S, 2)
    assert observed.drafting.rounds == 30
    assert observed.at_a_loss()
    held = [planner.plan([greedy]).rows[0] for _ in range(observed.probe_every - 1)]
    assert all(row.k == 0 and row.free_k == plan.rows[0].free_k for row in held)
    assert planner.plan([greedy]).rows[0].k == 1  # the probe
    # another row's draft model is judged on its own rounds: it drafts from its first round
    other = lone_request()
    assert planner.plan([other]).rows[0].k == 1 and not observed.at_a_loss()
    assert observed.plain.rounds == 30  # the machine's plain rounds carry over
    sampled_plan = planner.plan([sampled])
    assert sampled_plan.measured is None and sampled_plan.rows[0].k >= 1


def test_a_row_back_alone_after_a_batch_keeps_its_record():
    """The record restarts for a lone row other than the last one planned alone: a row that
    shared rounds with another and runs alone again is still held back by its own losing
    rounds; the other row, alone next, is judged afresh."""
    observed = ObservedCosts(corrects_draft=False)
    first, second = lone_request(), lone_request()
    planner = RoundPlanner(first.drafter, DecodeConfig(), lambda rows: MEASURED, observed)
    plan = planner.plan([first])
    for _ in range(30):
        planner.observe(plan, 1, STEP_S, 0, 0.0, 0, STEP_S, 1)
        planner.observe(plan, 2, 1.1 * STEP_S, 1, 0.25 * STEP_S, 1, 1.5 * STEP_S, 1)
    assert observed.at_a_loss()
    planner.plan([first, second])
    assert observed.at_a_loss()
    assert planner.plan([first]).rows[0].k == 0  # held back by its own rounds
    assert planner.plan([second]).rows[0].k == 1 and not observed.at_a_loss()
