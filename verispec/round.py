"""One round of a batch: plan, draft, score, verify.

    plan    how much every decoding row drafts and verifies (verispec.planner)
    draft   each decoding row's proposal: its prediction first, then lookups and draft models
            (in lockstep passes), each cut to what it pays for
    score   one target pass over every row's history + draft, or a feeding row's next prompt
            chunk; a feeding row's draft model reads the chunk too, where that pays
    verify  every decoding row's draft against its logits, by its own method and generator;
            what each policy and each row's stats learn

`run_round` runs the four in order; the engine (verispec.engine) chooses the rows and applies
what they verified. Nothing here measures a cost: a round is priced from the cost models the
planner was given, and a lone row's round tells the planner what its pass and its draft took
(`RoundPlanner.observe`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from verispec.drafters.batch_drafting import propose_batch
from verispec.drafters.drafter import Draft, catch_up, empty_draft, unread
from verispec.planner import RoundPlan, RoundPlanner
from verispec.request import Request, Round
from verispec.runtime import batched_logits
from verispec.verify import Verified, verify_drafts
from verispec.verify.drafts import RowState


def run_round(planner: RoundPlanner, feeding: list[Request], decoding: list[Request]
              ) -> list[Verified]:
    """One round: the feeding rows take their next prompt chunk (up to `request.prompt_fed`,
    which the scheduler set), the decoding rows draft and verify. Returns the decoding rows'
    verified rounds, in order."""
    started = time.perf_counter()
    plan = planner.plan(decoding)
    lag = unread(decoding[0].drafter, decoding[0].history) if len(decoding) == 1 else 0
    drafting = time.perf_counter()
    drafts, model_depths = draft(planner, decoding, plan)
    drafted = time.perf_counter()
    rounds = [Round(d, torch.cat([r.history, d.tokens]), len(d) + 1)
              for r, d in zip(decoding, drafts, strict=True)]
    logits = score(planner, feeding, decoding, rounds)
    scored = time.perf_counter()
    verified = verify(decoding, rounds, logits)
    if len(decoding) == 1 and not feeding:
        planner.observe(plan, rounds[0].num_logits, scored - drafted, model_depths[0],
                        drafted - drafting, lag, time.perf_counter() - started,
                        len(verified[0].tokens))
    return verified


def draft(planner: RoundPlanner, requests: list[Request], plan: RoundPlan
          ) -> tuple[list[Draft], list[int]]:
    """Every row's proposal, cut to what it pays for (`RoundPlanner.keep`): a row's prediction
    first (a row it proposes for drafts nothing else), then draft models in lockstep passes up
    to the round's K and lookups up to theirs. Also each row's draft-model proposal's depth as
    drafted, before the cut (0 where a lookup or a prediction proposed, or nothing did)."""
    keeps = [planner.lookup_keep(r, row) for r, row in zip(requests, plan.rows, strict=True)]
    predicted = [_predict(r, row.free_k, keep)
                 for r, row, keep in zip(requests, plan.rows, keeps, strict=True)]
    idle = [len(p) > 0 for p in predicted]  # rows their prediction proposes for
    drafts = propose_batch(
        [r.drafter for r in requests], [r.history for r in requests],
        [0 if i else row.k for i, row in zip(idle, plan.rows, strict=True)],
        [r.params for r in requests], [r.generator for r in requests],
        [0 if i else row.free_k for i, row in zip(idle, plan.rows, strict=True)],
        keeps, greedy_trees=plan.greedy_trees, cuts=[row.cut for row in plan.rows])
    drafts = [p if i else d for p, d, i in zip(predicted, drafts, idle, strict=True)]
    model_depths = [d.depth if d.source == 0 else 0 for d in drafts]
    return planner.keep(requests, drafts, plan), model_depths


def score(planner: RoundPlanner, feeding: list[Request], decoding: list[Request],
          rounds: list[Round]) -> list[torch.Tensor]:
    """One target pass over every decoding row's round and every feeding row's next chunk ->
    the decoding rows' logits [K'+1, V] each. A feeding row's draft model then reads the chunk
    the target just took (a feature draft needs its features), not the whole prompt at its
    first proposal; a draft model only where reading the whole prompt will pay."""
    rounds = rounds + [Round(empty_draft(), r.history[: r.prompt_fed], 1) for r in feeding]
    rows = decoding + feeding
    logits = batched_logits([r.runner for r in rows], [rd.ids for rd in rounds],
                            [rd.num_logits for rd in rounds], [rd.parents for rd in rounds])
    for request in feeding:
        if planner.catch_up_pays(request, request.context, rows=len(rows)):
            catch_up(request.drafter, request.history[: request.prompt_fed + 1])
    return logits[: len(decoding)]


def verify(requests: list[Request], rounds: list[Round], logits: list[torch.Tensor]
           ) -> list[Verified]:
    """Verify every row of a round against its target logits [K'+1, V]
    (`verify.verify_drafts`: chains in one ragged call, trees row by row, each row by its own
    method and generator); record what each policy and each row's stats learn."""
    verified = verify_drafts([round.draft for round in rounds], logits,
                             [RowState(r.params, r.generator, r.context) for r in requests])
    # Bookkeeping (a tree counts as a chain of its depth: acceptance per position).
    for request, round, result in zip(requests, rounds, verified, strict=True):
        draft = round.draft
        if draft.scores is not None:
            request.policy.update_tree(float(draft.scores.exp().sum()), result.accepted)
        request.policy.update(draft.source, draft.depth, result.accepted)
        request.stats.record_source(draft.source, draft.depth, result.accepted)
    return verified


def _predict(request: Request, k: int, keep: Callable[[Draft], int]) -> Draft:
    """The row's prediction's proposal, where it has one worth verifying."""
    if request.prediction is None:
        return empty_draft()
    proposal = request.prediction.propose(request.history, k)
    return proposal if len(proposal) and keep(proposal) > 0 else empty_draft()
