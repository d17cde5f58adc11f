"""Earlier requests' text, indexed for lookup: a suffix automaton per scope, bounded in tokens.

A suffix automaton of a text has one state per class of substrings that end at the same
positions (at most 2N states for N tokens), a transition per token that extends a substring,
and a suffix link from each state to the class of its longest shorter suffix. Walking it with
a context finds the longest suffix of that context that occurs in the text in O(context)
steps; a state's count is how often its substrings occur, so the child with the largest count
is the continuation that most often followed (SuffixDecoding's rule, Oliaro et al. 2024,
arXiv 2411.04975, over an automaton instead of a suffix tree).

Example: documents [1, 2, 3] and [1, 2, 4] and [1, 2, 3] in one scope; the context [.., 1, 2]
matches [1, 2] (3 occurrences), followed twice by 3 and once by 4: the proposal is [3], with
probability 2/3.

`SuffixCache` keeps finished requests' prompts and outputs (documents) under a token budget
shared by all scopes (a scope: the text one tenant may be proposed); past the budget it drops
the least recently used documents (added, or proposed from) down to three quarters of it and
rebuilds the scopes they were in, so the automata never hold more than the budget's tokens.
Not thread-safe: one owner (the server's engine thread) adds and looks up.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_SUFFIX_TOKENS = 32768  # the cache's token budget, all scopes together (~20 MB)
LOW_WATER = 0.75  # eviction drops documents down to this share of the budget


class SuffixAutomaton:
    """The suffix automaton of documents appended one after another, each closed by a separator
    of its own (a negative id no context holds), so no match runs across two documents.

    States are list indices (0: the root, the empty string); `count[s]` is how many times the
    substrings of state s occur in the text, kept exact as tokens are appended (each append adds
    one occurrence to every state on the suffix-link path of the new end)."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]  # per state: token -> state
        self.link: list[int] = [-1]
        self.length: list[int] = [0]  # the longest substring of the state
        self.count: list[int] = [0]
        self.first_end: list[int] = [-1]  # where its substrings first end in the text
        self.last = 0  # the state of the whole text
        self.size = 0  # tokens and separators appended
        self.starts: list[int] = []  # each document's first position, ascending
        self.documents: list[int] = []  # their ids, in the same order

    @property
    def states(self) -> int:
        return len(self.next)

    def add_document(self, document_id: int, tokens: Sequence[int]) -> None:
        self.starts.append(self.size)
        self.documents.append(document_id)
        for token in tokens:
            self._extend(int(token))
        self._extend(-1 - len(self.documents))  # this document's own separator

    def document_at(self, position: int) -> int:
        """The id of the document holding text position `position`."""
        return self.documents[bisect.bisect_right(self.starts, position) - 1]

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """(state, n): the longest suffix of `context` (n tokens) that occurs in the text and
        is followed there by a token; (0, 0) where none is."""
        state, n = 0, 0
        for token in context:  # the classic walk: fall back along suffix links on a miss
            while state and token not in self.next[state]:
                state = self.link[state]
                n = self.length[state]
            if token in self.next[state]:
                state, n = self.next[state][token], n + 1
        while state and self.best_child(state) is None:  # only at documents' ends
            state = self.link[state]
            n = self.length[state]
        return state, n

    def best_child(self, state: int) -> tuple[int, int] | None:
        """(token, child) that most often followed the state's substrings (ties: the smaller
        token); None where only a separator did."""
        best = None
        for token, child in self.next[state].items():
            if token >= 0 and (best is None or (self.count[child], -token) >
                               (self.count[best[1]], -best[0])):
                best = (token, child)
        return best

    def _extend(self, token: int) -> None:
        # Blumer et al.'s online construction: a state for the new end, a clone where an
        # existing state's class splits.
        cur = self._new(self.length[self.last] + 1, self.size)
        state = self.last
        while state != -1 and token not in self.next[state]:
            self.next[state][token] = cur
            state = self.link[state]
        if state == -1:
            self.link[cur] = 0
        else:
            target = self.next[state][token]
            if self.length[state] + 1 == self.length[target]:
                self.link[cur] = target
            else:
                clone = self._new(self.length[state] + 1, self.first_end[target])
                self.next[clone] = dict(self.next[target])
                self.link[clone] = self.link[target]
                self.count[clone] = self.count[target]
                while state != -1 and self.next[state].get(token) == target:
                    self.next[state][token] = clone
                    state = self.link[state]
                self.link[target] = self.link[cur] = clone
        self.last = cur
        self.size += 1
        state = cur  # the new end is one more occurrence of every suffix of the text
        while state > 0:
            self.count[state] += 1
            state = self.link[state]

    def _new(self, length: int, first_end: int) -> int:
        self.next.append({})
        self.link.append(-1)
        self.length.append(length)
        self.count.append(0)
        self.first_end.append(first_end)
        return len(self.next) - 1


@dataclass(frozen=True, slots=True)
class CachedProposal:
    """What the cache proposes after a context: tokens that most often followed its longest
    match (matched tokens long), each with the share of the occurrences it followed in."""

    tokens: list[int]
    matched: int
    probabilities: list[float]


@dataclass(frozen=True, slots=True)
class CacheUsage:
    tokens: int  # held, all scopes together (at most the budget)
    documents: int
    scopes: int
    states: int  # automata states, all scopes together (at most 2 per token and separator)
    evicted: int  # documents dropped since the cache was made


class SuffixCache:
    """Finished requests' prompts and outputs by scope, within max_tokens (see the module
    docstring). Scope None is no scope: nothing is added to it or proposed from it."""

    def __init__(self, max_tokens: int = DEFAULT_SUFFIX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._documents: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # LRU first
        self._scopes: dict[str, SuffixAutomaton] = {}
        self._ids = itertools.count()
        self._tokens = 0
        self._evicted = 0

    def add(self, scope: str | None, tokens: Sequence[int]) -> None:
        """A finished request's text (its last max_tokens tokens where it is longer)."""
        if scope is None or not len(tokens):
            return
        tokens = [int(t) for t in tokens[-self.max_tokens:]]
        document_id = next(self._ids)
        self._documents[document_id] = (scope, tokens)
        self._tokens += len(tokens)
        self._scopes.setdefault(scope, SuffixAutomaton()).add_document(document_id, tokens)
        if self._tokens > self.max_tokens:
            self._evict()

    def propose(self, scope: str | None, context: Sequence[int], k: int,
                min_probability: float = 0.0) -> CachedProposal:
        """Up to k tokens after the longest suffix of `context` found in the scope's text, each
        the continuation that most often followed the match so far, stopping where the chain's
        probability (the product of each step's share) would fall below min_probability."""
        automaton = None if scope is None else self._scopes.get(scope)
        if automaton is None or k <= 0:
            return CachedProposal([], 0, [])
        state, matched = automaton.match(context)
        if matched == 0:
            return CachedProposal([], 0, [])
        self._documents.move_to_end(automaton.document_at(automaton.first_end[state]))
        tokens, probabilities, chain = [], [], 1.0
        while len(tokens) < k:
            best = automaton.best_child(state)
            if best is None:
                break
            token, child = best
            chain *= automaton.count[child] / automaton.count[state]
            if chain < min_probability:
                break
            tokens.append(token)
            probabilities.append(chain)
            state = child
        return CachedProposal(tokens, matched, probabilities)

    def usage(self) -> CacheUsage:
        """What the cache holds (safe to read from another thread: a metrics scrape)."""
        automata = list(self._scopes.values())  # one step under the GIL: no resize mid-way
        return CacheUsage(self._tokens, len(self._documents), len(automata),
                          sum(a.states for a in automata), self._evicted)

    def clear(self) -> None:
        self._documents.clear()
        self._scopes.clear()
        self._tokens = 0

    def _evict(self) -> None:
        """Drop the least recently used documents down to LOW_WATER of the budget; rebuild the
        scopes they were in from the documents left (the automaton cannot delete)."""
        touched = set()
        while self._tokens > LOW_WATER * self.max_tokens:
            _, (scope, tokens) = self._documents.popitem(last=False)
            self._tokens -= len(tokens)
            self._evicted += 1
            touched.add(scope)
        for scope in touched:
            del self._scopes[scope]
        for document_id, (scope, tokens) in self._documents.items():
            if scope in touched:
                self._scopes.setdefault(scope, SuffixAutomaton()).add_document(document_id,
                                                                                tokens)
