"""A small draft model that shares the target's tokenizer."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from verispec.drafters.base import Draft
from verispec.params import SamplingParams
from verispec.runtime import CachedModel
from verispec.sampling import sample, warp


class ModelDrafter:
    """Draft k tokens autoregressively with a small causal LM (its own KV cache), sampling from
    its warped distribution (argmax when greedy) and returning that distribution for verification.

    The draft's logits are fitted to the target's vocabulary width first (cut, or padded with
    -inf), so q is exactly the distribution the draft tokens were drawn from. A draft whose head
    covers a subset of the vocabulary (a distilled draft) gives `head_token_ids` [Vh]: its logit
    j belongs to token head_token_ids[j], and every other token gets -inf.
    """

    name = "draft"

    def __init__(self, model: PreTrainedModel | CachedModel, target_vocab_size: int,
                 head_token_ids: torch.Tensor | None = None) -> None:
        """model: an HF causal LM (run by transformers) or a runner built for it
        (`verispec.runtime.make_runner`)."""
        self.runner = model if isinstance(model, CachedModel) else CachedModel(model)
        self.target_vocab_size = target_vocab_size
        self.head_token_ids = None if head_token_ids is None else head_token_ids.long()

    def reset(self) -> None:
        self.runner.reset()

    def propose(
        self,
        history: torch.Tensor,  # [L] long
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        ids = history
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            # 1. Next-token logits of the draft, on the target's vocabulary.
            logits = self._fit_vocab(self.runner.logits(ids, 1))  # [1, V]
            # 2. Draw (or take the argmax) and extend.
            if params.greedy:
                token = logits.argmax(dim=-1).cpu()  # [1]
            else:
                draft_probs = warp(logits, params)  # [1, V]
                token = sample(draft_probs, generator).cpu()
                probs.append(draft_probs[0])
            tokens.append(token)
            ids = torch.cat([ids, token])
        if not tokens:
            return Draft(torch.empty(0, dtype=torch.long), None)
        return Draft(torch.cat(tokens), torch.stack(probs) if probs else None)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.head_token_ids is not None:  # [..., Vh] -> [..., V], -inf outside the head
            full = logits.new_full((*logits.shape[:-1], self.target_vocab_size), float("-inf"))
            index = self.head_token_ids.to(logits.device).expand(*logits.shape[:-1], -1)
            return full.scatter(-1, index, logits)
        width = logits.shape[-1]
        if width == self.target_vocab_size:
            return logits
        if width > self.target_vocab_size:
            return logits[..., : self.target_vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
