"""Suffix lookup across requests: prompt lookup over the request's own text and over earlier
requests' prompts and outputs (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975).

A server's requests repeat each other: the same files in their prompts, the same boilerplate
in their answers. `SuffixDrafter` proposes what followed the longest match of the history's
end, looked up in two places: the request's own prompt and output so far (as `NgramDrafter`)
and a `SuffixCache` of finished requests in the same scope (a suffix automaton; the
continuation that most often followed). The longer match proposes. The drafter only proposes:
the target verifies every token, so the output is the target's whatever the cache holds; the
scope (`SamplingParams.lookup_scope`) only decides whose text may be proposed to whom.
"""

from __future__ import annotations

import torch

from verispec.drafters.drafter import Draft, empty_draft
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.suffix_cache import SuffixCache
from verispec.params import SamplingParams

MAX_MATCH = 8  # the longest match kept apart in Draft.source (longer ones count as 8)
CONTEXT = 64  # history tokens matched against the cache
MIN_PROBABILITY = 0.1  # a cached chain stops where its tokens together followed less often


class SuffixDrafter:
    """Drop-in for `NgramDrafter` that also looks up finished requests' text.

    Deterministic: Draft.probs is None. Draft.source is the matched length, as for
    NgramDrafter, capped at max_match (sources 1..max_match, so the per-source acceptance the
    K policy learns is shared with n-gram lookups of the same length).

    Forks share the cache (`fork`: one per running request); `retire(history, params)`, called
    when a request leaves, adds its prompt and output to the cache under its lookup scope.

    Example: a finished request [5, 6, 7, 8] in scope "a"; a new request in scope "a" with
    history [1, 5, 6] has no earlier [6] of its own, the cache matches [5, 6] (2 tokens),
    followed by [7, 8]: with k = 2 the draft is [7, 8], source 2. In scope "b" it is empty.
    """

    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, max_match: int = MAX_MATCH,
                 min_match: int = 1, context: int = CONTEXT,
                 min_probability: float = MIN_PROBABILITY) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if not 0 <= min_probability <= 1:
            raise ValueError(f"min_probability must be in [0, 1], got {min_probability}")
        self.cache = SuffixCache() if cache is None else cache
        self.own = NgramDrafter(max_ngram=max_match, min_ngram=min_match)
        self.context = max(context, max_match)
        self.min_probability = min_probability

    @property
    def max_match(self) -> int:
        return self.own.max_ngram

    @property
    def min_match(self) -> int:
        return self.own.min_ngram

    def reset(self) -> None:
        pass  # the cache outlives requests; nothing else is kept

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(self.cache, self.max_match, self.min_match, self.context,
                             self.min_probability)

    def retire(self, history: torch.Tensor, params: SamplingParams) -> None:
        """A request leaves with history [L] (prompt + output): the cache keeps it under the
        request's lookup scope (nothing for scope None)."""
        self.cache.add(params.lookup_scope, history.tolist())

    def propose(
        self,
        history: torch.Tensor,  # [L] long
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        if k <= 0:
            return empty_draft()
        # 1. The request's own text: the most recent earlier occurrence of its end.
        end, own = self.own.match(history)
        # 2. The scope's earlier requests: the longest match, its most frequent continuation
        #    (not for a seeded sampled row: its draws depend on its drafts, and the same seed
        #    must give the same output whatever requests came before).
        if not params.greedy and params.seed is not None:
            return self._own(history, end, own, k)
        cached = self.cache.propose(params.lookup_scope, history[-self.context:].tolist(), k,
                                    self.min_probability)
        if cached.tokens and cached.matched >= self.min_match and cached.matched > own:
            return Draft(torch.tensor(cached.tokens, dtype=torch.long), None,
                         source=min(cached.matched, self.max_match))
        return self._own(history, end, own, k)

    def _own(self, history: torch.Tensor, end: int, matched: int, k: int) -> Draft:
        """What followed the own text's match (`matched` tokens ending at `end`)."""
        if matched == 0:
            return empty_draft()
        return Draft(history[end + 1:end + 1 + k].clone(), None, source=matched)
