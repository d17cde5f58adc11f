"""A drafter that reads the target's features: an EAGLE-style head (`verispec.distill.feature`)
run on the native runtime.

The target's native runner keeps every position's last hidden state (`cache.features`). After a
round, the history's last token x_{L-1} was just drawn from the target at position L-2, whose
feature f_{L-2} is known: the draft reads (f_s, x_{s+1}) for every position s it has not read
yet, up to L-2, then drafts x_L, x_{L+1}, ... feeding its own predicted features back in. Its
KV cache is indexed by position like the target's: positions past the last real feature are
written over in the next round. The first round (no target features yet) drafts nothing.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import PreTrainedModel

from verispec.drafters.base import Draft, empty_draft
from verispec.drafters.model import fit_vocab
from verispec.errors import IncompatibleDraftError
from verispec.native.llama import LayerWeights, Linear, LlamaShape, NativeLlama, RowPass
from verispec.params import SamplingParams
from verispec.runtime import common_prefix
from verispec.sampling import sample, warp


class FeatureDrafter:
    """One sequence's feature drafter. `follow(runner)` ties it to the target runner of the same
    sequence (the decoder and the scheduler do this); `fork()` gives one for another sequence."""

    name = "feature"

    def __init__(self, weights: dict[str, torch.Tensor], head_token_ids: torch.Tensor,
                 target: PreTrainedModel, vocab_size: int) -> None:
        self.weights, self.head_token_ids = weights, head_token_ids.long()
        self.target_model, self.vocab_size = target, vocab_size
        self.runner = None  # the target's NativeCachedModel for this sequence
        self.model: _FeatureModel | None = None  # built on the first follow(), shared by forks
        self.cache = None
        self.fed = torch.empty(0, dtype=torch.long)  # history whose real pairs are in the cache

    def follow(self, runner) -> None:
        from verispec.native.runner import NativeCachedModel

        if not isinstance(runner, NativeCachedModel):
            raise IncompatibleDraftError("a feature draft reads the target's hidden states, which "
                                         "only the native runtime keeps: use --runtime native "
                                         "(or auto) with a Llama-family target")
        if self.model is None:
            self.model = _FeatureModel(self.weights, self.head_token_ids, self.target_model,
                                       runner.model)
        self.runner = runner
        self.cache = self.model.native.new_cache()
        self.reset()

    def reset(self) -> None:
        self.fed = torch.empty(0, dtype=torch.long)

    def fork(self) -> FeatureDrafter:
        other = FeatureDrafter(self.weights, self.head_token_ids, self.target_model,
                               self.vocab_size)
        other.model = self.model
        return other

    def propose(
        self,
        history: torch.Tensor,  # [L] long
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        if self.runner is None:
            raise RuntimeError("FeatureDrafter.follow(target runner) must come first")
        length = int(history.numel())
        # 1. The target's features are good for the positions whose tokens it saw as they are.
        known = common_prefix(self.runner.cached_ids, history)
        if k <= 0 or length < 2 or known < length - 1:
            return empty_draft()
        # 2. Read the pairs (f_s, x_{s+1}) not read yet (at least the last one), s <= L-2.
        first = max(0, min(common_prefix(self.fed, history) - 1, length - 2))
        model, features = self.model, self.runner.cache.features
        logits = model.step(self.cache, features[first:length - 1], history[first + 1:length],
                            first)  # [1, Vh]
        self.fed = history
        # 3. Draft k tokens, each step reading the draft's own predicted feature.
        tokens, probs, position = [], [], length - 2
        for step in range(k):
            logits = fit_vocab(logits, self.vocab_size, self.head_token_ids)  # [1, V]
            if params.greedy:
                token = logits.argmax(dim=-1).cpu()  # [1]
            else:
                draft_probs = warp(logits, params)  # [1, V]
                token = sample(draft_probs, generator).cpu()
                probs.append(draft_probs[0])
            tokens.append(token)
            if step + 1 < k:
                predicted = self.cache.features[position:position + 1]  # [1, H]
                position += 1
                logits = model.step(self.cache, predicted, token, position)
        return Draft(torch.cat(tokens), torch.stack(probs) if probs else None)


class _FeatureModel:
    """The head's weights on the target's runtime: fc, one layer, the target's norm and head
    rows (a NativeLlama of one layer fed with fused vectors instead of token embeddings)."""

    def __init__(self, weights: dict[str, torch.Tensor], head_token_ids: torch.Tensor,
                 target: PreTrainedModel, target_native: NativeLlama) -> None:
        dtype, device = target_native.dtype, target_native.device

        def cast(name: str) -> torch.Tensor:
            return weights[name].to(dtype=dtype, device=device).contiguous()

        layer = LayerWeights(
            attn_norm=cast("attn_norm"),
            qkv=Linear(torch.cat([cast("q.weight"), cast("k.weight"), cast("v.weight")])),
            out=Linear(cast("o.weight")),
            mlp_norm=cast("mlp_norm"),
            gate_up=Linear(torch.cat([cast("gate.weight"), cast("up.weight")])),
            down=Linear(cast("down.weight")))
        head = target.get_output_embeddings().weight.detach()[head_token_ids]
        shape = dataclasses.replace(LlamaShape.from_config(target.config), num_layers=1,
                                    vocab_size=int(head_token_ids.numel()))
        self.embed = target_native.embed  # [V, H], the target's own table
        self.fc = Linear(cast("fc.weight"))  # 2H -> H
        self.native = NativeLlama(shape, self.embed, [layer], target_native.final_norm,
                                  Linear(head.to(dtype=dtype, device=device).contiguous()))

    def step(self, cache, features: torch.Tensor, next_ids: torch.Tensor, start: int
             ) -> torch.Tensor:
        """Pairs at positions start.. (features [T, H], next_ids [T]) -> logits [1, Vh] of the
        last position; predicted features land in cache.features."""
        inputs = self.fc(torch.cat([features, self.embed[next_ids]], dim=-1))  # [T, H]
        return self.native.forward_rows([RowPass(cache, next_ids, start, 1)], inputs=inputs)[0]

