"""The native model behind the same interface as `verispec.runtime.CachedModel`, one sequence
per runner; `batched_logits` runs many runners of one model in a single forward pass."""

from __future__ import annotations

import torch

from verispec.native.llama import INVARIANT_MAX, NativeLlama, RowPass
from verispec.runtime import CachedModel


class NativeCachedModel(CachedModel):
    """One sequence of a NativeLlama, with its own KV cache. The cache is indexed by position, so
    truncating it is only forgetting the ids: the next pass writes over the stale positions.
    Runners made by `sibling()` share the model's weights, one sequence each."""

    def __init__(self, model: NativeLlama) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = int(model.lm_head.out_features)
        self.max_positions = model.shape.max_positions
        self.cache = model.new_cache()
        self._cached_ids = torch.empty(0, dtype=torch.long)
        self.forward_calls = 0

    def sibling(self) -> NativeCachedModel:
        """Another sequence on the same weights."""
        return NativeCachedModel(self.model)

    def describe(self) -> str:
        return self.model.describe()

    def reset(self) -> None:
        self._cached_ids = torch.empty(0, dtype=torch.long)

    def _forward(self, new_ids: torch.Tensor, start: int, num_logits: int) -> torch.Tensor:
        return forward_invariant(self.model, [RowPass(self.cache, new_ids, start, num_logits)])[0]

    def _truncate(self, length: int) -> None:
        pass


def batched_logits(runners: list[NativeCachedModel], sequences: list[torch.Tensor],
                   num_logits: list[int]) -> list[torch.Tensor]:
    """runner.logits(ids, n) for every (runner, ids, n) at once: one forward pass of the shared
    model over every row's new positions -> per row logits [n, V]. A row's logits equal what
    runner.logits alone returns, bit for bit."""
    model = runners[0].model
    if any(runner.model is not model for runner in runners):
        raise ValueError("batched rows must share one model")
    rows = []
    for runner, ids, count in zip(runners, sequences, num_logits, strict=True):
        keep = runner.prepare(ids, count)
        rows.append(RowPass(runner.cache, ids[keep:], keep, count))
    logits = forward_invariant(model, rows)
    for runner, ids in zip(runners, sequences, strict=True):
        runner.commit(ids)
    return logits


def forward_invariant(model: NativeLlama, rows: list[RowPass]) -> list[torch.Tensor]:
    """model.forward_rows(rows), with one guard: a row that appends draft tokens to a prompt
    pass has its prompt run first, on its own, then its draft tokens.

    A prompt pass (more than INVARIANT_MAX new positions) attends with one masked kernel whose
    rounding depends on the number of positions, so plain decoding's prompt pass (the prompt
    alone) and a speculative first round (prompt + draft) would cache slightly different keys
    and values, and outputs could part later. Split, every position gets the same bits in both.
    """
    split = [row.ids.numel() > INVARIANT_MAX and row.num_logits > 1 for row in rows]
    if not any(split):
        return model.forward_rows(rows)
    # 1. The prompts of the split rows: the positions before their draft tokens.
    prompts = [RowPass(row.cache, row.ids[: row.ids.numel() - row.num_logits + 1], row.start, 1)
               for row, cut in zip(rows, split, strict=True) if cut]
    prompt_logits = iter(model.forward_rows(prompts))  # [1, V] each
    # 2. Everything else: the split rows' draft tokens, the other rows whole.
    rest = [RowPass(row.cache, row.ids[-(row.num_logits - 1):],
                    row.start + row.ids.numel() - row.num_logits + 1, row.num_logits - 1)
            if cut else row for row, cut in zip(rows, split, strict=True)]
    rest_logits = model.forward_rows(rest)
    return [torch.cat([next(prompt_logits), logits]) if cut else logits
            for logits, cut in zip(rest_logits, split, strict=True)]
