"""The drafter protocol and what a drafter returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: torch.Tensor  # [k'] long, k' <= k (a drafter may propose fewer, even none)
    probs: torch.Tensor | None  # [k', V] the warped draft distribution, or None if deterministic
    # What kind of proposal this is, for acceptance statistics kept per kind (n-gram drafts: the
    # length of the matched n-gram, since longer matches are accepted far more often).
    source: int = 0
    # A token tree instead of a chain: [k'] long, each token's parent among the tokens before
    # it, -1 for a child of the history's last token; tokens in order of depth. A sampled
    # tree's probs row of a token is the distribution it was drawn from (its siblings', too).
    parents: torch.Tensor | None = None
    # A greedy tree's tokens' cumulative log-probabilities under the drafter ([k'] float): how
    # likely the drafter thinks each path is, to keep the likeliest tokens (`pruned`).
    scores: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def depths(self) -> list[int]:
        """Each token's depth: 1 for the history's next token (a chain: 1, 2, ..., k')."""
        if self.parents is None:
            return list(range(1, len(self) + 1))
        depths: list[int] = []
        for parent in self.parents.tolist():
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def truncated(self, depth: int) -> Draft:
        """The tokens up to this depth (a chain's first `depth` tokens)."""
        if depth >= self.depth:
            return self
        length = sum(1 for d in self.depths if d <= depth)
        probs = None if self.probs is None else self.probs[:length]
        parents = None if self.parents is None else self.parents[:length]
        scores = None if self.scores is None else self.scores[:length]
        return Draft(self.tokens[:length], probs, self.source, parents, scores)

    def pruned(self, count: int) -> Draft:
        """A tree's `count` likeliest tokens (by score; a token's score is at most its
        parent's, so their ancestors come with them), in their order, parents renumbered.
        Example: tokens [5, 6, 7], parents [-1, -1, 0], scores [-.1, -2, -.3], count 2 ->
        tokens [5, 7], parents [-1, 0]."""
        if self.parents is None or self.scores is None or count >= len(self):
            return self
        scores, all_parents = self.scores.tolist(), self.parents.tolist()
        ranked = sorted(range(len(self)), key=lambda i: (-scores[i], i))
        keep = sorted(ranked[:count])
        while True:  # ancestors of kept tokens (for scores that do not fall along a path)
            missing = {all_parents[i] for i in keep} - {-1} - set(keep)
            if not missing:
                break
            keep = sorted(set(keep) | missing)
        index = {old: new for new, old in enumerate(keep)}
        at = torch.tensor(keep, dtype=torch.long)
        parents = torch.tensor([index.get(all_parents[i], -1) for i in keep])
        return Draft(self.tokens[at], None, self.source, parents, self.scores[at])


class Drafter(Protocol):
    """What every drafter does. Some methods are optional (called through the helpers below
    when a drafter has them): `follow(runner)`, for one that reads the target's hidden states,
    `catch_up(prefix_ids)`, for one with a cache of its own to fill as a prompt comes in,
    `retire(history, params)`, for one that learns from the requests that leave,
    `copy_state(source, length)`, for one that can start from another's cached prefix, and
    `cache_bytes()`, `bytes_per_position()` and `limit_growth(positions)`, for one whose own
    caches hold memory."""

    name: str

    def propose(
        self,
        history: torch.Tensor,  # [L] long: prompt + output so far
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft: ...

    def reset(self) -> None:
        """Forget cached state (a draft model's KV cache); the next proposal starts cold."""
        ...

    def fork(self) -> Drafter:
        """A drafter for another sequence decoded at the same time (batches): shares the
        weights, keeps its own state."""
        ...


@dataclass(frozen=True, slots=True)
class ChainCut:
    """Where a greedy draft chain stops, from the drafter's own confidence (llama.cpp's p-min,
    its threshold chosen by the row's prices rather than fixed). P_j, the product of the
    drafter's probabilities of tokens 0..j of its chain, stands for the chance that the target
    accepts all of them. With tokens 0..j-1 kept, the round expects E = 1 + P_0 + .. + P_{j-1}
    tokens for C = j c + v(j + 1) target steps; token j, once drafted (c spent), is kept where
    it raises the rate: P_j (C + c) > E (v(j + 2) - v(j + 1)); and the chain goes on only
    where a next token as likely as the last could still pay its own draft step too.

    Example (c = 0.1, v = 1.0, 1.1, 1.2): token 0 at P_0 = 0.9 is kept (0.9 * 1.1 > 1 * 0.1);
    a next token the drafter gives 0.05 (P_1 = 0.045) is dropped (0.045 * 1.3 < 1.9 * 0.1)."""

    draft_step: float  # c
    verify: tuple[float, ...]  # v(1), v(2), ...: the row's prices

    def v(self, positions: int) -> float:
        curve = self.verify
        if positions <= len(curve):
            return curve[positions - 1]
        step = curve[-1] - curve[-2] if len(curve) > 1 else 1.0
        return curve[-1] + step * (positions - len(curve))

    def keep_prices(self, j: int) -> tuple[float, float]:
        """(a, b): token j of a chain is kept where P_j a > (1 + P_0 + .. + P_{j-1}) b."""
        c = self.draft_step
        return j * c + self.v(j + 1) + c, self.v(j + 2) - self.v(j + 1)

    def more_prices(self, j: int) -> tuple[float, float]:
        """(a, b): after a kept token j the chain goes on where P_j a > (1 + P_0 + .. + P_j) b."""
        c, m = self.draft_step, j + 1
        return m * c + self.v(m + 1) + c, c + self.v(m + 2) - self.v(m + 1)

    def keeps(self, cumulative: list[float]) -> bool:
        """Whether the last token of a chain whose cumulative probabilities are `cumulative`
        ([P_0, .., P_j]) is worth verifying."""
        a, b = self.keep_prices(len(cumulative) - 1)
        return cumulative[-1] * a > (1.0 + sum(cumulative[:-1])) * b

    def goes_on(self, cumulative: list[float]) -> bool:
        """Whether to draft another token after a kept chain with these probabilities: one as
        likely as the last would still raise the rate for its draft step and position."""
        a, b = self.more_prices(len(cumulative) - 1)
        return cumulative[-1] * a > (1.0 + sum(cumulative)) * b


def empty_draft() -> Draft:
    return Draft(torch.empty(0, dtype=torch.long), None)


def follow_target(drafter: Drafter | None, runner) -> None:
    """Tie a drafter that reads the target's hidden states (one with `follow`, as
    FeatureDrafter) to the target runner of its sequence; other drafters need nothing."""
    follow = getattr(drafter, "follow", None)
    if follow is not None:
        follow(runner)


def retire(drafter: Drafter | None, history: torch.Tensor, params: SamplingParams) -> None:
    """A request leaves (finished, cancelled or failed) with history [L], its prompt and
    output: a drafter that learns from finished requests (one with `retire`: a cross-request
    lookup cache, `SuffixDrafter`) takes it in; others need nothing."""
    take_in = getattr(drafter, "retire", None)
    if take_in is not None:
        take_in(history, params)


def catch_up(drafter: Drafter | None, prefix_ids: torch.Tensor) -> None:
    """Let a drafter with state (one with `catch_up`: a draft model's KV cache, a feature
    draft's pairs) read what it can of a prompt the target is still taking in chunks.
    prefix_ids [n]: the prompt so far, its first n - 1 tokens in the target's cache (as a
    history is at a proposal). Only a head start: a drafter still reads whatever is left at its
    next proposal, so the output is the target's with or without it (greedy: token for token;
    a seeded sampled row may draw otherwise where the draft's prompt pass rounds differently in
    chunks, as on the native runtime in bfloat16). Lookups need nothing."""
    read = getattr(drafter, "catch_up", None)
    if read is not None:
        read(prefix_ids)


def unread(drafter: Drafter | None, history: torch.Tensor) -> int:
    """Tokens of history [L] a drafter with state has not read yet (one with `unread`: a draft
    model's KV cache), which it reads before its next proposal; 0 for lookups and for drafters
    that read the target's features as it goes."""
    count = getattr(drafter, "unread", None)
    return 0 if count is None else count(history)


def cache_bytes(drafter: Drafter | None) -> int:
    """The memory a drafter's own caches hold (one with `cache_bytes`: a draft model's KV
    cache, a feature draft's layer cache), 0 for lookups and none."""
    count = getattr(drafter, "cache_bytes", None)
    return 0 if count is None else count()


def position_bytes(drafter: Drafter | None) -> int:
    """The memory one position takes in a drafter's own caches (one with
    `bytes_per_position`), 0 for lookups and none."""
    count = getattr(drafter, "bytes_per_position", None)
    return 0 if count is None else count()


def limit_growth(drafter: Drafter | None, positions: int | None) -> None:
    """Let a drafter's own caches (one with `limit_growth`) grow to at most about `positions`
    positions (`Runner.limit_growth`); lookups have none."""
    limit = getattr(drafter, "limit_growth", None)
    if limit is not None:
        limit(positions)


def copy_state(drafter: Drafter, source: Drafter | None, length: int) -> bool:
    """Let a drafter hold what `source` (a drafter of the same kind, another sequence's) holds
    of their shared first `length` tokens, exactly as if it had read them itself (one with
    `copy_state`: a draft model whose cache is exact for any cut into passes). Whether it did;
    where not, its state is unchanged (reset it)."""
    copy = getattr(drafter, "copy_state", None)
    return source is not None and copy is not None and copy(source, length)
