"""Batched speculative decoding with continuous batching, driven step by step.

    scheduler = Scheduler(decoder, max_batch=16)
    rid = scheduler.add("Hello", SamplingParams(max_new_tokens=64))
    while scheduler.has_work:
        for event in scheduler.step():   # one round for every running request
            ...event.request_id, event.text, event.output (set when it finished)
    scheduler.cancel(rid)                # any time between steps

Each round every running request drafts, all of them are verified in one target pass (each row
at its own position, with its own draft length), and each accepts its own number of tokens.
Requests finish on their own (EOS, stop strings, max_new_tokens) and leave; waiting requests
join between rounds. On the native runtime a row's logits do not depend on the batch, so its
output is the one it gets decoded alone (greedy: token for token; sampled: the same draws for
the same seed).

K for a round: with k="auto" the batch shares the K that maximises expected tokens per unit of
time at this batch size (`theory.batch_optimal_k`, costs measured per batch size), shrinking to
0 (plain batched decoding) when the bigger verification pass stops paying. Lookups cost nothing
to propose: each row keeps as many of its lookup's tokens as pay for its own share of the
bigger pass (`CostModel.row_share`), and then the batch cuts every row's chain to the tokens
that pay for all the rows (`theory.batch_allocation`: a position in the pass costs every row
its wait, so at batch 16 a token must be accepted with more than ~0.35 to be worth verifying).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from verispec.drafters.base import Draft, Drafter, follow_target
from verispec.drafters.batch import propose_batch
from verispec.drafters.hybrid import tree_width_of
from verispec.engine import Sequence
from verispec.params import SamplingParams
from verispec.policy import CHEAP_DRAFT, AdaptiveK, CostModel
from verispec.runtime import Runner, batched_logits
from verispec.sampling import make_generator
from verispec.stats import StatsRecorder
from verispec.text import TextStream
from verispec.theory import batch_allocation, batch_optimal_k

# A batch speculates only when the model predicts at least this gain: at batch 4 a draft with
# acceptance 0.23 was predicted +2% and measured -11% (lockstep drafting's bookkeeping).
BATCH_MARGIN = 1.10
# Greedy rows draft token trees in batches up to this size, chains in bigger ones: Spec-Bench,
# the shipped draft with lookup, width 8 against chains: batch 1 1.51-1.56x against 1.48x,
# batch 4 1.13-1.24x (1.16 twice side by side) against 1.20-1.21x; batch 2 1.24-1.28x against
# 1.29-1.30x. (A greedy row's output is the same either way; sampled rows with a tree width
# draw trees at every size, so their draws do not depend on the batch.)
TREE_MAX_BATCH = 1


@dataclass(frozen=True, slots=True)
class Event:
    """New text of one request after a round; `output` is set on its last event."""

    request_id: int
    text: str
    token_ids: list[int]
    output: object | None = None  # verispec.decoder.GenerationOutput


@dataclass(slots=True)
class _Request:
    request_id: int
    prompt_ids: torch.Tensor
    params: SamplingParams
    sequence: Sequence | None = None  # set when the request joins the batch
    runner: Runner | None = None
    drafter: Drafter | None = None
    text: TextStream | None = None
    stats: StatsRecorder | None = None


class Scheduler:
    def __init__(self, decoder, max_batch: int = 16) -> None:
        """decoder: a verispec.SpeculativeDecoder (its target, drafter, K and tokenizer)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self._ids = itertools.count()
        self._free_runners: list[Runner] = []
        self._free_drafters: list[Drafter] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, prompt, params: SamplingParams | None = None, chat: bool | None = None) -> int:
        """Queue a request; bad input raises here. Returns its id."""
        params = params or SamplingParams()
        prompt_ids = self.decoder.encode(prompt, self.decoder.chat if chat is None else chat)
        if params.stop and self.decoder.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        request = _Request(next(self._ids), prompt_ids, params)
        self.waiting.append(request)
        return request.request_id

    def cancel(self, request_id: int) -> bool:
        """Drop a request, waiting or running; the other rows are not disturbed. False if it is
        unknown or already finished."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return True
        for request in self.running:
            if request.request_id == request_id:
                self._release(request)
                return True
        return False

    def step(self) -> list[Event]:
        """One round for every running request (after admitting waiting ones)."""
        # 1. Join: waiting requests take free slots.
        while self.waiting and len(self.running) < self.max_batch:
            self._admit(self.waiting.popleft())
        running = list(self.running)
        if not running:
            return []
        # 2. Draft: every row proposes up to the round's K (model drafts in lockstep passes),
        #    a lookup up to its policy's free K.
        greedy_trees = len(running) <= TREE_MAX_BATCH
        prices = self._prices(running)
        k = 0 if self.decoder.drafter is None else self._round_k(running, greedy_trees, prices)
        drafts = propose_batch([r.drafter for r in running], [r.sequence.history for r in running],
                               [r.sequence.num_to_draft(k) for r in running],
                               [r.params for r in running],
                               [r.sequence.generator for r in running],
                               [r.sequence.num_to_draft(free=True) for r in running],
                               [r.sequence.policy for r in running],
                               greedy_trees=greedy_trees)
        if prices is not None and len(running) > 1:
            drafts = self._allocate(running, drafts, prices)  # cut at the batch's prices
        # 3. One target pass over every row's history + draft.
        rounds = [r.sequence.begin(d) for r, d in zip(running, drafts, strict=True)]
        logits = batched_logits([r.runner for r in running], [rd.ids for rd in rounds],
                                [rd.num_logits for rd in rounds], [rd.parents for rd in rounds])
        # 4. Each row verifies and accepts its own number of tokens; finished rows leave.
        events = []
        for request, round, row_logits in zip(running, rounds, logits, strict=True):
            events.append(self._advance(request, request.sequence.finish(round, row_logits)))
        return events

    def run(self) -> dict[int, object]:
        """Step until every request finished -> {request_id: GenerationOutput}."""
        outputs = {}
        while self.has_work:
            for event in self.step():
                if event.output is not None:
                    outputs[event.request_id] = event.output
        return outputs

    # -- internals ---------------------------------------------------------------------------

    def _admit(self, request: _Request) -> None:
        decoder = self.decoder
        request.runner = self._free_runners.pop() if self._free_runners else \
            decoder.target.sibling()
        request.runner.reset()
        if decoder.drafter is not None:
            request.drafter = self._free_drafters.pop() if self._free_drafters else \
                decoder.drafter.fork()
            follow_target(request.drafter, request.runner)
            request.drafter.reset()
        request.stats = StatsRecorder(k=decoder.k)
        request.text = TextStream(decoder.tokenizer, request.params.stop)
        generator = make_generator(request.params.seed, decoder.target.device)
        request.sequence = Sequence(request.prompt_ids, request.params,
                                    decoder.new_policy(request.params),
                                    decoder.eos_ids, generator, request.stats,
                                    decoder.target.max_positions)
        self.running.append(request)

    def _release(self, request: _Request) -> None:
        self.running.remove(request)
        self._free_runners.append(request.runner)
        if request.drafter is not None:
            self._free_drafters.append(request.drafter)

    def _round_k(self, running: list[_Request], greedy_trees: bool,
                 costs: CostModel | None) -> int | None:
        """The K this round drafts: None leaves it to each row's policy (fixed K, heuristic:
        no prices); under "auto" the batch shares one K priced at its batch size (a tree's
        depth, priced by its tokens, where rows draft trees: sampled rows, and greedy ones if
        greedy_trees), and each row's policy is given the batch's prices for its own cut of
        free proposals (lookups) and of its tree."""
        if costs is None:
            return None
        policies = [r.sequence.policy for r in running]
        row_costs = costs.row_share(len(running))
        row_widths = [tree_width_of(self.decoder.drafter, r.params)
                      if greedy_trees or not r.params.greedy else 1 for r in running]
        # K: the trees' depth where rows draft trees, priced as the widest row's policy
        # prices its trees (a greedy row's by the nodes its cut keeps)
        widest = max(range(len(running)), key=lambda i: row_widths[i])
        costs = policies[widest].tree_costs(costs, row_widths[widest])
        for policy, row_width in zip(policies, row_widths, strict=True):
            # each row's own cut (AdaptiveK.keep) pays its share of a pass
            policy.costs, policy.tree_width = row_costs, row_width
        if costs.draft_step < CHEAP_DRAFT:
            return costs.k_max
        gammas = [policy.gamma(0) for policy in policies]
        return batch_optimal_k(gammas, costs.draft_step, costs.verify, costs.k_max,
                               min_speedup=BATCH_MARGIN)

    def _prices(self, running: list[_Request]) -> CostModel | None:
        """This batch's cost model, priced at its rows' mean length, where K is "auto" (every
        row's policy adaptive) and there is a drafter; else None."""
        if self.decoder.drafter is None or not all(
                isinstance(r.sequence.policy, AdaptiveK) for r in running):
            return None
        context = sum(int(r.sequence.history.numel()) for r in running) // len(running)
        return self.decoder.batch_costs(len(running)).at(context)

    def _allocate(self, running: list[_Request], drafts: list[Draft],
                  costs: CostModel) -> list[Draft]:
        """Every row's chain cut to what pays for the whole batch (`theory.batch_allocation`:
        a token is verified while its chance of acceptance, gamma^j by its kind of proposal,
        beats what its place in the pass costs all the rows). Trees are kept whole: their
        size was priced when they were drafted."""
        rows = len(running)
        chain = [d.parents is None for d in drafts]
        fixed = sum(len(d) for d, is_chain in zip(drafts, chain, strict=True) if not is_chain)
        gains = []  # one list per row (every row emits a token: the rate's base)
        for request, draft, is_chain in zip(running, drafts, chain, strict=True):
            if not is_chain or not len(draft):
                gains.append([])
                continue
            gamma = request.sequence.policy.gamma(draft.source)
            gains.append([gamma ** (j + 1) for j in range(len(draft))])
        kept = batch_allocation(gains, lambda extra: costs.v(1 + (fixed + extra) / rows))
        return [d.truncated(count) if is_chain else d
                for d, count, is_chain in zip(drafts, kept, chain, strict=True)]

    def _advance(self, request: _Request, new_ids: list[int]) -> Event:
        """Text for the round's tokens; finish the request on a stop string, EOS or budget."""
        text, start = request.text, len(request.text.ids)
        piece = text.add(new_ids)
        if text.stopped:
            new_ids = text.ids[start: text.num_tokens]
        elif not request.sequence.finished:
            return Event(request.request_id, piece, new_ids)
        else:
            piece += text.flush()
        self._release(request)
        output = self.decoder.make_output(text, request.params, request.stats)
        return Event(request.request_id, piece, new_ids, output)

