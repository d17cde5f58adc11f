"""Speculative decoding with continuous batching, driven step by step: the one decode loop.

    engine = decoder.engine(max_batch=16)
    rid = engine.add_request("Hello", SamplingParams(max_new_tokens=64))  # bad input raises
    while engine.has_work:
        for event in engine.step():       # one round for every running request
            ...event.request_id, event.text, event.output (set when it finished)
    engine.cancel(rid)                    # any time between steps

An `Engine` holds a target, its drafter, the decode loop's configuration and the cost models a
round is priced with. Each step: the scheduler picks the rows (verispec.scheduler: admission,
chunked prefill, pooled caches), one round drafts, scores and verifies them all
(verispec.round), and each row takes its own number of tokens. Requests finish on their own
(EOS, stop strings, max_new_tokens) and leave; waiting requests join between rounds. On the
native runtime a row's logits do not depend on the batch, so its output is the one it gets
decoded alone (greedy: token for token; sampled: the same draws for the same seed while the
round's K is the same). A round that raises is retried row by row: only the rows that raise
alone fail (an `Event` with `error`), the others go on unchanged.

A lone prompt (`SpeculativeDecoder.generate` / `stream`) is a batch of one through the same
loop, on the decoder's own runner and drafter.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from verispec.config import DecodeConfig
from verispec.cost_table import CostTable
from verispec.drafters.drafter import Drafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.prediction import PredictionLookup, copied_tokens
from verispec.params import SamplingParams
from verispec.planner import RoundPlanner
from verispec.policy import AdaptiveK, FixedK, HeuristicK, KPolicy
from verispec.request import Request
from verispec.round import run_round
from verispec.runtime import Runner
from verispec.sampling import make_generator
from verispec.scheduler import Scheduler
from verispec.stats import GenerationStats, StatsRecorder
from verispec.text import Prompt, TextStream, encode_prediction, encode_prompt
from verispec.verify import Verified

log = logging.getLogger("verispec")


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    text: str
    token_ids: list[int]  # the generated ids only (EOS included when it ended the generation)
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: GenerationStats


@dataclass(frozen=True, slots=True)
class Event:
    """New text of one request after a round; `output` is set on its last event, `error` on
    the last event of a request that failed (its round raised with it alone)."""

    request_id: int
    text: str
    token_ids: list[int]
    output: GenerationOutput | None = None
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class Model:
    """What every engine of a decoder shares: the target and its drafter, text in and out, the
    decode loop's knobs and the cost models rounds are priced with."""

    target: Runner
    drafter: Drafter | None
    tokenizer: object | None
    eos_ids: frozenset[int]
    config: DecodeConfig
    costs: CostTable
    k: int | str  # "auto", "heuristic" or a fixed K (0 without a drafter)
    lookup_k: int | str  # for requests that bring their own draft source (a prediction)
    chat: bool  # whether a text prompt goes through the chat template by default
    # acceptance by source over greedy requests: where a new one's estimates start
    # (`AdaptiveK.shared`). Greedy rows only: a seeded sampled row's draws depend on its K,
    # and must not depend on the requests before it.
    shared_estimates: dict


class Engine:
    def __init__(self, model: Model, max_batch: int = 16, runners: Iterable[Runner] = (),
                 drafters: Iterable[Drafter] = (), idle_cache_bytes: int | None = None,
                 cache_memory: int | None = None) -> None:
        """runners, drafters: used first, caches kept (a decoder's own, for a lone prompt, so
        its KV cache carries over from one prompt to the next). idle_cache_bytes: what the
        caches of rows that left may hold together (None: an eighth of the machine's memory);
        cache_memory: what all rows' caches may take, a request waiting until it fits (None:
        three quarters of the memory available now); `verispec.scheduler` says how."""
        self.model = model
        self.scheduler = Scheduler(max_batch, model.config, model.target, model.drafter,
                                   runners, drafters, idle_cache_bytes, cache_memory)
        self.planner = RoundPlanner(model.drafter, model.config, model.costs.prices,
                                    model.costs.observed)
        self._ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, prompt: Prompt | torch.Tensor, params: SamplingParams | None = None,
                    chat: bool | None = None,
                    prediction: Prompt | torch.Tensor | None = None) -> int:
        """Queue a request; bad input raises here. Returns its id. prompt: text (through the
        chat template where chat, default the decoder's) or token ids; prediction: what the
        output is expected to be, mostly (Predicted Outputs: text or ids, a draft source)."""
        model = self.model
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a verispec.SamplingParams, got "
                             f"{type(params).__name__}")
        params = params or SamplingParams()
        if params.stop and model.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        vocab, positions = model.target.vocab_size, model.target.max_positions
        prompt_ids = encode_prompt(model.tokenizer, _listed(prompt),
                                   model.chat if chat is None else chat, vocab, positions)
        prediction_ids = None if prediction is None else encode_prediction(
            model.tokenizer, _listed(prediction), vocab)
        request = Request(
            request_id=next(self._ids), prompt_ids=prompt_ids, params=params,
            policy=self._policy(params, predicted=prediction_ids is not None),
            generator=make_generator(params.seed, model.target.device),
            stats=StatsRecorder(k=model.k, verify=params.method),
            text=TextStream(model.tokenizer, params.stop),
            budget=min(params.max_new_tokens, positions - int(prompt_ids.numel())))
        if prediction_ids is not None and prediction_ids.numel():
            # a row with no drafter looks up its own text too, where the prediction has nothing
            lookup = NgramDrafter() if model.drafter is None else None
            request.prediction = PredictionLookup(int(prompt_ids.numel()), prediction_ids,
                                                  lookup=lookup)
            request.stats.prediction_tokens = int(prediction_ids.numel())
        self.scheduler.add(request)
        return request.request_id

    def cancel(self, request_id: int) -> bool:
        """Drop a request, waiting or running; the other rows are not disturbed. False if it is
        unknown or already finished."""
        return self.scheduler.cancel(request_id)

    def step(self) -> list[Event]:
        """One round for every running request (after admitting waiting ones)."""
        # 1. Schedule: who joins, who feeds a prompt chunk, who decodes.
        feeding, decoding = self.scheduler.schedule()
        refused = [self._fail(r, error) for r, error in self.scheduler.refused]
        rows = decoding + feeding
        if not rows:
            return refused
        # 2. One round for all of them; row by row again where it raises.
        snapshot = [_generator_state(r) for r in rows]
        try:
            verified = run_round(self.planner, feeding, decoding)
        except Exception as error:  # noqa: BLE001 - isolate the row that raised
            if len(rows) == 1:
                return refused + [self._fail(rows[0], error)]
            return refused + self._retry_alone(feeding, decoding, snapshot)
        # 3. Each decoding row takes its tokens; finished rows leave.
        return refused + [self._advance(r, v) for r, v in zip(decoding, verified, strict=True)]

    def run(self) -> dict[int, GenerationOutput]:
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

    def _policy(self, params: SamplingParams, predicted: bool) -> KPolicy:
        """A fresh K policy for one request (sampled rows price their drafts' sampling;
        predicted: it brings a prediction, a draft source of its own)."""
        model = self.model
        k = model.lookup_k if predicted else model.k
        if k == "auto":
            model.costs.one_row()  # measured (or read) once, as the first request arrives
            return AdaptiveK.for_request(model.config, sampling=not params.greedy,
                                         predicted=predicted,
                                         shared=model.shared_estimates
                                         if params.greedy else None)
        if k == "heuristic":
            return HeuristicK(k=model.config.heuristic_start_k)
        return FixedK(k)

    def _retry_alone(self, feeding: list[Request], decoding: list[Request],
                     snapshot: list[torch.Tensor | None]) -> list[Event]:
        """A round raised: run each row's round alone from the draws it had before (the KV
        caches roll back by themselves), so a row that raises alone fails and the others go
        on as if the round had not failed."""
        events = []
        for request, state in zip(decoding + feeding, snapshot, strict=True):
            if state is not None:
                request.generator.set_state(state)
            feeds = request in feeding
            try:
                verified = run_round(self.planner, [request] if feeds else [],
                                     [] if feeds else [request])
            except Exception as error:  # noqa: BLE001 - this row's own failure
                events.append(self._fail(request, error))
                continue
            if not feeds:
                events.append(self._advance(request, verified[0]))
        return events

    def _advance(self, request: Request, verified: Verified) -> Event:
        """Append the round's tokens; text for them; finish the request on a stop string, EOS
        or budget."""
        request.prompt_fed = request.context
        new_ids = request.append(verified.tokens, self.model.eos_ids)
        request.stats.record_round(verified.drafted, verified.accepted, len(new_ids))
        text, start = request.text, len(request.text.ids)
        piece = text.add(new_ids)
        if text.stopped:
            new_ids = text.ids[start: text.num_tokens]  # the round's tokens the output keeps
            request.stats.new_tokens = text.num_tokens  # counted as the output keeps them
        elif not request.finished:
            return Event(request.request_id, piece, new_ids)
        else:
            piece += text.flush()
        self.scheduler.release(request)
        return Event(request.request_id, piece, new_ids, self._output(request))

    def _output(self, request: Request) -> GenerationOutput:
        text, params = request.text, request.params
        ids = text.ids[: text.num_tokens]
        stopped_on_eos = bool(ids) and ids[-1] in self.model.eos_ids and not params.ignore_eos
        finish_reason = "stop" if text.stopped or stopped_on_eos else "length"
        if request.prediction is not None:  # the prediction's tokens the output copied
            tokenizer = self.model.tokenizer  # without one, only equal ids are copies
            request.stats.accepted_prediction_tokens = copied_tokens(
                request.prediction.prediction_ids.tolist(), ids[:-1] if stopped_on_eos else ids,
                tokenizer.decode if tokenizer is not None else tuple)
        return GenerationOutput(text.text, ids, finish_reason, request.stats.finish())

    def _fail(self, request: Request, error: Exception) -> Event:
        log.warning("request %d failed: %s", request.request_id, error)
        if request in self.scheduler.running:
            self.scheduler.release(request)
        return Event(request.request_id, "", [], error=error)


def _listed(ids: Prompt | torch.Tensor) -> Prompt:
    """Token ids given as a tensor -> a list (text and lists pass through)."""
    return ids.tolist() if isinstance(ids, torch.Tensor) else ids


def _generator_state(request: Request) -> torch.Tensor | None:
    """A row's generator position before a round, to replay its draws if the round fails.
    (Its policy may have priced a tree it will not verify: that moves no output, only a
    running estimate of how much trees keep.)"""
    return None if request.generator is None else request.generator.get_state()
