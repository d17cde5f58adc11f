"""OpenAI's Predicted Outputs as a draft source: lookup over prompt + prediction + output.

A request may come with a prediction of its output (a file to be edited, say): most of the
output is then a copy of it, and n-gram lookup over the prompt, the prediction and the output
so far proposes the prediction's next tokens wherever the output is copying it. The proposal
is deterministic, like any lookup, and verified like any draft, so the output is the target's
whatever the prediction says; only speed depends on it.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, empty_draft
from verispec.drafters.ngram import NgramDrafter


def is_prediction(source: int) -> bool:
    """Draft.source of a proposal copied from a prediction (negative: -n for an n-gram match;
    other lookups use n, draft models 0), so acceptance is learnt apart from other lookups."""
    return source < 0


class PredictionLookup:
    """The lookup of one request with a prediction.

    Example: prompt [1, 2], prediction [5, 6, 7, 8], output so far [5, 6]: the corpus is
    [1, 2, 5, 6, 7, 8, 5, 6]; the bigram [5, 6] last occurred inside the prediction, followed
    by [7, 8]: with k = 2 the draft is [7, 8] (source -2).
    """

    def __init__(self, prompt_length: int, prediction_ids: torch.Tensor,
                 min_match: int = 2, max_ngram: int = 5) -> None:
        self.prompt_length = prompt_length
        self.prediction_ids = prediction_ids  # [P] long
        self.lookup = NgramDrafter(max_ngram=max_ngram, min_ngram=min_match)

    def propose(self, history: torch.Tensor, k: int) -> Draft:
        """Up to k tokens that followed the last match inside the prediction; an empty draft
        where the most recent match is not in the prediction (the model's own drafter then
        proposes)."""
        if k <= 0:
            return empty_draft()
        start = self.prompt_length  # the prediction's place in the corpus
        corpus = torch.cat([history[:start], self.prediction_ids, history[start:]])  # [L + P]
        end, n = self.lookup.match(corpus)
        stop = start + int(self.prediction_ids.numel())
        if n == 0 or not start <= end + 1 < stop:
            return empty_draft()
        return Draft(corpus[end + 1: min(end + 1 + k, stop)].clone(), None, source=-n)
