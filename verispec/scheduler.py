"""Speculative decoding with continuous batching, driven step by step: the one decode loop.

    scheduler = Scheduler(decoder, max_batch=16)
    rid = scheduler.add("Hello", SamplingParams(max_new_tokens=64))
    while scheduler.has_work:
        for event in scheduler.step():   # one round for every running request
            ...event.request_id, event.text, event.output (set when it finished)
    scheduler.cancel(rid)                # any time between steps

A lone prompt (`SpeculativeDecoder.generate` / `stream`) is a batch of one through the same
loop. Each round every running request drafts, all of them are verified in one target pass
(each row at its own position, with its own draft length), and each accepts its own number of
tokens. Requests finish on their own (EOS, stop strings, max_new_tokens) and leave; waiting
requests join between rounds. On the native runtime a row's logits do not depend on the batch,
so its output is the one it gets decoded alone (greedy: token for token; sampled: the same
draws for the same seed while the round's K is the same).

How much each row drafts and verifies is the round planner's (verispec.planner). A prompt
longer than a chunk (`DecodeConfig.chunk_at`) is fed in chunks, one a round, and its drafter
reads each chunk in the same round (`Drafter.catch_up`), so the other rows' rounds never wait
for a whole long prompt, the target's pass over it or the drafter's. A round that raises is
retried row by row: only the rows that raise alone fail (an `Event` with `error`), the others
go on unchanged.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from verispec.drafters.batch_drafting import propose_batch
from verispec.drafters.drafter import Draft, Drafter, catch_up, empty_draft, follow_target, retire
from verispec.drafters.prediction import PredictionLookup, is_prediction
from verispec.params import SamplingParams
from verispec.planner import RoundPlanner
from verispec.request import Request, Round
from verispec.runtime import Runner, batched_logits, common_prefix
from verispec.sampling import make_generator
from verispec.stats import StatsRecorder
from verispec.text import TextStream
from verispec.verify import Verified, verify_drafts
from verispec.verify.round import RowState

log = logging.getLogger("verispec")


@dataclass(frozen=True, slots=True)
class Event:
    """New text of one request after a round; `output` is set on its last event, `error` on
    the last event of a request that failed (its round raised with it alone)."""

    request_id: int
    text: str
    token_ids: list[int]
    output: object | None = None  # verispec.decoder.GenerationOutput
    error: Exception | None = None


class Scheduler:
    def __init__(self, decoder, max_batch: int = 16, runners: Iterable[Runner] = (),
                 drafters: Iterable[Drafter] = ()) -> None:
        """decoder: a verispec.SpeculativeDecoder (its target, drafter, K, tokenizer, config).
        runners, drafters: the decoder's own, for a lone prompt: used first, caches kept, so
        its KV cache carries over from one prompt to the next."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.config = decoder.config
        self.planner = RoundPlanner(decoder.drafter, decoder.config, decoder.batch_costs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._own_runners: list[Runner] = list(runners)
        self._own_drafters: list[Drafter] = list(drafters)
        self._free_runners: list[Runner] = []
        self._free_drafters: list[Drafter] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, prompt, params: SamplingParams | None = None, chat: bool | None = None,
            prediction: str | list[int] | None = None) -> int:
        """Queue a request; bad input raises here. Returns its id. prediction: what the
        output is expected to be, mostly (Predicted Outputs: a draft source)."""
        params = params or SamplingParams()
        prompt_ids = self.decoder.encode(prompt, self.decoder.chat if chat is None else chat)
        prediction_ids = None if prediction is None else self.decoder.encode_prediction(
            prediction)
        return self.add_ids(prompt_ids, params, prediction_ids)

    def add_ids(self, prompt_ids: torch.Tensor, params: SamplingParams,
                prediction_ids: torch.Tensor | None = None) -> int:
        """Queue a request already tokenised (`decoder.encode`, `decoder.encode_prediction`);
        returns its id."""
        decoder = self.decoder
        if params.stop and decoder.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        request = Request(
            request_id=next(self._ids), prompt_ids=prompt_ids, params=params,
            policy=decoder.new_policy(params, predicted=prediction_ids is not None),
            generator=make_generator(params.seed, decoder.target.device),
            stats=StatsRecorder(k=decoder.k, verify=params.method),
            text=TextStream(decoder.tokenizer, params.stop),
            budget=min(params.max_new_tokens,
                       decoder.target.max_positions - int(prompt_ids.numel())))
        if prediction_ids is not None and prediction_ids.numel():
            request.prediction = PredictionLookup(int(prompt_ids.numel()), prediction_ids)
            request.stats.prediction_tokens = int(prediction_ids.numel())
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
        # 2. Rows still feeding their prompt take a chunk of it; the others decode a round.
        feeding = [self._feeding(r) for r in running]
        prefilling = [r for r, f in zip(running, feeding, strict=True) if f]
        decoding = [r for r, f in zip(running, feeding, strict=True) if not f]
        snapshot = [_generator_state(r) for r in running]
        try:
            verified = self._round(prefilling, decoding)
        except Exception as error:  # noqa: BLE001 - isolate the row that raised
            if len(running) == 1:
                return [self._fail(running[0], error)]
            return self._retry_alone(running, snapshot)
        return [self._advance(r, v) for r, v in zip(decoding, verified, strict=True)]

    def run(self) -> dict[int, object]:
        """Step until every request finished -> {request_id: GenerationOutput}; a request
        that failed raises its error."""
        outputs = {}
        while self.has_work:
            for event in self.step():
                if event.error is not None:
                    raise event.error
                if event.output is not None:
                    outputs[event.request_id] = event.output
        return outputs

    # -- the round --------------------------------------------------------------------------

    def _round(self, prefilling: list[Request], decoding: list[Request]) -> list[Verified]:
        # 1. Plan: how much every decoding row drafts and verifies.
        plan = self.planner.plan(decoding)
        keeps = [self.planner.lookup_keep(r, row) for r, row in zip(decoding, plan.rows,
                                                                     strict=True)]
        # 2. Draft: a row's prediction first (a row it proposes for drafts nothing else), then
        #    draft models (in lockstep passes) up to the round's K, lookups up to theirs.
        predicted = [_predict(r, row.free_k, keep)
                     for r, row, keep in zip(decoding, plan.rows, keeps, strict=True)]
        drafts = propose_batch(
            [r.drafter for r in decoding], [r.history for r in decoding],
            [0 if len(p) else row.k for p, row in zip(predicted, plan.rows, strict=True)],
            [r.params for r in decoding], [r.generator for r in decoding],
            [0 if len(p) else row.free_k for p, row in zip(predicted, plan.rows, strict=True)],
            keeps, greedy_trees=plan.greedy_trees, cuts=[row.cut for row in plan.rows])
        drafts = [p if len(p) else d for p, d in zip(predicted, drafts, strict=True)]
        drafts = self.planner.keep(decoding, drafts, plan)
        rounds = [Round(d, torch.cat([r.history, d.tokens]), len(d) + 1)
                  for r, d in zip(decoding, drafts, strict=True)]
        rounds += [self._prefill_round(r) for r in prefilling]
        # 3. One target pass over every row's history + draft (or its prompt's next chunk).
        rows = decoding + prefilling
        logits = batched_logits([r.runner for r in rows], [rd.ids for rd in rounds],
                                [rd.num_logits for rd in rounds], [rd.parents for rd in rounds])
        # 4. Rows feeding their prompt: their drafters read the chunk the target just took (a
        #    feature draft needs its features), not the whole prompt at their first proposal.
        #    (Only where the draft model will pay for reading the whole prompt.)
        for request in prefilling:
            if self.planner.catch_up_pays(request, request.context):
                catch_up(request.drafter, request.history[: request.prompt_fed + 1])
        # 5. Verify every decoding row.
        return verify_round(decoding, rounds[: len(decoding)], logits[: len(decoding)])

    def _prompt_left(self, request: Request) -> int:
        """Prompt tokens not yet in the row's target cache."""
        return request.context - request.prompt_fed

    def _chunk(self, request: Request) -> int:
        return self.config.chunk_at(request.prompt_fed)

    def _feeding(self, request: Request) -> bool:
        """Whether the row's round feeds a chunk of its prompt (more than a chunk is left);
        the last chunk goes with its first decoding round."""
        return self._prompt_left(request) > self._chunk(request)

    def _prefill_round(self, request: Request) -> Round:
        """The prompt's next chunk, fed for its keys and values alone (its logits unused)."""
        request.prompt_fed += self._chunk(request)
        return Round(empty_draft(), request.history[: request.prompt_fed], 1)

    def _retry_alone(self, running: list[Request], snapshot: list[torch.Tensor | None]
                     ) -> list[Event]:
        """A round raised: run each row's round alone from the draws it had before (the KV
        caches roll back by themselves), so a row that raises alone fails and the others go
        on as if the round had not failed."""
        events = []
        for request, state in zip(running, snapshot, strict=True):
            if state is not None:
                request.generator.set_state(state)
            chunk = self._feeding(request)
            try:
                verified = self._round([request] if chunk else [], [] if chunk else [request])
            except Exception as error:  # noqa: BLE001 - this row's own failure
                events.append(self._fail(request, error))
                continue
            if not chunk:
                events.append(self._advance(request, verified[0]))
        return events

    # -- rows joining, advancing and leaving ------------------------------------------------

    def _admit(self, request: Request) -> None:
        """A row joins with a runner and drafter of its own. The decoder's own (a lone prompt)
        keep their caches, so a prompt sharing a prefix with the previous one reuses it; a
        pooled one starts empty, so a row's output never depends on which request had its
        runner before (a prompt pass's keys and values need not be the same bits as the same
        positions computed in another prompt's pass)."""
        decoder = self.decoder
        request.runner = _take(self._own_runners, self._free_runners, decoder.target.sibling)
        if decoder.drafter is not None:
            request.drafter = _take(self._own_drafters, self._free_drafters,
                                    decoder.drafter.fork)
            follow_target(request.drafter, request.runner)
        # what the runner holds of this prompt already; its rounds feed the rest
        request.prompt_fed = common_prefix(request.runner.cached_ids, request.prompt_ids)
        self.running.append(request)

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self._free_runners.append(request.runner)
        if request.drafter is not None:
            retire(request.drafter, request.history, request.params)
            self._free_drafters.append(request.drafter)

    def _advance(self, request: Request, verified: Verified) -> Event:
        """Append the round's tokens; text for them; finish the request on a stop string, EOS
        or budget."""
        request.prompt_fed = request.context
        new_ids = request.append(verified.tokens, self.decoder.eos_ids)
        request.stats.record_round(verified.drafted, verified.accepted, len(new_ids))
        text, start = request.text, len(request.text.ids)
        piece = text.add(new_ids)
        if text.stopped:
            new_ids = text.ids[start: text.num_tokens]
        elif not request.finished:
            return Event(request.request_id, piece, new_ids)
        else:
            piece += text.flush()
        self._release(request)
        output = self.decoder.make_output(text, request.params, request.stats)
        return Event(request.request_id, piece, new_ids, output)

    def _fail(self, request: Request, error: Exception) -> Event:
        log.warning("request %d failed in its round: %s", request.request_id, error)
        if request in self.running:
            self._release(request)
        return Event(request.request_id, "", [], error=error)


def _take(own: list, free: list, make):
    """A runner or drafter for a joining row: the decoder's own as it is (its cache kept),
    else a pooled or new one, emptied."""
    if own:
        return own.pop()
    item = free.pop() if free else make()
    item.reset()
    return item


def _predict(request: Request, k: int, keep) -> Draft:
    """The row's prediction's proposal, where it has one worth verifying."""
    if request.prediction is None:
        return empty_draft()
    draft = request.prediction.propose(request.history, k)
    return draft if len(draft) and keep(draft) > 0 else empty_draft()


def _generator_state(request: Request) -> torch.Tensor | None:
    """A row's generator position before a round, to replay its draws if the round fails.
    (Its policy may have priced a tree it will not verify: that moves no output, only a
    running estimate of how much trees keep.)"""
    return None if request.generator is None else request.generator.get_state()


def verify_round(requests: list[Request], rounds: list[Round], logits: list[torch.Tensor]
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
        if is_prediction(draft.source):
            request.stats.accepted_prediction_tokens += result.accepted
    return verified
