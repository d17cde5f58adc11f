"""Drafting for many sequences at once (the batch scheduler and the batch cost model)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verispec.drafters.drafter import ChainCut, Draft, Drafter, empty_draft
from verispec.drafters.feature import FeatureDrafter, propose_features_together
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.model import ModelDrafter, propose_together
from verispec.params import SamplingParams


def propose_batch(drafters: list[Drafter | None], histories: list[torch.Tensor], ks: list[int],
                  params: list[SamplingParams], generators: list[torch.Generator | None],
                  free_ks: list[int] | None = None,
                  lookup_keeps: list[Callable[[Draft], int]] | None = None,
                  greedy_trees: bool = True,
                  cuts: list[ChainCut | None] | None = None) -> list[Draft]:
    """Drafter.propose for every row: lookups row by row; draft models and feature drafts in
    lockstep, one pass per draft step for all their rows; a hybrid row looks up first (up to
    its free_ks tokens: a lookup costs nothing, so it may propose more than the draft model's
    priced K) and joins the draft-model (or feature) rows, up to ks tokens, when nothing
    matches, or when its row would verify none of the lookup's tokens (lookup_keeps: how many
    of a lookup's tokens the row verifies, by its kind of match). free_ks defaults to ks. A
    row with no drafter or a budget of 0 drafts nothing. greedy_trees=False: feature drafts
    propose chains for greedy rows. cuts: where a greedy row's draft-model chain may stop
    early (`ChainCut`; None: at its K)."""
    free_ks = ks if free_ks is None else free_ks
    drafts: list[Draft] = [empty_draft() for _ in drafters]
    model_rows: list[tuple[int, ModelDrafter]] = []
    feature_rows: list[tuple[int, FeatureDrafter]] = []
    for i, drafter in enumerate(drafters):
        if isinstance(drafter, HybridDrafter):
            if free_ks[i] > 0:
                draft = drafter.lookup.propose(histories[i], free_ks[i], params[i], None)
                keep = len(draft) if lookup_keeps is None else lookup_keeps[i](draft)
                drafts[i] = draft.truncated(keep)
            if len(drafts[i]):
                continue
            drafter = drafter.model
        if drafter is None or ks[i] == 0:
            continue
        if isinstance(drafter, ModelDrafter):
            model_rows.append((i, drafter))
        elif isinstance(drafter, FeatureDrafter):
            feature_rows.append((i, drafter))
        else:
            drafts[i] = drafter.propose(histories[i], ks[i], params[i], generators[i])
    def columns(rows: list) -> tuple[list, ...]:
        return ([drafter for _, drafter in rows], [histories[i] for i, _ in rows],
                [ks[i] for i, _ in rows], [params[i] for i, _ in rows],
                [generators[i] for i, _ in rows])

    if model_rows:
        row_cuts = [None if cuts is None else cuts[i] for i, _ in model_rows]
        for (i, _), draft in zip(model_rows, propose_together(*columns(model_rows),
                                                              cuts=row_cuts), strict=True):
            drafts[i] = draft
    if feature_rows:
        for (i, _), draft in zip(feature_rows, propose_features_together(
                *columns(feature_rows), greedy_trees=greedy_trees), strict=True):
            drafts[i] = draft
    return drafts
