"""The native model behind the same interface as `verispec.runtime.CachedModel`."""

from __future__ import annotations

import torch

from verispec.native.llama import NativeLlama
from verispec.runtime import common_prefix


class NativeCachedModel:
    """One sequence of a NativeLlama: `logits(ids, n)` rolls the cache back to the longest
    shared prefix (moving a length) and runs the rest in one pass."""

    def __init__(self, model: NativeLlama) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = int(model.lm_head.out_features)
        self.max_positions = model.shape.max_positions
        self._cached_ids = torch.empty(0, dtype=torch.long)
        self.forward_calls = 0

    @property
    def cached_length(self) -> int:
        return int(self._cached_ids.numel())

    def reset(self) -> None:
        self._cached_ids = torch.empty(0, dtype=torch.long)

    def rollback(self, length: int) -> None:
        self._cached_ids = self._cached_ids[:length]

    def logits(self, ids: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        length = int(ids.numel())
        if not 1 <= num_logits <= length:
            raise ValueError(f"num_logits must be in [1, {length}], got {num_logits}")
        keep = min(common_prefix(self._cached_ids, ids), length - num_logits)
        logits = self.model.forward(ids[keep:], start=keep, num_logits=num_logits)
        self.forward_calls += 1
        self._cached_ids = ids.clone()
        return logits
