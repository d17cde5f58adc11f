"""Predicted Outputs: a prediction is a draft source like any lookup: greedy output is the same
with a matching, a partly matching or an unrelated prediction, sampled output keeps the
target's law (with a negative control), and the accepted/rejected counts add up."""

from __future__ import annotations

import pytest
import torch
from conftest import always_accept_rows, chi2_pvalue, exact_joint, first_two_counts, tiny_llama

from verispec import SamplingParams, SpeculativeDecoder
from verispec import scheduler as scheduler_module
from verispec.drafters import NgramDrafter
from verispec.drafters.prediction import PredictionLookup

PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)
PROMPT = "rewrite: the cat sat on the mat"


def test_the_lookup_proposes_the_predictions_continuation():
    lookup = PredictionLookup(2, torch.tensor([5, 6, 7, 8]))
    draft = lookup.propose(torch.tensor([1, 2, 5, 6]), 2)
    assert draft.tokens.tolist() == [7, 8] and draft.source == -2
    assert len(lookup.propose(torch.tensor([1, 2, 9, 9]), 2)) == 0  # no match in it
    assert lookup.propose(torch.tensor([1, 2, 5, 6]), 5).tokens.tolist() == [7, 8]  # its end


def test_the_lookup_follows_a_file_that_repeats_itself_in_order():
    """Where the output's n-gram occurs more than once in the prediction, the occurrence
    nearest after where the output last copied from is followed; after the output departs
    (a changed line) and comes back, the proposals pick the prediction up again."""
    line, other = [7, 8, 9], [4, 4]
    prediction = torch.tensor(line + [1] + line + [2] + line + [3])  # three repeated lines
    lookup = PredictionLookup(1, prediction)
    assert lookup.propose(torch.tensor([0]), 3).tokens.tolist() == [7, 8, 9]  # its start
    assert lookup.propose(torch.tensor([0] + line + [1] + line), 1).tokens.tolist() == [2]
    assert lookup.propose(torch.tensor([0] + line + [1] + line + [2] + line), 1
                          ).tokens.tolist() == [3]  # not [1] or [2]: in order
    lookup = PredictionLookup(1, prediction)
    departed = [0] + line + [1] + other + [5]  # the second line rewritten
    assert len(lookup.propose(torch.tensor(departed), 3)) == 0
    back = departed + [2, 7]  # back on the prediction's text: [5, 2, 7] -> [2, 7] matches
    assert lookup.propose(torch.tensor(back), 2).tokens.tolist() == [8, 9]


@pytest.mark.parametrize("kind", ["matching", "partly", "unrelated"])
def test_greedy_output_is_the_same_with_any_prediction(text_target, tokenizer, kind):
    """Predictions as ids (a random model's text need not be valid UTF-8, and would not
    tokenise back to its ids); text predictions go through the server's test."""
    plain = SpeculativeDecoder(text_target, tokenizer, None)
    expected = plain.generate(PROMPT, PARAMS)
    ids = expected.token_ids
    prediction = {"matching": list(ids),
                  "partly": ids[:15] + [ord(c) for c in " something else "] + ids[25:],
                  "unrelated": [ord("z")] * 30}[kind]
    for drafter in (None, NgramDrafter()):
        decoder = SpeculativeDecoder(text_target, tokenizer, drafter, k="auto")
        out = decoder.generate(PROMPT, PARAMS, prediction=prediction)
        assert out.token_ids == expected.token_ids
        stats = out.stats
        assert stats.prediction_tokens == len(prediction)
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == \
            stats.prediction_tokens
        assert stats.rejected_prediction_tokens >= 0
        if kind == "matching":  # most of it is accepted, in few passes
            assert stats.accepted_prediction_tokens > stats.prediction_tokens // 2
            assert stats.target_forwards < PARAMS.max_new_tokens // 2
        if kind == "unrelated":
            assert stats.accepted_prediction_tokens == 0


V = 8
PROMPT_IDS = [1, 2, 3, 1, 2]
N = 3000


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(V, seed=3, init=0.5)


def prediction_counts(decoder, prediction) -> torch.Tensor:
    return first_two_counts(decoder, PROMPT_IDS, V, SamplingParams(temperature=1.0), N,
                            prediction=prediction)


# The prediction repeats the prompt's last bigram, so the lookup proposes its next tokens at
# the first position: a draft that is wrong often enough for the control to fail.
PREDICTION = [1, 2, 7, 7, 7]


def target_joint(model) -> torch.Tensor:
    return exact_joint(model, PROMPT_IDS, SamplingParams(temperature=1.0))


def test_a_sampled_output_with_a_prediction_keeps_the_targets_law(small_target):
    decoder = SpeculativeDecoder(small_target, None, None, k=3)
    counts = prediction_counts(decoder, PREDICTION)
    assert chi2_pvalue(counts, target_joint(small_target)) > 1e-3


def test_negative_control_an_unverified_prediction_is_detected(small_target, monkeypatch):
    monkeypatch.setattr(scheduler_module, "verify_rows", always_accept_rows)
    decoder = SpeculativeDecoder(small_target, None, None, k=3)
    counts = prediction_counts(decoder, PREDICTION)
    assert chi2_pvalue(counts, target_joint(small_target)) < 1e-6


def test_a_bad_prediction_is_refused(text_target, tokenizer):
    decoder = SpeculativeDecoder(text_target, tokenizer, None)
    with pytest.raises(ValueError, match="prediction token ids"):
        decoder.generate([1, 2, 3], PARAMS, prediction=[1, -5])
    with pytest.raises(ValueError, match="one prompt"):
        decoder.generate(["a", "b"], PARAMS, prediction="a")
