"""The public entry point: `SpeculativeDecoder` loads a target and its drafter
(`from_pretrained`) and turns prompts into text, speculatively (`generate`, `stream`), through
the engine (verispec.engine) that owns the decode loop."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from verispec import loading
from verispec.config import (
    DEFAULT_DRAFT_QUANT,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_TREE_WIDTH,
    DecodeConfig,
    EngineConfig,
    parse_k,
)
from verispec.cost_table import CostTable
from verispec.costs import CostModel
from verispec.drafters import Drafter
from verispec.drafters.drafter import follow_target
from verispec.drafters.load import load_drafter, resolve_draft
from verispec.engine import Engine, GenerationOutput, Model
from verispec.params import SamplingParams
from verispec.runtime import Runner, make_runner
from verispec.text import Prompt, encode_prediction, encode_prompt
from verispec.vocab import eos_ids

log = logging.getLogger("verispec")

DEFAULT_K = "auto"  # chosen each round from measured costs (docs/choosing-k.md)


@dataclass(frozen=True, slots=True)
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new ids since the previous chunk
    output: GenerationOutput | None = None  # set on the last chunk only


class SpeculativeDecoder:
    """A target model, an optional drafter and K. Greedy output equals the target's greedy output
    token for token; sampled output is distributed as the target's (after warping)."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer=None,
        drafter: Drafter | None = None,
        k: int | str = DEFAULT_K,
        chat: bool = True,
        runtime: str | Runner = "auto",
        dtype: str = "auto",
        int8: bool = False,
        config: DecodeConfig | None = None,
        costs: CostModel | None = None,
        model_files: Sequence[str | os.PathLike] = (),
    ) -> None:
        """runtime: "auto", "hf" or "native" (see `verispec.runtime.make_runner`, which also
        explains dtype and int8), or a runner already built for `target`, to share one between
        decoders. config: the decode loop's knobs (verispec.config.DecodeConfig). costs: the
        one-row cost model to price rounds with instead of measuring it (`verispec costs`).
        model_files: the files (or folders) target and drafter were loaded from; given (as
        from_pretrained gives them), the cost models measured are kept in the cost cache
        under them and read back by later processes (verispec.cost_cache)."""
        k = parse_k(k)
        self.config = config or DecodeConfig()
        if isinstance(runtime, Runner):
            self.target = runtime
        else:
            self.target = make_runner(target, runtime, dtype=dtype, int8=int8)
        self.tokenizer = tokenizer
        self.drafter = drafter
        follow_target(drafter, self.target)
        self.k = k if drafter is not None else 0
        self.lookup_k = k  # for requests that bring their own draft source (a prediction)
        self.chat = chat
        self.eos_ids = eos_ids(target, tokenizer)
        # cost models by batch size: measured on first use, estimated, or read from the cost
        # cache (verispec.cost_table); one table, so that `share_costs` shares them all
        self.cost_table = CostTable(self.target, drafter, self.config, model_files, costs)
        # acceptance by source over this decoder's greedy requests: where a new one's
        # estimates start (`AdaptiveK.shared`). Greedy rows only: a seeded sampled row's draws
        # depend on its K, and must not depend on the requests before it.
        self.shared_estimates: dict = {}
        # what `from_config` built it from (None: built from models already loaded)
        self.engine_config: EngineConfig | None = None

    @property
    def costs(self) -> CostModel:
        """The one-row cost model (draft step and verification costs), measured once (or read
        from the cost cache)."""
        return self.cost_table.one_row()

    def batch_costs(self, batch: int) -> CostModel:
        """The cost model a batch of this size is priced with, in units of a plain batched
        step: its size's (rounded up to a measured size) where measured, else an estimate
        from the measured sizes below (`CostTable.prices`). Never measures a batch size
        (`cost_table.measure(batch)` does)."""
        return self.cost_table.prices(batch)

    def share_costs(self, other: SpeculativeDecoder) -> None:
        """Price rounds with `other`'s cost models from now on: the one-row model and every
        batch size's, each measured once for both, by whichever decoder needs it first.
        Decoders compared in one run (a benchmark's verify modes of one method and K) then
        take the same K decisions on the same acceptance history, where two measurements
        differ by the machine's drift (c 0.435 against 0.327 in one run) and move K by one.
        For decoders of the same target, runtime and kind of drafter."""
        self.cost_table = other.cost_table

    def reset(self) -> None:
        """Drop the KV caches, so the next request pays its full prompt pass (benchmarks)."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def engine(self, max_batch: int = 16, idle_cache_bytes: int | None = None,
               cache_memory: int | None = None) -> Engine:
        """An engine for a batch of requests (`Engine.add_request` / `step`; continuous
        batching, up to max_batch rows at once), on this decoder's target, drafter, knobs and
        cost models as they are now (a later `share_costs` or change of `config` reaches the
        engines built after it); its rows' caches are pooled runners and drafters, which keep
        what a request may start from (`verispec.scheduler`), up to idle_cache_bytes for the
        rows that left (None: an eighth of the machine's memory); a request joins when its
        caches fit in cache_memory beside the running rows' (None: three quarters of the memory
        available now)."""
        return Engine(self._model(), max_batch=max_batch, idle_cache_bytes=idle_cache_bytes,
                      cache_memory=cache_memory)

    def _model(self) -> Model:
        return Model(self.target, self.drafter, self.tokenizer, self.eos_ids, self.config,
                     self.cost_table, self.k, self.lookup_k, self.chat,
                     self.shared_estimates)

    @classmethod
    def from_pretrained(
        cls,
        target: str | os.PathLike | None = None,
        draft: str | os.PathLike | None = "default",
        k: int | str = DEFAULT_K,
        dtype: str = "auto",
        device: str = "cpu",
        chat: bool = True,
        runtime: str = "auto",
        int8: bool = False,
        tree_width: int = DEFAULT_TREE_WIDTH,
        sampled_tree_width: int = 1,
        config: DecodeConfig | None = None,
        dequantize: str | None = "auto",
        draft_vocab: int | None = DEFAULT_DRAFT_VOCAB,
        draft_quant: str | None = DEFAULT_DRAFT_QUANT,
    ) -> SpeculativeDecoder:
        """Load a target and its drafter: each keyword is the `EngineConfig` field of that name
        (docs/configuration.md has them all), config the decode loop's knobs
        (`EngineConfig.decode`). target: a model name, HF folder or .gguf file, None for the
        embedded SmolLM2-135M-Instruct; draft: "default" (a draft shipped for the target, with
        lookup; else n-gram lookup), "hybrid:PATH", "ngram", "suffix", a draft model sharing
        the target's tokenizer, or None (plain decoding); k: "auto" (chosen each round from
        measured costs and the running acceptance), a number, or "heuristic". Bad values raise
        ValueError before anything loads."""
        return cls.from_config(EngineConfig(
            target=None if target is None else os.fspath(target),
            draft=None if draft is None else os.fspath(draft), k=k, runtime=runtime,
            dtype=dtype, device=device, int8=int8, dequantize=dequantize,
            draft_vocab=draft_vocab, draft_quant=draft_quant, tree_width=tree_width,
            sampled_tree_width=sampled_tree_width, chat=chat,
            decode=config or DecodeConfig()))

    @classmethod
    def from_config(cls, config: EngineConfig) -> SpeculativeDecoder:
        """The decoder `config` describes: its target and drafter loaded (`loading.load`,
        `load_drafter`), the cost models it measures kept in the cost cache under their
        files."""
        # runtime "hf" and int8 layers run on dense weights
        dequantize = "bf16" if config.runtime == "hf" or config.int8 else config.dequantize
        model, tokenizer = loading.load(config.target, dtype=config.dtype, device=config.device,
                                        dequantize=dequantize)
        draft = resolve_draft(config.draft, config.target, config.runtime)
        drafter = load_drafter(draft, model, tokenizer, dtype=config.dtype,
                               device=config.device, runtime=config.runtime, int8=config.int8,
                               target_spec=config.target, tree_width=config.tree_width,
                               sampled_tree_width=config.sampled_tree_width,
                               dequantize=dequantize, draft_vocab=config.draft_vocab,
                               draft_quant=config.draft_quant)
        files = [loading.source_path(config.target)]
        if draft not in (None, "ngram", "suffix"):
            files.append(loading.source_path(draft.removeprefix("hybrid:")))
        decoder = cls(model, tokenizer, drafter, k=config.k, chat=config.chat,
                      runtime=config.runtime, dtype=config.dtype, int8=config.int8,
                      config=config.decode, model_files=files)
        decoder.engine_config = config
        return decoder

    def generate(self, prompt: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool | None = None, max_batch: int | None = None,
                 prediction: str | Sequence[int] | None = None
                 ) -> GenerationOutput | list[GenerationOutput]:
        """One prompt -> its output. A list of prompts (strings, or lists of token ids) -> their
        outputs in order, decoded together as one batch (`verispec.engine`; up to max_batch
        at once, default all), with one params for all or one per prompt. prediction (one
        prompt): see `stream`."""
        if _is_batch(prompt):
            if prediction is not None:
                raise ValueError("a prediction goes with one prompt (use an engine's "
                                 "add_request for a batch with predictions)")
            return self._generate_batch(list(prompt), params, chat, max_batch)
        if isinstance(params, list):
            raise ValueError("a list of params needs a list of prompts")
        output = None
        for chunk in self.stream(prompt, params, chat=chat, prediction=prediction):
            output = chunk.output
        assert output is not None
        return output

    def _generate_batch(self, prompts: list[Prompt], params, chat: bool | None,
                        max_batch: int | None) -> list[GenerationOutput]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} params")
        engine = self.engine(max_batch=max_batch or len(prompts))
        ids = [engine.add_request(p, sp, chat=chat)
               for p, sp in zip(prompts, params, strict=True)]
        outputs = engine.run()
        return [outputs[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               chat: bool | None = None, prediction: str | Sequence[int] | None = None
               ) -> Iterator[StreamChunk]:
        """Yield new text and ids after every verification round; the last chunk carries the
        whole output and its stats. Bad input raises here, before the first chunk.

        A lone prompt is a batch of one of an engine, on the decoder's own runner and drafter
        (so a prompt that shares a prefix with the previous one reuses its cache).
        prediction: the output as it is expected to be, mostly (OpenAI's Predicted Outputs:
        text or ids, a draft source; the output is the target's whatever it says)."""
        engine = Engine(self._model(), max_batch=1, runners=[self.target],
                        drafters=[self.drafter] if self.drafter is not None else [])
        engine.add_request(prompt, params or SamplingParams(), chat=chat, prediction=prediction)
        return self._chunks(engine)

    @staticmethod
    def _chunks(engine: Engine) -> Iterator[StreamChunk]:
        while engine.has_work:
            for event in engine.step():
                if event.error is not None:
                    raise event.error
                yield StreamChunk(event.text, event.token_ids, event.output)

    def encode(self, prompt: Prompt, chat: bool) -> torch.Tensor:
        """A prompt string (chat template applied when the tokenizer has one and chat is on) or
        a list of token ids -> ids [L] long (`text.encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, chat, self.target.vocab_size,
                             self.target.max_positions)

    def encode_prediction(self, prediction: Prompt) -> torch.Tensor:
        """A predicted output (text, or token ids) -> ids [P] long, as the output would hold
        them (`text.encode_prediction`)."""
        return encode_prediction(self.tokenizer, prediction, self.target.vocab_size)


def _is_batch(prompt: object) -> bool:
    """A list of prompts (strings or id lists), as opposed to one prompt given as ids."""
    return isinstance(prompt, list | tuple) and bool(prompt) and all(
        isinstance(p, str | list | tuple) for p in prompt)

