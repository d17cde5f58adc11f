"""Engine level, per verification mode: block and token-wise verification keep the target's
law; invariant sampling gives plain sampling's very tokens for a seed, whatever the drafter,
K or batch; each with a negative control that must fail."""

from __future__ import annotations

import pytest
import torch
from conftest import chi2_pvalue, exact_joint, first_two_counts, perturbed_copy, tiny_llama

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from verispec.verify import RowVerification, verify_rows

V = 8
PROMPT = [1, 2, 3, 1, 2]
N = 3000


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, seed=3, init=0.5)  # as test_engine_distribution's


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, noise=0.2, seed=0)


def sampled_joint(decoder: SpeculativeDecoder, params: SamplingParams, verify: str
                  ) -> torch.Tensor:
    return first_two_counts(decoder, PROMPT, V, params, N, verify=verify)


SETTINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k 5, top-p 0.9, temperature 0.8": SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("verify", ["token", "invariant"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_mode_keeps_the_targets_joint(verify, name, target, draft):
    """(block, the default, runs in test_engine_distribution's joint tests)"""
    params = SETTINGS[name]
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V), k=3)
    counts = sampled_joint(decoder, params, verify)
    assert chi2_pvalue(counts, exact_joint(target, PROMPT, params)) > 1e-3


def test_negative_control_invariant_noise_not_keyed_by_position_is_detected(target, draft,
                                                                             monkeypatch):
    """Invariant verification whose noise is keyed by the position within the round instead
    of the absolute position: every round draws with the same noise, the two tokens are
    coupled, and the same test must reject it."""
    def unkeyed(draft_tokens, cu, draft_probs, target_probs, rows):
        rows = [RowVerification(r.method, r.generator, r.seed, 0, r.draft_has_probs)
                for r in rows]
        return verify_rows(draft_tokens, cu, draft_probs, target_probs, rows)

    monkeypatch.setattr("verispec.verify.drafts.verify_rows", unkeyed)
    params = SETTINGS["temperature 1"]
    decoder = SpeculativeDecoder(target, None, NgramDrafter(), k=3)
    counts = sampled_joint(decoder, params, "invariant")
    assert chi2_pvalue(counts, exact_joint(target, PROMPT, params)) < 1e-6


def test_block_accepts_at_least_as_many_tokens_as_token_wise(target, draft):
    """Same drafts, same seeds: block verification's accepted tokens are never fewer on the
    whole (its expected accepted length is at least token-wise's for every draft)."""
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V), k=4)
    accepted = {}
    for verify in ("token", "block"):
        total = 0
        for seed in range(300):
            out = decoder.generate(PROMPT, SamplingParams(
                max_new_tokens=5, temperature=1.0, seed=seed, ignore_eos=True, verify=verify))
            total += out.stats.accepted
        accepted[verify] = total
    assert accepted["block"] >= 0.97 * accepted["token"]  # never fewer, up to sampling noise
    assert accepted["token"] > 0


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_invariant_sampling_gives_plain_samplings_tokens(drafter, target, draft):
    """For 50 seeds the speculative output equals plain sampling's token for token, alone and
    as a row of batches of 4 and 16 with other (greedy and sampled) rows present, at K = 2, 4
    and auto-free lookups."""
    plain = SpeculativeDecoder(target, None, None)
    make = {"model": lambda: ModelDrafter(draft, V), "ngram": NgramDrafter,
            "hybrid": lambda: HybridDrafter(ModelDrafter(draft, V))}[drafter]
    seeds = range(50)

    def request(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=seed,
                              ignore_eos=True, verify="invariant")

    expected = [plain.generate(PROMPT, request(s)).token_ids for s in seeds]
    assert len({tuple(e) for e in expected}) > 10  # the seeds do draw different outputs
    for k in (2, 4):
        spec = SpeculativeDecoder(target, None, make(), k=k)
        alone = [spec.generate(PROMPT, request(s)) for s in seeds]
        assert [o.token_ids for o in alone] == expected
        assert sum(o.stats.accepted for o in alone) > 0  # the drafts were really used
        others = [([4, 5, 6], SamplingParams(max_new_tokens=7, ignore_eos=True)),
                  ([7, 7, 1], SamplingParams(max_new_tokens=5, temperature=1.0, seed=9,
                                             ignore_eos=True))]
        for batch in (4, 16):
            for start in range(0, len(seeds), batch - len(others)):
                chunk = list(seeds)[start: start + batch - len(others)]
                outs = spec.generate([p for p, _ in others] + [PROMPT] * len(chunk),
                                     [sp for _, sp in others] + [request(s) for s in chunk])
                assert [o.token_ids for o in outs[len(others):]] == \
                    [expected[s] for s in chunk]


def test_invariant_needs_a_seed():
    with pytest.raises(ValueError, match="needs a seed"):
        SamplingParams(temperature=1.0, verify="invariant")
    with pytest.raises(ValueError, match="verify must be one of"):
        SamplingParams(temperature=1.0, verify="fast")


def test_stats_say_which_procedure_ran(target, draft):
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V), k=2)
    for params, name in ((SamplingParams(max_new_tokens=4), "greedy"),
                         (SamplingParams(max_new_tokens=4, temperature=1.0, seed=1), "block"),
                         (SamplingParams(max_new_tokens=4, temperature=1.0, seed=1,
                                         verify="token"), "token"),
                         (SamplingParams(max_new_tokens=4, temperature=1.0, seed=1,
                                         verify="invariant"), "invariant")):
        assert decoder.generate(PROMPT, params).stats.verify == name
