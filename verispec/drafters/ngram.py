"""Prompt lookup: propose what followed the last occurrence of the current n-gram."""

from __future__ import annotations

import torch

from verispec.drafters.base import Draft, empty_draft
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
        length = int(history.numel())
        if k <= 0:
            return empty_draft()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = history[-n:]
            # Windows that end before the last token, so at least one token follows each.
            windows = history[:-1].unfold(0, n, 1)  # [L - n, n]
            starts = (windows == pattern).all(dim=-1).nonzero()
            if starts.numel():
                follow = int(starts[-1, 0]) + n
                return Draft(history[follow:follow + k].clone(), None, source=n)
        return empty_draft()
