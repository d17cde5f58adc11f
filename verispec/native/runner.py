"""The native model behind the same interface as `verispec.runtime.CachedModel`."""

from __future__ import annotations

import torch

from verispec.native.llama import NativeLlama
from verispec.runtime import CachedModel


class NativeCachedModel(CachedModel):
    """One sequence of a NativeLlama. Its KV buffer is indexed by position, so truncating the
    cache is only forgetting the ids: the next pass writes over the stale positions."""

    def __init__(self, model: NativeLlama) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = int(model.lm_head.out_features)
        self.max_positions = model.shape.max_positions
        self._cached_ids = torch.empty(0, dtype=torch.long)
        self.forward_calls = 0

    def describe(self) -> str:
        return self.model.describe()

    def reset(self) -> None:
        self._cached_ids = torch.empty(0, dtype=torch.long)

    def _forward(self, new_ids: torch.Tensor, start: int, num_logits: int) -> torch.Tensor:
        return self.model.forward(new_ids, start=start, num_logits=num_logits)

    def _truncate(self, length: int) -> None:
        pass
