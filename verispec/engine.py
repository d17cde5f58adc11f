"""The speculative decoding loop for one sequence.

Each round: the drafter proposes up to K tokens, the target scores prompt + output + draft in
one forward pass (its KV cache rolled back to the accepted prefix first), verification keeps the
accepted prefix plus one recovered or bonus token. With no drafter every round is one plain
decoding step through the very same code: the baseline.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from verispec.drafters.base import Drafter, empty_draft
from verispec.params import SamplingParams
from verispec.policy import KPolicy
from verispec.runtime import CachedModel
from verispec.sampling import warp
from verispec.stats import StatsRecorder
from verispec.verify import greedy_verify, rejection_sample


def speculate(
    target: CachedModel,
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
    history = prompt_ids
    budget = min(params.max_new_tokens, target.max_positions - int(prompt_ids.numel()))
    generated = 0
    while generated < budget:
        # 1. Draft: a round emits at least one token, so drafting past budget - 1 is wasted. The
        #    policy may verify only part of a proposal, by the kind of proposal it is.
        num_draft = min(policy.next_k(), budget - generated - 1)
        draft = (drafter.propose(history, num_draft, params, generator)
                 if drafter is not None and num_draft > 0 else empty_draft())
        draft = draft.truncated(policy.keep(draft.source, len(draft)))
        draft_tokens = draft.tokens.unsqueeze(0).to(target.device)  # [1, K']
        # 2. One target pass over the K' + 1 positions that follow the history.
        target_logits = target.logits(torch.cat([history, draft.tokens]), len(draft) + 1)
        target_logits = target_logits.unsqueeze(0)  # [1, K'+1, V]
        # 3. Verify.
        if params.greedy:
            tokens, num_accepted = greedy_verify(draft_tokens, target_logits)
        else:
            draft_probs = None if draft.probs is None else draft.probs.unsqueeze(0)
            tokens, num_accepted = rejection_sample(
                draft_tokens, draft_probs, warp(target_logits, params), generator)
        accepted = int(num_accepted[0])
        new_tokens = tokens[0, : accepted + 1].tolist()  # the one host sync of the round
        # 4. Cut at EOS and at the budget, then append.
        new_tokens = new_tokens[: budget - generated]
        hit_eos = False
        if not params.ignore_eos:
            for i, token in enumerate(new_tokens):
                if token in eos_ids:
                    new_tokens, hit_eos = new_tokens[: i + 1], True
                    break
        policy.update(draft.source, len(draft), accepted)
        stats.record_round(len(draft), accepted, len(new_tokens))
        history = torch.cat([history, torch.tensor(new_tokens, dtype=torch.long)])
        generated += len(new_tokens)
        yield new_tokens
        if hit_eos:
            return
