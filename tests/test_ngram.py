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


def reference_lookup(history: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The definition, by brute force: the longest n in [min_ngram, max_ngram] whose last n
    tokens occur earlier (ending before the last token), its most recent occurrence."""
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = history[-n:]
        starts = [s for s in range(length - n) if history[s:s + n] == pattern]
        if starts:
            return history[starts[-1] + n: starts[-1] + n + k]
    return []


def test_lookup_agrees_with_the_brute_force_definition():
    generator = torch.Generator().manual_seed(0)
    checked = matched = 0
    for trial in range(400):
        vocab = 2 + trial % 5  # small vocabularies: long repeated n-grams
        length = 1 + trial % 40
        history = torch.randint(0, vocab, (length,), generator=generator).tolist()
        for max_ngram, min_ngram in ((5, 1), (3, 2), (4, 4)):
            k = 1 + trial % 6
            expected = reference_lookup(history, k, max_ngram, min_ngram)
            assert propose(history, k, max_ngram=max_ngram, min_ngram=min_ngram) == expected
            checked += 1
            matched += bool(expected)
    assert matched > checked // 2  # most cases find a match, some do not
