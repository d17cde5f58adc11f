"""The round planner's choice between sources on synthetic prices: a lookup is used only where
it is worth more than the draft model's proposal this round."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verispec.config import DecodeConfig
from verispec.costs import CostModel
from verispec.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from verispec.drafters.drafter import Draft
from verispec.planner import RoundPlanner, RowPlan
from verispec.policy import AcceptanceEstimate, AdaptiveK, FixedK

# a cheap pass (v(9) = 1.4) and a draft model at a quarter of a target step
PRICES = CostModel(draft_step=0.25, verify=(1.0, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.4),
                   target_step_s=0.03)


def policy_with(model_gamma: float, lookup_gamma: float, source: int = 2) -> AdaptiveK:
    """A policy whose acceptance estimates are settled at these rates (much evidence)."""
    policy = AdaptiveK(DecodeConfig())
    policy.estimates[0] = settled(model_gamma)
    policy.estimates[source] = settled(lookup_gamma)
    return policy


def settled(gamma: float) -> AcceptanceEstimate:
    return AcceptanceEstimate(gamma, accepted_w=gamma * 1e6, checked_w=1e6)


def lookup(source: int, length: int = 8) -> Draft:
    return Draft(torch.arange(length), None, source=source)


def test_a_lookup_accepted_less_often_than_the_model_gives_way_to_it():
    weak = policy_with(model_gamma=0.9, lookup_gamma=0.3)
    assert weak.gamma(0) > 0.85 and weak.gamma(2) < 0.35
    kept = weak.keep(PRICES, 1, 2, 8)
    assert kept > 0  # free tokens still pay on their own
    assert not weak.lookup_beats_model(PRICES, 1, 2, kept)
    strong = policy_with(model_gamma=0.6, lookup_gamma=0.95)
    assert strong.lookup_beats_model(PRICES, 1, 2, strong.keep(PRICES, 1, 2, 8))


def test_a_kind_not_yet_tried_is_tried_before_it_is_judged():
    """A prediction or lookup kind the request has no evidence for is verified, not priced out
    by its prior against a well-measured draft model; after it has been tried and found weak
    it gives way, until its next probe."""
    policy = AdaptiveK(DecodeConfig())
    policy.estimates[0] = settled(0.9)
    assert policy.lookup_beats_model(PRICES, 1, -16, 4)  # untried: tried
    for _ in range(3):
        policy.update(-16, 4, 0)  # tried, rejected at once
    assert not policy.lookup_beats_model(PRICES, 1, -16, 4)
    for _ in range(DecodeConfig().probe_every):
        policy.update(0, 4, 3)  # rounds of the model: the kind goes without evidence
    assert policy.lookup_beats_model(PRICES, 1, -16, 4)  # its probe


def test_a_lookup_is_kept_where_the_model_would_not_draft():
    weak = policy_with(model_gamma=0.9, lookup_gamma=0.3)
    dear = CostModel(draft_step=3.0, verify=PRICES.verify, target_step_s=0.03)
    assert weak.lookup_beats_model(dear, 1, 2, 2)  # the model's best K is 0 at these prices


def test_the_planner_hands_a_weak_lookup_back_to_the_model_only_when_the_model_drafts():
    planner = RoundPlanner(None, DecodeConfig(), lambda rows: PRICES)
    hybrid = HybridDrafter(ModelDrafter.__new__(ModelDrafter))  # no weights needed here
    request = SimpleNamespace(policy=policy_with(model_gamma=0.9, lookup_gamma=0.3),
                              drafter=hybrid)
    drafting = RowPlan(k=4, free_k=8, width=1, prices=PRICES)
    idle = RowPlan(k=0, free_k=8, width=1, prices=PRICES)
    assert planner.lookup_keep(request, drafting)(lookup(2)) == 0
    assert planner.lookup_keep(request, idle)(lookup(2)) > 0
    lookup_only = SimpleNamespace(policy=request.policy, drafter=NgramDrafter())
    assert planner.lookup_keep(lookup_only, drafting)(lookup(2)) > 0  # nothing to give way to
    fixed = SimpleNamespace(policy=FixedK(4), drafter=hybrid)  # unpriced: keeps what it got
    assert planner.lookup_keep(fixed, RowPlan(4, 4, 1, None))(lookup(2, 4)) == 4
