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
        start, source = self._continuation(history[self.prompt_length:])
        has_text = start is not None and start < self.prediction_ids.numel()
        if k <= 0:
            return empty_draft()
        if has_text:
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


def copied_tokens(prediction: list[int], output: list[int],
                  decode: Callable[[list[int]], str]) -> int:
    """How many of the prediction's tokens the output copied: OpenAI's accepted prediction
    tokens, "tokens in the prediction that appeared in the completion" (the rest are its
    rejected ones). The two are aligned as difflib aligns sequences (the longest matching
    blocks first, then the same within what lies between): a matched token is copied, and so
    is every token of an unmatched span that the output writes as the same text in other tokens
    (the prediction's '\n', '\n' where the output has '\n\n'). It depends on the prediction
    and the output alone, never on which tokens a draft proposed or how rounds cut the output.

    Example: prediction [1, 2, 3, 4], output [1, 2, 9, 4]: 3 copied (1, 2 and 4).
    """
    # autojunk: tokens that make up over 1% of a long output anchor no block (they still extend
    # one), which bounds the alignment's time on repetitive text
    matcher = difflib.SequenceMatcher(None, prediction, output, autojunk=True)
    copied = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace"
                              and decode(prediction[i1:i2]) == decode(output[j1:j2])):
            copied += i2 - i1
    return copied
