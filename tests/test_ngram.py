import torch

from verispec import SamplingParams
from verispec.drafters import NgramDrafter

PARAMS = SamplingParams()


def propose(history, k, **kwargs):
    draft = NgramDrafter(**kwargs).propose(torch.tensor(history), k, PARAMS, None)
    assert draft.probs is None
    return draft.tokens.tolist()


def test_docstring_example():
    assert propose([1, 2, 3, 9, 1, 2], 3, max_ngram=2) == [3, 9, 1]


def test_longest_match_wins_over_shorter():
    # Unigram [2] last occurred followed by 7; the trigram [5, 1, 2] earlier was followed by 8.
    assert propose([5, 1, 2, 8, 4, 2, 7, 5, 1, 2], 1, max_ngram=3) == [8]


def test_most_recent_occurrence_is_used():
    assert propose([1, 2, 3, 1, 2, 4, 1, 2], 1, max_ngram=2) == [4]


def test_continuation_can_be_shorter_than_k():
    assert propose([1, 2, 1], 5, max_ngram=1) == [2, 1]


def test_no_match_and_edges_give_empty_drafts():
    assert propose([1, 2, 3, 4], 3) == []
    assert propose([7], 3) == []
    assert propose([1, 1, 1], 0) == []
    assert propose([1, 2, 3, 1, 2], 3, min_ngram=3, max_ngram=3) == []
