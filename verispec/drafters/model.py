"""A small draft model that shares the target's tokenizer."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from verispec.drafters.drafter import ChainCut, Draft, empty_draft
from verispec.params import SamplingParams
from verispec.runtime import HFRunner, Runner, batched_logits, common_prefix
from verispec.sampling import draw, greedy_tokens, has_mass, warp


class ModelDrafter:
    """Draft k tokens autoregressively with a small causal LM (its own KV cache), sampling from
    its warped distribution (argmax when greedy) and returning that distribution for verification.

    The draft's logits are fitted to the target's vocabulary width first (cut, or padded with
    -inf), so q is exactly the distribution the draft tokens were drawn from. A draft whose head
    covers a subset of the vocabulary (a distilled draft) gives `head_token_ids` [Vh]: its logit
    j belongs to token head_token_ids[j], and every other token gets -inf.
    """

    name = "draft"

    def __init__(self, model: PreTrainedModel | Runner, target_vocab_size: int,
                 head_token_ids: torch.Tensor | None = None) -> None:
        """model: an HF causal LM (run by transformers) or a runner built for it
        (`verispec.runtime.make_runner`)."""
        self.runner = model if isinstance(model, Runner) else HFRunner(model)
        self.target_vocab_size = target_vocab_size
        self.head_token_ids = None if head_token_ids is None else head_token_ids.long()
        # the runner's quantised kernels' greedy_top, where it has them (kernels/greedy.h)
        kernels = getattr(getattr(self.runner, "model", None), "kernels", None)
        self._kernel_top = getattr(kernels, "greedy_top", None)

    def reset(self) -> None:
        self.runner.reset()

    def propose(
        self,
        history: torch.Tensor,  # [L] long
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        return propose_together([self], [history], [k], [params], [generator])[0]

    def catch_up(self, prefix_ids: torch.Tensor) -> None:
        """Feed prefix_ids [n] (a prompt as far as the target has taken it) into the draft's
        cache now, so its first proposal feeds only the rest: a long prompt's draft prefill
        then comes a chunk a round, beside the target's chunks, instead of in one pass."""
        if common_prefix(self.runner.cached_ids, prefix_ids) < prefix_ids.numel():
            self.runner.logits(prefix_ids, 1)

    def unread(self, history: torch.Tensor) -> int:
        """Tokens of history [L] not in the draft's cache: its next proposal feeds them."""
        return int(history.numel()) - common_prefix(self.runner.cached_ids, history)

    def cache_bytes(self) -> int:
        """verispec.drafters.drafter.cache_bytes: the draft model's KV cache."""
        return self.runner.cache_bytes

    def bytes_per_position(self) -> int:
        return self.runner.bytes_per_position

    def limit_growth(self, positions: int | None) -> None:
        self.runner.limit_growth(positions)

    def copy_state(self, source: ModelDrafter, length: int) -> bool:
        """verispec.drafters.drafter.copy_state: the source's cached first `length` tokens (as
        many as it holds), where the draft's caches are exact (`Runner.exact_prefixes`)."""
        if not (isinstance(source, ModelDrafter) and self.runner.exact_prefixes):
            return False
        length = min(length, source.runner.cached_length)
        if length == 0:  # nothing to copy (a source that never drafted): start empty
            return False
        self.runner.copy_prefix(source.runner, length)
        return True

    def fork(self) -> ModelDrafter:
        """A drafter for another sequence: same weights, its own cache."""
        return ModelDrafter(self.runner.sibling(), self.target_vocab_size, self.head_token_ids)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.target_vocab_size, self.head_token_ids)

    def _fit_head(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [..., W] of the tokens the draft can propose: its head's (all of them
        with head_token_ids), else its first target_vocab_size (a wider head's extra rows are
        no tokens of the target's; a narrower one lacks the rest, -inf in `fit_vocab`)."""
        if self.head_token_ids is None and logits.shape[-1] > self.target_vocab_size:
            return logits[..., : self.target_vocab_size]
        return logits

    def _greedy_top(self, head_logits: torch.Tensor, sure: bool) -> tuple[torch.Tensor, float]:
        """A greedy step's choice over `_fit_head`'s logits [1, W]: the target's token id [1]
        of the first largest, and (when `sure`, else NaN) the draft's probability of it."""
        if self._kernel_top is not None and head_logits.dtype == torch.float32 \
                and head_logits.device.type == "cpu" and head_logits.stride(-1) == 1:
            index, probability = self._kernel_top(head_logits)
            return self._token_ids(index), float(probability[0])
        index = greedy_tokens(head_logits)
        if not sure:
            return self._token_ids(index), float("nan")
        row = head_logits[0].float()
        return self._token_ids(index), float((row.max() - torch.logsumexp(row, -1)).exp())

    def _greedy_chain(self, history: torch.Tensor, steps: int, cut: ChainCut | None,
                      prior: list[float]) -> tuple[torch.Tensor, list[float]] | None:
        """Up to `steps` greedy draft tokens after history [L] in one call, where the runner
        can run the chain (its cache holds all of history but the last token,
        `NativeRunner.greedy_chain`): the tokens [n] and their cumulative probabilities, cut
        as `cut` decides after the chain's earlier P's `prior`; None otherwise."""
        chain = getattr(self.runner, "greedy_chain", None)
        if chain is None or (self.head_token_ids is None
                             and self.runner.vocab_size > self.target_vocab_size):
            return None  # (a head wider than the target's vocabulary: `_fit_head` cuts it)
        ids = None if self.head_token_ids is None else self.head_token_ids.contiguous()
        result = chain(history, steps, ids, cut, prior)
        if result is None:
            return None
        tokens, cumulative = result
        return torch.tensor(tokens, dtype=torch.long), cumulative

    def _token_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Indices into `_fit_head`'s logits -> the target's token ids (on the CPU)."""
        positions = positions.cpu()
        return positions if self.head_token_ids is None else self.head_token_ids[positions]


def fit_vocab(logits: torch.Tensor, vocab_size: int, head_token_ids: torch.Tensor | None = None
              ) -> torch.Tensor:
    """A draft's logits [..., W] on the target's vocabulary [..., vocab_size]: logit j belongs
    to token head_token_ids[j] when given (-inf for every other token), else to token j (cut,
    or padded with -inf)."""
    if head_token_ids is not None:
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        index = head_token_ids.to(logits.device).expand(*logits.shape[:-1], -1)
        return full.scatter(-1, index, logits)
    width = logits.shape[-1]
    if width == vocab_size:
        return logits
    if width > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def propose_together(drafters: list[ModelDrafter], histories: list[torch.Tensor], ks: list[int],
                     params: list[SamplingParams], generators: list[torch.Generator | None],
                     cuts: list[ChainCut | None] | None = None) -> list[Draft]:
    """ModelDrafter.propose for many sequences in lockstep: draft step j is one batched pass
    (`verispec.runtime.batched_logits`) over the rows that still want a j-th token. Each row
    draws from its own warped distribution with its own generator, exactly as alone. cuts: a
    greedy row's chain stops early where its ChainCut says its confidence no longer pays (a
    proposal's length may depend on the drafter's own probabilities: verification is exact
    for any draft)."""
    sequences = list(histories)
    ks = list(ks)
    tokens: list[list[torch.Tensor]] = [[] for _ in drafters]
    probs: list[list[torch.Tensor]] = [[] for _ in drafters]
    confidence: list[list[float]] = [[] for _ in drafters]  # a cut row's P_0, P_1, ..
    for step in range(max(ks, default=0)):
        rows = [i for i, k in enumerate(ks) if k > step]
        if not rows:
            break
        # 1. A lone greedy row: the rest of its chain in one call, where its runner can.
        if len(rows) == 1 and params[rows[0]].greedy:
            i = rows[0]
            chain = drafters[i]._greedy_chain(sequences[i], ks[i] - step,
                                              None if cuts is None else cuts[i], confidence[i])
            if chain is not None:
                if chain[0].numel():
                    tokens[i].append(chain[0])
                break
        # 2. Next-token logits of each drafting row, on the target's vocabulary.
        logits = batched_logits([drafters[i].runner for i in rows],
                                [sequences[i] for i in rows], [1] * len(rows))
        # 3. Each row draws (or takes the argmax) and extends its sequence.
        for i, row_logits in zip(rows, logits, strict=True):
            if params[i].greedy:
                # the argmax over the draft's own head [1, W], then its token id: the target's
                # vocabulary [1, V] (-inf outside the head) is only built for a distribution
                cut = None if cuts is None else cuts[i]
                token, sure = drafters[i]._greedy_top(drafters[i]._fit_head(row_logits),
                                                      cut is not None)
                if cut is not None:  # 4. a chain the drafter is no longer sure of stops
                    confidence[i].append(sure * (confidence[i][-1] if confidence[i] else 1.0))
                    if not cut.keeps(confidence[i]):
                        ks[i] = step
                        continue
                    if not cut.goes_on(confidence[i]):
                        ks[i] = step + 1
            else:
                draft_probs = warp(drafters[i]._fit_vocab(row_logits), params[i])  # [1, V]
                if not has_mass(draft_probs):  # nothing to draw from (a draft gone NaN)
                    ks[i] = step
                    continue
                token = draw(draft_probs, params[i], generators[i],
                             int(sequences[i].numel())).cpu()
                probs[i].append(draft_probs[0])
            tokens[i].append(token)
            sequences[i] = torch.cat([sequences[i], token])
    return [Draft(torch.cat(t), torch.stack(p) if p else None) if t else empty_draft()
            for t, p in zip(tokens, probs, strict=True)]
