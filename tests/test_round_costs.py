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
    for _ in range(40):
        planner.observe(plan, 1, STEP_S, 0, 0.0, 0)
        planner.observe(plan, 2, 1.23 * STEP_S, 1, 0.45 * STEP_S, 1)
    assert planner.plan([greedy]).rows[0].k == 0
    sampled_plan = planner.plan([sampled])
    assert sampled_plan.measured is None and sampled_plan.rows[0].k >= 1
    unobserved = RoundPlanner(greedy.drafter, DecodeConfig(), lambda rows: MEASURED)
    assert unobserved.plan([greedy]).rows[0].k == 1


def test_only_a_feature_draft_is_priced_by_its_rounds():
    """A feature head sits in cache through a tight loop of its own steps and not in rounds; a
    draft model streams its weights either way and keeps its measured c, as does a decoder
    handed a cost model."""
    def table(drafter, one_row=None):
        return CostTable(None, drafter, DecodeConfig(), one_row=one_row)

    feature = FeatureDrafter.__new__(FeatureDrafter)
    assert table(feature).observed is not None
    assert table(HybridDrafter(feature)).observed is not None
    assert table(feature, one_row=MEASURED).observed is None
    assert table(HybridDrafter(ModelDrafter.__new__(ModelDrafter))).observed is None
    assert table(NgramDrafter()).observed is None
    assert table(None).observed is None
