"""Prompt lookup: propose what followed the last occurrence of the current n-gram."""

from __future__ import annotations

import numpy as np
import torch

from verispec.drafters.drafter import Draft, empty_draft
from verispec.params import SamplingParams


class NgramDrafter:
    """Match the last n tokens of prompt + output against earlier text, longest n first, and
    propose the tokens that followed the most recent match. Deterministic: Draft.probs is None;
    Draft.source is the matched length n.

    Example: history [1, 2, 3, 9, 1, 2], max_ngram 2 -> the bigram [1, 2] occurred at 0, followed
    by [3, 9, 1, 2]: with k = 3 the draft is [3, 9, 1].
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 5, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self) -> None:
        pass  # stateless

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.max_ngram, self.min_ngram)

    def propose(
        self,
        history: torch.Tensor,  # [L] long
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        if k <= 0:
            return empty_draft()
        best, best_n = self.match(history)
        if best_n == 0:
            return empty_draft()
        return Draft(history[best + 1:best + 1 + k].clone(), None, source=best_n)

    def match(self, history: torch.Tensor) -> tuple[int, int]:
        """(end, n): the last n tokens of history [L] also end at index `end` < L - 1, the
        most recent such occurrence of the longest n within [min_ngram, max_ngram]; (-1, 0)
        where nothing matches. What followed it, history[end + 1:], is the proposal."""
        tokens = history.cpu().numpy()  # [L]
        length = int(tokens.size)
        # Ends j <= L-2 of earlier occurrences of the last n tokens, for n = 1, 2, ...: each n
        # keeps the ends of n - 1 whose token n - 1 back matches too (NumPy: a lookup is a
        # few microseconds, where a tensor op per n cost ~30 us a row per round).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        best, best_n = -1, 0
        for n in range(1, min(self.max_ngram, length - 1) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if not ends.size:
                break
            if n >= self.min_ngram:
                best, best_n = int(ends[-1]), n  # the most recent occurrence
        return best, best_n
