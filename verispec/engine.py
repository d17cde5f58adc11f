"""The speculative decoding round of one sequence, and the loop for one sequence alone.

Each round: the drafter proposes up to K tokens, the target scores prompt + output + draft in
one forward pass (its KV cache rolled back to the accepted prefix first), verification keeps the
accepted prefix plus one recovered or bonus token. With no drafter every round is one plain
decoding step through the very same code: the baseline.

`Sequence` holds one request's state and splits a round around the target pass
(`num_to_draft` -> drafter -> `begin` -> target pass -> `finish`), so that the batch
scheduler (verispec.scheduler) can put many sequences' passes into one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from verispec.drafters.base import Draft, Drafter
from verispec.drafters.batch import propose_batch
from verispec.params import SamplingParams
from verispec.policy import KPolicy
from verispec.runtime import Runner
from verispec.sampling import warp
from verispec.stats import StatsRecorder
from verispec.verify import (
    greedy_verify,
    greedy_verify_tree,
    rejection_sample,
    rejection_sample_tree,
)


@dataclass(frozen=True, slots=True)
class Round:
    """What a sequence asks of the target this round: logits for the last num_logits of ids."""

    draft: Draft
    ids: torch.Tensor  # [L + K'] history + draft tokens
    num_logits: int  # K' + 1

    @property
    def parents(self) -> torch.Tensor | None:
        """The draft's tree links, for the target pass (None: a chain)."""
        return self.draft.parents


class Sequence:
    """One request being decoded: its history, token budget, K policy, generator and stats."""

    def __init__(self, prompt_ids: torch.Tensor, params: SamplingParams, policy: KPolicy,
                 eos_ids: frozenset[int], generator: torch.Generator | None,
                 stats: StatsRecorder, max_positions: int) -> None:
        self.history = prompt_ids  # [L] long, on the cpu
        self.params, self.policy, self.eos_ids = params, policy, eos_ids
        self.generator, self.stats = generator, stats
        self.budget = min(params.max_new_tokens, max_positions - int(prompt_ids.numel()))
        self.generated = 0
        self.finished = self.budget <= 0

    def num_to_draft(self, k: int | None = None, free: bool = False) -> int:
        """Draft tokens to ask for: the policy's K (or k; free: for a lookup), but a round emits
        at least one token, so drafting past budget - 1 is wasted."""
        k = self.policy.next_k(free, int(self.history.numel())) if k is None else k
        return max(0, min(k, self.budget - self.generated - 1))

    def begin(self, draft: Draft) -> Round:
        """The target pass for this draft; the policy may verify only part of it, by the kind
        of proposal it is."""
        context = int(self.history.numel())
        draft = draft.truncated(self.policy.keep(draft.source, draft.depth, context))
        if draft.scores is not None:  # a tree: its likeliest tokens, as many as pay
            draft = draft.pruned(self.policy.tree_size(draft.scores, context, draft.depth))
        return Round(draft, torch.cat([self.history, draft.tokens]), len(draft) + 1)

    def finish(self, round: Round, target_logits: torch.Tensor) -> list[int]:
        """Verify the round against target_logits [K'+1, V]; return the tokens it adds."""
        draft = round.draft
        draft_tokens = draft.tokens.unsqueeze(0).to(target_logits.device)  # [1, K']
        target_logits = target_logits.unsqueeze(0)  # [1, K'+1, V]
        # 1. Verify (a tree: the path the target's argmax follows, or multi-candidate
        #    rejection sampling down it).
        if draft.parents is not None and self.params.greedy:
            new_tokens, path = greedy_verify_tree(draft.tokens, draft.parents, target_logits[0])
            accepted = len(path)
            if draft.scores is not None:
                self.policy.update_tree(float(draft.scores.exp().sum()), accepted)
        elif draft.parents is not None:
            if draft.probs is None:
                raise ValueError("a sampled token tree needs the draft's probabilities")
            new_tokens, path = rejection_sample_tree(
                draft.tokens, draft.parents, draft.probs,
                warp(target_logits[0], self.params), self.generator)
            accepted = len(path)
        elif self.params.greedy:
            tokens, num_accepted = greedy_verify(draft_tokens, target_logits)
            accepted = int(num_accepted[0])
            new_tokens = tokens[0, : accepted + 1].tolist()  # the one host sync of the round
        else:
            draft_probs = None if draft.probs is None else draft.probs.unsqueeze(0)
            tokens, num_accepted = rejection_sample(
                draft_tokens, draft_probs, warp(target_logits, self.params), self.generator)
            accepted = int(num_accepted[0])
            new_tokens = tokens[0, : accepted + 1].tolist()
        # 2. Cut at EOS and at the budget, then append.
        new_tokens = new_tokens[: self.budget - self.generated]
        if not self.params.ignore_eos:
            for i, token in enumerate(new_tokens):
                if token in self.eos_ids:
                    new_tokens, self.finished = new_tokens[: i + 1], True
                    break
        # 3. Bookkeeping (a tree counts as a chain of its depth: acceptance per position).
        self.policy.update(draft.source, draft.depth, accepted)
        self.stats.record_round(draft.depth, accepted, len(new_tokens))
        self.history = torch.cat([self.history, torch.tensor(new_tokens, dtype=torch.long)])
        self.generated += len(new_tokens)
        self.finished = self.finished or self.generated >= self.budget
        return new_tokens


def speculate(
    target: Runner,
    drafter: Drafter | None,
    prompt_ids: torch.Tensor,  # [L] long, on the cpu
    params: SamplingParams,
    policy: KPolicy,
    eos_ids: frozenset[int],
    generator: torch.Generator | None,
    stats: StatsRecorder,
) -> Iterator[list[int]]:
    """Yield the tokens each round adds, until EOS (kept as the last token), the token budget or
    the model's context is reached."""
    sequence = Sequence(prompt_ids, params, policy, eos_ids, generator, stats,
                        target.max_positions)
    while not sequence.finished:
        # 1. Draft: a draft model up to its priced K, a lookup up to the free K.
        draft = propose_batch([drafter], [sequence.history], [sequence.num_to_draft()], [params],
                              [generator], free_ks=[sequence.num_to_draft(free=True)],
                              policies=[policy])[0]
        # 2. One target pass over the K' + 1 positions that follow the history.
        round = sequence.begin(draft)
        target_logits = target.logits(round.ids, round.num_logits,
                                      round.parents)  # [K'+1, V]
        # 3. Verify and append.
        yield sequence.finish(round, target_logits)
