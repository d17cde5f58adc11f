"""OpenAI's Predicted Outputs as a draft source: the prediction's continuation wherever the
output is copying it.

A request may come with a prediction of its output (a file to be edited, say): most of the
output is then a copy of it, with a few places where it departs (lines changed, added or
dropped) and comes back. Each round the lookup finds the longest recent n-gram of the output in
the prediction and proposes what follows it there. Where the n-gram occurs more than once (a
file repeats itself: `return`, closing brackets) the occurrence nearest after the place the
output last copied from is taken, so a proposal follows the file in order. The proposal is
deterministic, like any lookup, and verified like any draft, so the output is the target's
whatever the prediction says; only speed depends on it.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, empty_draft

# Draft.source of a proposal of the prediction's first tokens at the output's start (before any
# n-gram of the output exists to match)
FROM_START = -1


def is_prediction(source: int) -> bool:
    """Draft.source of a proposal copied from a prediction (negative: -n for an n-gram match,
    FROM_START for its opening; other lookups use n, draft models 0), so acceptance is learnt
    apart from other lookups."""
    return source < 0


class PredictionLookup:
    """The lookup of one request with a prediction.

    Example: prompt [1, 2], prediction [5, 6, 7, 8, 5, 6, 9], output so far [5, 6, 7, 8, 5, 6]:
    the output's last 5-gram [6, 7, 8, 5, 6] ends at prediction position 6, followed by [9]:
    the draft is [9] (source -5). With the output empty, the draft is the prediction's start.
    """

    def __init__(self, prompt_length: int, prediction_ids: torch.Tensor,
                 min_match: int = 2, max_ngram: int = 5) -> None:
        self.prompt_length = prompt_length
        self.prediction_ids = prediction_ids.long()  # [P]
        self.min_match, self.max_ngram = min_match, max_ngram
        self.cursor = 0  # the prediction position the output last continued from

    def propose(self, history: torch.Tensor, k: int) -> Draft:
        """Up to k tokens that follow, in the prediction, the output's longest matching recent
        n-gram (history [L]: prompt + output so far); an empty draft where none matches or
        the match ends the prediction."""
        if k <= 0:
            return empty_draft()
        start, source = self._continuation(history[self.prompt_length:])
        if start is None or start >= self.prediction_ids.numel():
            return empty_draft()
        self.cursor = start
        return Draft(self.prediction_ids[start: start + k].clone(), None, source=source)

    def _continuation(self, output: torch.Tensor) -> tuple[int | None, int]:
        """Where in the prediction the output goes on, and the proposal's source."""
        if output.numel() == 0:
            return 0, FROM_START
        prediction = self.prediction_ids
        for n in range(min(self.max_ngram, int(output.numel()), int(prediction.numel())),
                       self.min_match - 1, -1):
            windows = prediction.unfold(0, n, 1)  # [P - n + 1, n]
            ends = (windows == output[-n:]).all(dim=1).nonzero().flatten() + n
            if ends.numel():
                ahead = ends[ends >= self.cursor]
                return int(ahead[0] if ahead.numel() else ends[-1]), -n
        return None, 0
