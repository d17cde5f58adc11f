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

A proposal's kind (Draft.source, whose acceptance the K policy learns apart) is how long the
output has been copying the prediction at that place: a run of hundreds of copied tokens goes
on far more surely than a 5-gram that happens to recur in a changed line, and earns a longer K.

Where the output departs from the prediction it often repeats itself: one change made in
every function of a file (a check added at the top of each, a type parameter on every method)
is new text the first time and a copy of the output after. A row with no lookup of its own (no
drafter) looks there too: where no n-gram of the output is in the prediction, the prompt and
the output so far are searched as prompt lookup does (`NgramDrafter`), the proposal's kind its
n-gram's length, as any lookup's.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Callable

import torch

from verispec.drafters.drafter import Draft, empty_draft
from verispec.drafters.ngram import NgramDrafter
from verispec.params import SamplingParams

GREEDY = SamplingParams()  # what a lookup asked through the drafter protocol is given

# Draft.source of a proposal of the prediction's first tokens at the output's start (before any
# n-gram of the output exists to match)
FROM_START = -1


# Copy runs this long or longer are kinds of their own (-8, -16, -32, -64); shorter ones are
# their n-gram's length (-2..-5, as other lookups)
RUN_KINDS = (64, 32, 16, 8)


def is_prediction(source: int) -> bool:
    """Draft.source of a proposal copied from a prediction (negative: -n for a copy run of n
    tokens, bucketed by `run_source`; FROM_START for its opening; other lookups use n, draft
    models 0), so acceptance is learnt apart from other lookups."""
    return source < 0


def run_source(ngram: int, run: int) -> int:
    """The kind of a proposal after an n-gram match of `ngram` tokens that is the end of a copy
    run of `run` tokens (run >= ngram). Example: (5, 5) -> -5, (5, 40) -> -32."""
    return -next((kind for kind in RUN_KINDS if run >= kind), ngram)


class PredictionLookup:
    """The lookup of one request with a prediction.

    Example: prompt [1, 2], prediction [5, 6, 7, 8, 5, 6, 9], output so far [5, 6, 7, 8, 5, 6]:
    the output's last 5-gram [6, 7, 8, 5, 6] ends at prediction position 6, followed by [9]:
    the draft is [9]; the output copies the prediction's first 6 tokens there, a run of 6
    (source -5: runs under 8 are kinds by their n-gram). With the output empty, the draft is
    the prediction's start.

    lookup: where given, asked when the prediction has no continuation (the prompt and the
    output so far); for a row with no lookup of its own.

    How many of the prediction's tokens the output copied is counted once the output is done,
    from the two alone (`copied_tokens`).
    """

    def __init__(self, prompt_length: int, prediction_ids: torch.Tensor,
                 min_match: int = 2, max_ngram: int = 5,
                 lookup: NgramDrafter | None = None) -> None:
        self.prompt_length = prompt_length
        self.prediction_ids = prediction_ids.long()  # [P]
        self.min_match, self.max_ngram = min_match, max_ngram
        self.lookup = lookup
        self.cursor = 0  # the prediction position the output last continued from

    def propose(self, history: torch.Tensor, k: int) -> Draft:
        """Up to k tokens that follow, in the prediction, the output's longest matching recent
        n-gram (history [L]: prompt + output so far); else, with a lookup, what followed the
        history's last n-gram earlier in it; an empty draft where neither has any. Called once
        a round."""
        if k <= 0:
            return empty_draft()
        start, source = self._continuation(history[self.prompt_length:])
        if start is not None and start < self.prediction_ids.numel():
            self.cursor = start
            return Draft(self.prediction_ids[start: start + k].clone(), None, source=source)
        if self.lookup is None:
            return empty_draft()
        return self.lookup.propose(history, k, GREEDY, None)  # its params go unread

    def _continuation(self, output: torch.Tensor) -> tuple[int | None, int]:
        """Where in the prediction the output goes on, and the proposal's source. An output
        too short for an n-gram that is so far the prediction's opening goes on after it."""
        if output.numel() == 0:
            return 0, FROM_START
        if output.numel() < self.min_match:
            opening = self.prediction_ids[: output.numel()]
            if opening.numel() == output.numel() and bool((opening == output).all()):
                return int(output.numel()), FROM_START
            return None, 0
        prediction = self.prediction_ids
        for n in range(min(self.max_ngram, int(output.numel()), int(prediction.numel())),
                       self.min_match - 1, -1):
            windows = prediction.unfold(0, n, 1)  # [P - n + 1, n]
            ends = (windows == output[-n:]).all(dim=1).nonzero().flatten() + n
            if ends.numel():
                ahead = ends[ends >= self.cursor]
                end = int(ahead[0] if ahead.numel() else ends[-1])
                return end, run_source(n, self._run(output, end))
        return None, 0

    def _run(self, output: torch.Tensor, end: int) -> int:
        """How many of the output's last tokens equal the prediction's tokens before `end`
        (counted up to the longest run kind)."""
        span = min(RUN_KINDS[0], int(output.numel()), end)
        same = output[-span:].flip(0) == self.prediction_ids[end - span: end].flip(0)  # [span]
        return int(same.long().cumprod(0).sum())


# Alignments whose two sides multiply to at most this many token pairs go to difflib (its time
# grows with that product on text that repeats itself); larger ones are cut at tokens that
# occur once on each side first (patience diff), at most ANCHOR_DEPTH times over.
DIFFLIB_PAIRS = 1 << 18
ANCHOR_DEPTH = 8
WINDOW = 256  # where nothing anchors: the sides' parts aligned window by window


def copied_tokens(prediction: list[int], output: list[int],
                  decode: Callable[[list[int]], object]) -> int:
    """How many of the prediction's tokens the output copied: OpenAI's accepted prediction
    tokens, "tokens in the prediction that appeared in the completion" (the rest are its
    rejected ones). The two are aligned in order (`_matched`): a matched token is copied, and
    so is every token of an unmatched stretch that the output writes as the same text in other
    tokens (the prediction's '\n', '\n' where the output has '\n\n'; a stretch whose text
    holds a broken character, U+FFFD, is not compared). It depends on the prediction and the
    output alone, never on which tokens a draft proposed or how rounds cut the output, and its
    time is bounded whatever the two hold.

    Example: prediction [1, 2, 3, 4], output [1, 2, 9, 4]: 3 copied (1, 2 and 4).
    """
    blocks = _matched(prediction, output, 0, len(prediction), 0, len(output), ANCHOR_DEPTH)
    copied, i, j = 0, 0, 0
    for a, b, size in [*blocks, (len(prediction), len(output), 0)]:
        if a > i and b > j:  # a stretch each side leaves unmatched: the same text?
            text = decode(prediction[i:a])
            if text == decode(output[j:b]) and "\ufffd" not in str(text):
                copied += a - i
        copied += size
        i, j = a + size, b + size
    return copied


def _matched(a: list[int], b: list[int], a0: int, a1: int, b0: int, b1: int,
             depth: int) -> list[tuple[int, int, int]]:
    """Matching blocks (i, j, size) of a[a0:a1] and b[b0:b1], in order: their common start and
    end; between them difflib's alignment where small enough, else the tokens found once on
    each side whose order agrees (the longest such run) cut the rest into parts aligned alike,
    `depth` levels at most (what lies deeper stays unmatched: a count too low, never a wait)."""
    start = 0
    while a0 + start < a1 and b0 + start < b1 and a[a0 + start] == b[b0 + start]:
        start += 1
    end = 0
    while a1 - end > a0 + start and b1 - end > b0 + start and a[a1 - 1 - end] == b[b1 - 1 - end]:
        end += 1
    head = [(a0, b0, start)] if start else []
    tail = [(a1 - end, b1 - end, end)] if end else []
    a0, b0, a1, b1 = a0 + start, b0 + start, a1 - end, b1 - end
    if a0 == a1 or b0 == b1:
        return head + tail
    if (a1 - a0) * (b1 - b0) <= DIFFLIB_PAIRS:
        return head + _difflib_blocks(a, b, a0, a1, b0, b1) + tail
    # tokens once in each side, paired, and the longest run of pairs in order on both sides
    pairs = []
    if depth > 0:
        once_a, once_b = _once(a, a0, a1), _once(b, b0, b1)
        pairs = _increasing(sorted((i, once_b[t]) for t, i in once_a.items() if t in once_b))
    middle: list[tuple[int, int, int]] = []
    i, j = a0, b0
    for pa, pb in pairs:
        middle += _matched(a, b, i, pa, j, pb, depth - 1) + [(pa, pb, 1)]
        i, j = pa + 1, pb + 1
    if pairs:
        return head + middle + _matched(a, b, i, a1, j, b1, depth - 1) + tail
    # nothing anchors (text that repeats itself, or too deep): windows at the same share of
    # each side, each aligned by difflib
    windows = -(-max(a1 - a0, b1 - b0) // WINDOW)
    for w in range(windows):
        i0, i1 = a0 + (a1 - a0) * w // windows, a0 + (a1 - a0) * (w + 1) // windows
        j0, j1 = b0 + (b1 - b0) * w // windows, b0 + (b1 - b0) * (w + 1) // windows
        middle += _difflib_blocks(a, b, i0, i1, j0, j1)
    return head + middle + tail


def _difflib_blocks(a: list[int], b: list[int], a0: int, a1: int, b0: int,
                    b1: int) -> list[tuple[int, int, int]]:
    """difflib's matching blocks of a[a0:a1] and b[b0:b1], at their places in a and b."""
    matcher = difflib.SequenceMatcher(None, a[a0:a1], b[b0:b1], autojunk=False)
    return [(a0 + i, b0 + j, n) for i, j, n in matcher.get_matching_blocks() if n]


def _once(seq: list[int], first: int, last: int) -> dict[int, int]:
    """The tokens of seq[first:last] that occur there once, with their index."""
    seen: dict[int, int] = {}
    repeated = set()
    for index in range(first, last):
        token = seq[index]
        if token in seen:
            repeated.add(token)
        seen[token] = index
    return {token: index for token, index in seen.items() if token not in repeated}


def _increasing(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest run of pairs (sorted by their first) whose second ones increase too."""
    tails: list[int] = []  # tails[k]: the pair ending the best run of length k + 1
    ends: list[int] = []  # its second
    before: list[int] = []
    for n, (_, second) in enumerate(pairs):
        k = bisect.bisect_left(ends, second)
        before.append(tails[k - 1] if k else -1)
        if k == len(tails):
            tails.append(n)
            ends.append(second)
        else:
            tails[k], ends[k] = n, second
    run, n = [], tails[-1] if tails else -1
    while n >= 0:
        run.append(pairs[n])
        n = before[n]
    return run[::-1]
