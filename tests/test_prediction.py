"""Predicted Outputs: a prediction is a draft source like any lookup: greedy output is the same
with a matching, a partly matching or an unrelated prediction, sampled output keeps the
target's law (with a negative control), and the accepted count is the tally of the
prediction's proposed tokens that the output kept."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import always_accept_rows, chi2_pvalue, exact_joint, first_two_counts, tiny_llama

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import NgramDrafter
from verispec.drafters.prediction import PredictionLookup, copied_tokens, is_prediction, run_source
from verispec.verify import verify_drafts

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


def test_a_proposal_is_known_by_how_long_the_output_has_been_copying():
    """The kind of a prediction's proposal is its copy run, bucketed: a long run and a fresh
    5-gram match (the same n-gram length) are learnt apart."""
    assert [run_source(5, run) for run in (5, 7, 8, 15, 16, 40, 64, 500)] == [
        -5, -5, -8, -8, -16, -32, -64, -64]
    assert run_source(2, 2) == -2
    prediction = torch.arange(100, 200)
    lookup = PredictionLookup(1, prediction)
    copied = torch.cat([torch.tensor([0]), prediction[:40]])  # 40 tokens copied so far
    draft = lookup.propose(copied, 4)
    assert draft.tokens.tolist() == [140, 141, 142, 143] and draft.source == -32
    changed = torch.cat([torch.tensor([0]), prediction[:30], torch.tensor([7]),
                         prediction[31:36]])  # one token changed, then 5 copied again
    assert PredictionLookup(1, prediction).propose(changed, 1).source == -5


def test_the_prediction_tokens_the_output_copies_are_counted_once():
    """OpenAI's accepted prediction tokens are the prediction's tokens that appear in the
    output, aligned in order: a part of the prediction the output writes twice counts once, a
    changed token is not a copy, and a span written as the same text in other tokens is."""
    text = {1: "a", 2: "b", 3: "c", 4: "d", 10: "\n", 11: "\n\n", 9: "z"}

    def decode(ids: list[int]) -> str:
        return "".join(text[i] for i in ids)

    assert copied_tokens([1, 2, 3, 4], [1, 2, 3, 4], decode) == 4
    assert copied_tokens([1, 2, 3, 4], [1, 2, 9, 4], decode) == 3
    assert copied_tokens([1, 2, 3, 4], [1, 2, 1, 2, 3, 4], decode) == 4  # copied twice: once
    assert copied_tokens([1, 2, 3, 4], [1, 2], decode) == 2  # an output cut short
    assert copied_tokens([1, 10, 10, 2], [1, 11, 2], decode) == 4  # "\n" "\n" as "\n\n"
    assert copied_tokens([1, 11, 2], [1, 10, 10, 2], decode) == 3
    assert copied_tokens([1, 10, 10, 2], [1, 11, 9, 2], decode) == 2  # other text: not copies
    assert copied_tokens([1, 2], [], decode) == 0 and copied_tokens([], [1, 2], decode) == 0
    broken = {**text, 20: "\ufffd", 21: "\ufffd"}  # two halves of different characters
    assert copied_tokens([1, 20, 2], [1, 21, 2], lambda ids: "".join(broken[i] for i in ids)) == 2


def test_long_alignments_take_their_bounded_paths(monkeypatch):
    """Sides too long for difflib are cut at tokens found once on each side, and where none
    is, aligned window by window: the counts stay those of the whole alignment on edits that
    keep the text's order."""
    import random

    import verispec.drafters.prediction as prediction_module

    random.seed(0)
    base = random.sample(range(1000, 3000), 400)  # tokens once each: anchors
    edited = list(base)
    for at in (50, 51, 200, 333):
        edited[at] = 7
    whole = copied_tokens(base, edited, tuple)
    monkeypatch.setattr(prediction_module, "DIFFLIB_PAIRS", 64)
    monkeypatch.setattr(prediction_module, "WINDOW", 32)
    assert copied_tokens(base, edited, tuple) == whole == 396
    # the same text three times: no token is found once; windows at the same share align it
    assert copied_tokens(base * 3, edited * 3, tuple) == 3 * 396
    # a repetitive output: a common start and end are counted whatever lies between
    assert copied_tokens([5] + [1, 2] * 500, [6] + [1, 2] * 500, tuple) == 1000


def test_the_copied_count_does_not_depend_on_the_drafter(text_target, tokenizer):
    """The same output and prediction give the same accepted and rejected counts whichever
    drafter ran and however its rounds cut the output (the embedded model's test has a
    prediction tokenised otherwise than the output was written; this model's text is bytes)."""
    plain = SpeculativeDecoder(text_target, tokenizer, None)
    expected = plain.generate(PROMPT, PARAMS)
    ids = expected.token_ids
    for prediction, copied in ((ids[:20] + [ord("q")] * 5, 20),
                               (ids[:10] + [ord("q")] * 3 + ids[13:], len(ids) - 3)):
        counts = set()
        for drafter, k in ((None, "auto"), (NgramDrafter(), 2), (NgramDrafter(), 5)):
            decoder = SpeculativeDecoder(text_target, tokenizer, drafter, k=k)
            out = decoder.generate(PROMPT, PARAMS, prediction=prediction)
            assert out.token_ids == ids
            counts.add((out.stats.accepted_prediction_tokens,
                        out.stats.rejected_prediction_tokens))
        assert counts == {(copied, len(prediction) - copied)}, counts


def test_where_the_prediction_has_nothing_the_output_is_looked_up():
    """A change made twice (a line inserted before each of two copies of a block) is new text
    the first time; the second time the prediction has no continuation for it, and a row's
    lookup over its own text proposes what followed it the first time, as a lookup of its
    n-gram's length (not a prediction's), leaving the prediction's cursor where it was."""
    block, inserted = [7, 8, 9], [30, 31, 32, 33]
    prediction = torch.tensor([1] + block + [2] + block + [3])
    history = torch.tensor([0, 1] + inserted + block + [2, 30, 31])  # prompt [0]
    assert len(PredictionLookup(1, prediction).propose(history, 3)) == 0
    lookup = PredictionLookup(1, prediction, lookup=NgramDrafter())
    lookup.cursor = 5
    draft = lookup.propose(history, 3)
    assert draft.tokens.tolist() == [32, 33, 7] and draft.source == 2
    assert not is_prediction(draft.source) and lookup.cursor == 5
    copying = torch.tensor([0, 1] + block)  # the prediction goes first where it has text
    assert lookup.propose(copying, 2).source < 0


def test_only_a_row_without_a_drafter_looks_its_own_text_up(text_target, tokenizer):
    """A drafter's own lookup (or draft model) covers what the prediction has not; a row
    without one gets the prediction's lookup over its own text."""
    for drafter, looks_up in ((None, True), (NgramDrafter(), False)):
        engine = SpeculativeDecoder(text_target, tokenizer, drafter, k="auto").engine()
        engine.add_request(PROMPT, PARAMS, prediction="the cat sat")
        (request,) = engine.scheduler.waiting
        assert (request.prediction.lookup is not None) == looks_up


def proposals_and_positions(monkeypatch) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Record, at every verification, each prediction proposal's (position, tokens) and every
    row's position (its history length), by wrapping the scheduler's call of `verify_drafts`."""
    proposals: list[tuple[int, list[int]]] = []
    positions: list[int] = []

    def recording(drafts, logits, rows):
        for draft, row in zip(drafts, rows, strict=True):
            positions.append(row.position)
            if is_prediction(draft.source) and len(draft):
                proposals.append((row.position, draft.tokens.tolist()))
        return verify_drafts(drafts, logits, rows)

    monkeypatch.setattr("verispec.round.verify_drafts", recording)
    return proposals, positions


def accepted_by_the_output(proposals, prompt_length: int, output: list[int]) -> int:
    """A greedy row accepts a draft token exactly when it is the token the output has there:
    the tally of each proposal's prefix that the final output repeats at its position."""
    tally = 0
    for position, tokens in proposals:
        start = position - prompt_length
        for offset, token in enumerate(tokens):
            if start + offset >= len(output) or output[start + offset] != token:
                break
            tally += 1
    return tally


@pytest.mark.parametrize("kind", ["matching", "partly", "unrelated"])
def test_greedy_output_is_the_same_with_any_prediction(text_target, tokenizer, kind,
                                                       monkeypatch):
    """Predictions as ids (a random model's text need not be valid UTF-8, and would not
    tokenise back to its ids); text predictions go through the server's test. The accepted
    count equals a tally from the output and the prediction's proposals (lookup drafts of the
    n-gram drafter beside it are not counted)."""
    plain = SpeculativeDecoder(text_target, tokenizer, None)
    expected = plain.generate(PROMPT, PARAMS)
    ids = expected.token_ids
    prediction = {"matching": list(ids),
                  "partly": ids[:15] + [ord(c) for c in " something else "] + ids[25:],
                  "unrelated": [ord("z")] * 30}[kind]
    proposals, positions = proposals_and_positions(monkeypatch)
    for drafter in (None, NgramDrafter()):
        proposals.clear()
        positions.clear()
        decoder = SpeculativeDecoder(text_target, tokenizer, drafter, k="auto")
        out = decoder.generate(PROMPT, PARAMS, prediction=prediction)
        assert out.token_ids == expected.token_ids
        stats = out.stats
        assert stats.prediction_tokens == len(prediction)
        tally = accepted_by_the_output(proposals, positions[0], out.token_ids)
        copied = stats.accepted_prediction_tokens
        # copies of the prediction's tokens: at least what its accepted proposals wrote, at
        # most what the two share token by token
        assert tally <= copied <= sum((Counter(prediction) & Counter(out.token_ids)).values())
        if kind == "matching":  # all of it copied, in few passes
            assert copied == len(prediction) and stats.rejected_prediction_tokens == 0
            assert stats.target_forwards < PARAMS.max_new_tokens // 2
        if kind == "partly":  # some proposals accepted, some rejected
            assert 0 < tally < stats.prediction_tokens
            assert sum(map(len, (t for _, t in proposals))) > tally
        if kind == "unrelated":
            assert tally == 0


def test_prediction_tokens_past_a_stop_string_are_not_counted(text_target, tokenizer):
    """A round may accept a prediction past the stop string the output ends at: the tokens the
    stop cuts off are not in the completion, and do not count as copied."""
    plain = SpeculativeDecoder(text_target, tokenizer, None)
    whole = plain.generate(PROMPT, PARAMS)
    text = whole.text
    start = next(i for i in range(10, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=(text[start:start + 2],))
    decoder = SpeculativeDecoder(text_target, tokenizer, None, k="auto")
    out = decoder.generate(PROMPT, params, prediction=whole.token_ids)
    assert out.token_ids == plain.generate(PROMPT, params).token_ids
    assert len(out.token_ids) < len(whole.token_ids)
    assert out.stats.accepted_prediction_tokens <= len(out.token_ids)


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
    monkeypatch.setattr("verispec.verify.drafts.verify_rows", always_accept_rows)
    decoder = SpeculativeDecoder(small_target, None, None, k=3)
    counts = prediction_counts(decoder, PREDICTION)
    assert chi2_pvalue(counts, target_joint(small_target)) < 1e-6


def test_a_bad_prediction_is_refused(text_target, tokenizer):
    decoder = SpeculativeDecoder(text_target, tokenizer, None)
    with pytest.raises(ValueError, match="prediction token ids"):
        decoder.generate([1, 2, 3], PARAMS, prediction=[1, -5])
    with pytest.raises(ValueError, match="one prompt"):
        decoder.generate(["a", "b"], PARAMS, prediction="a")
    for bad in (5, 3.5, torch.tensor(7), b"hello", {1, 2}, np.array([1.0, 2.0]), [True, 2]):
        with pytest.raises(ValueError, match="prediction"):
            decoder.generate([1, 2, 3], PARAMS, prediction=bad)


def test_prediction_ids_may_be_a_tensor_or_an_array(text_target, tokenizer):
    decoder = SpeculativeDecoder(text_target, None, None)
    ids = [5, 6, 7, 8]
    for given in (torch.tensor(ids), np.array(ids), tuple(np.int64(t) for t in ids)):
        assert decoder.encode_prediction(given).tolist() == ids
