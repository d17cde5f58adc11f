"""Engine level: the joint law of the first two generated tokens equals the target's exact joint.

A tiny target over 8 tokens; the draft is a noisy copy (it agrees often, not always). The exact
joint p(t1, t2 | prompt) comes from the target alone: 1 + 8 forward passes. The engine runs with
N seeds; a chi-square test over the 64 cells (cells with expected count < 5 merged) must not
reject, while the same test must reject an engine whose verifier accepts every draft token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import (
    always_accept_rows,
    chi2_pvalue,
    exact_joint,
    first_two_counts,
    perturbed_copy,
    replay_verification,
    tiny_llama,
)

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import ModelDrafter, NgramDrafter

V = 8
PROMPT = [1, 2, 3, 1, 2]  # repeats, so the n-gram drafter has something to propose
N = 3000


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, seed=3, init=0.5)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, noise=0.2, seed=0)


def sampled_joint(decoder: SpeculativeDecoder, params: SamplingParams) -> torch.Tensor:
    return first_two_counts(decoder, PROMPT, V, params, N)


SETTINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k 5, top-p 0.9, temperature 0.8": SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
    "min-p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_draft_model_engine_matches_target_joint(name, target, draft):
    params = SETTINGS[name]
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V), k=3)
    assert chi2_pvalue(sampled_joint(decoder, params), exact_joint(target, PROMPT, params)) > 1e-3


def test_ngram_engine_matches_target_joint(target):
    params = SETTINGS["temperature 1"]
    decoder = SpeculativeDecoder(target, None, NgramDrafter(), k=3)
    assert chi2_pvalue(sampled_joint(decoder, params), exact_joint(target, PROMPT, params)) > 1e-3


def test_negative_control_always_accept_is_detected(target, draft, monkeypatch):
    """Power: the draft's joint is far from the target's, and an engine that skips the
    rejection step fails the same test."""
    params = SETTINGS["temperature 1"]
    target_joint = exact_joint(target, PROMPT, params)
    draft_joint = exact_joint(draft, PROMPT, params)
    assert 0.5 * (target_joint - draft_joint).abs().sum() > 0.1
    monkeypatch.setattr("verispec.verify.drafts.verify_rows", always_accept_rows)
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V), k=3)
    assert chi2_pvalue(sampled_joint(decoder, params), target_joint) < 1e-6


def test_identical_draft_is_always_accepted(target):
    decoder = SpeculativeDecoder(target, None, ModelDrafter(target, V), k=4)
    out = decoder.generate(PROMPT, SamplingParams(max_new_tokens=40, temperature=1.0, seed=0,
                                                  ignore_eos=True))
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.tokens_per_forward == pytest.approx(40 / 8)  # 5 tokens per round


def test_a_seeded_output_is_what_the_reference_verifier_draws_round_by_round(target, draft,
                                                                           monkeypatch):
    """Every round's tokens are what the padded reference verification (block, the default)
    gives on that round's draft and target rows from the row's generator as it stood, the
    engine draws exactly the reference's draws, and the output is those tokens in order. A
    second decoder given the same seed after other requests reproduces it."""
    replays = replay_verification(monkeypatch)
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V), k=3)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=123, ignore_eos=True)
    out = decoder.generate(PROMPT, params).token_ids
    assert len(replays) > 1 and all(engine == reference and same_draws
                                    for engine, reference, same_draws in replays)
    emitted = [token for engine, _, _ in replays for token in engine]
    assert emitted[:len(out)] == out and len(out) == 30 and len(emitted) - len(out) <= 3
    assert sum(len(engine) - 1 for engine, _, _ in replays) > 0  # drafts were accepted
    other = SpeculativeDecoder(target, None, ModelDrafter(draft, V), k=3)
    other.generate(PROMPT, dataclasses.replace(params, seed=5))
    assert other.generate(PROMPT, params).token_ids == out
