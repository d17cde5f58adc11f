"""The public entry point: `SpeculativeDecoder` turns prompts into text, speculatively."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from verispec import loading
from verispec.drafters import Drafter, FeatureDrafter, HybridDrafter, ModelDrafter, NgramDrafter
from verispec.drafters.base import follow_target
from verispec.drafters.hybrid import tree_width_of
from verispec.engine import speculate
from verispec.errors import IncompatibleDraftError
from verispec.params import SamplingParams
from verispec.policy import (
    DEFAULT_TREE_WIDTH,
    AdaptiveK,
    CostModel,
    FixedK,
    HeuristicK,
    KPolicy,
    check_tree_width,
    measure_batch_costs,
    measure_costs,
    parse_k,
)
from verispec.runtime import RUNTIMES, Runner, make_runner
from verispec.sampling import make_generator
from verispec.scheduler import TREE_MAX_BATCH, Scheduler
from verispec.stats import GenerationStats, StatsRecorder
from verispec.text import TextStream

log = logging.getLogger("verispec")

Prompt = str | Sequence[int]
DEFAULT_K = "auto"  # won the K sweep on Spec-Bench against every fixed K and the heuristic
HEURISTIC_START_K = 5
AUTO_K_MAX = 8
COST_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # batch cost models are measured at these sizes


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    text: str
    token_ids: list[int]  # the generated ids only (EOS included when it ended the generation)
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: GenerationStats


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
    ) -> None:
        """runtime: "auto", "hf" or "native" (see `verispec.runtime.make_runner`, which also
        explains dtype and int8), or a runner already built for `target`, to share one between
        decoders."""
        k = parse_k(k)
        if isinstance(runtime, Runner):
            self.target = runtime
        else:
            self.target = make_runner(target, runtime, dtype=dtype, int8=int8)
        self.tokenizer = tokenizer
        self.drafter = drafter
        follow_target(drafter, self.target)
        self.k = k if drafter is not None else 0
        self.chat = chat
        self.eos_ids = _eos_ids(target, tokenizer)
        self._costs: CostModel | None = None
        self._batch_costs: dict[int, CostModel] = {}

    @property
    def costs(self) -> CostModel:
        """The measured cost model (draft step and verification costs), measured once."""
        if self._costs is None:
            self._costs = measure_costs(self.target, self.drafter, k_max=AUTO_K_MAX, repeats=5)
            log.info("cost model: draft step c=%.3f, verify v(1..%d)=%s (after %d tokens; "
                     "after %d: %s, c=%s), target step %.1f ms",
                     self._costs.draft_step, AUTO_K_MAX + 1,
                     " ".join(f"{v:.2f}" for v in self._costs.verify), self._costs.contexts[0],
                     self._costs.contexts[1],
                     " ".join(f"{v:.2f}" for v in self._costs.long_verify or ()) or "-",
                     "-" if self._costs.long_draft_step is None
                     else f"{self._costs.long_draft_step:.3f}",
                     self._costs.target_step_s * 1e3)
        return self._costs

    def batch_costs(self, batch: int) -> CostModel:
        """The cost model of a batch of this size (rounded up to a measured size), in units of
        a plain batched step; measured once per size."""
        size = next((b for b in COST_BATCH_SIZES if b >= batch), COST_BATCH_SIZES[-1])
        if size == 1:
            return self.costs
        if size not in self._batch_costs:
            costs = measure_batch_costs(self.target, self.drafter, batch=size,
                                        k_max=AUTO_K_MAX, greedy_trees=size <= TREE_MAX_BATCH)
            log.info("cost model at batch %d: c=%.3f, v(1..%d)=%s", size, costs.draft_step,
                     AUTO_K_MAX + 1, " ".join(f"{v:.2f}" for v in costs.verify))
            self._batch_costs[size] = costs
        return self._batch_costs[size]

    def reset(self) -> None:
        """Drop the KV caches, so the next request pays its full prompt pass (benchmarks)."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def new_policy(self, params: SamplingParams | None = None) -> KPolicy:
        """A fresh K policy for one request (with these params: the width of its trees)."""
        if self.k == "auto":
            params = params or SamplingParams()
            return AdaptiveK(self.costs, tree_width=tree_width_of(self.drafter, params),
                             sampling=not params.greedy)
        if self.k == "heuristic":
            return HeuristicK(k=HEURISTIC_START_K)
        return FixedK(self.k)

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
    ) -> SpeculativeDecoder:
        """target: a local HF folder or .gguf file, None for the embedded SmolLM2-135M-Instruct.
        draft: "default" (a draft shipped for the target, with lookup; else n-gram lookup),
        "hybrid:PATH", "ngram", a draft model folder/.gguf sharing the target's tokenizer, or None
        (plain decoding). k: "auto" (default: chosen each round from measured costs and the running
        acceptance rate), a fixed number of draft tokens per round, or "heuristic"
        (transformers' +2/-1 schedule). runtime: "auto" (verispec's native runtime for
        Llama-family models, transformers otherwise), "native" or "hf". dtype: "auto" (bfloat16
        on the native CPU runtime, float32 on hf), "float32", "bfloat16" or "float16". int8:
        weight-only int8 layers (native runtime; bfloat16 activations). tree_width: greedy
        rows of a feature draft propose token trees this wide (1: chains); sampled_tree_width:
        sampled rows (default 1: chains; see README, *Token trees*)."""
        k = parse_k(k)
        check_tree_width(tree_width)
        check_tree_width(sampled_tree_width)
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        model, tokenizer = loading.load(target, dtype=dtype, device=device)
        drafter = make_drafter(draft, model, tokenizer, dtype=dtype, device=device,
                               runtime=runtime, int8=int8, target_spec=target,
                               tree_width=tree_width, sampled_tree_width=sampled_tree_width)
        return cls(model, tokenizer, drafter, k=k, chat=chat, runtime=runtime, dtype=dtype,
                   int8=int8)

    def generate(self, prompt: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool | None = None, max_batch: int | None = None
                 ) -> GenerationOutput | list[GenerationOutput]:
        """One prompt -> its output. A list of prompts (strings, or lists of token ids) -> their
        outputs in order, decoded together as one batch (`verispec.scheduler`; up to max_batch
        at once, default all), with one params for all or one per prompt."""
        if _is_batch(prompt):
            return self._generate_batch(list(prompt), params, chat, max_batch)
        if isinstance(params, list):
            raise ValueError("a list of params needs a list of prompts")
        output = None
        for chunk in self.stream(prompt, params, chat=chat):
            output = chunk.output
        assert output is not None
        return output

    def _generate_batch(self, prompts: list[Prompt], params, chat: bool | None,
                        max_batch: int | None) -> list[GenerationOutput]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} params")
        scheduler = Scheduler(self, max_batch=max_batch or len(prompts))
        ids = [scheduler.add(p, sp, chat=chat) for p, sp in zip(prompts, params, strict=True)]
        outputs = scheduler.run()
        return [outputs[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               chat: bool | None = None) -> Iterator[StreamChunk]:
        """Yield new text and ids after every verification round; the last chunk carries the
        whole output and its stats. Bad input raises here, before the first chunk."""
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt, self.chat if chat is None else chat)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        return self._stream(prompt_ids, params)

    def _stream(self, prompt_ids: torch.Tensor, params: SamplingParams
                ) -> Iterator[StreamChunk]:
        policy = self.new_policy(params)  # may measure the cost model once: not timed
        stats = StatsRecorder(k=self.k)
        text = TextStream(self.tokenizer, params.stop)
        generator = make_generator(params.seed, self.target.device)
        rounds = speculate(self.target, self.drafter, prompt_ids, params, policy, self.eos_ids,
                           generator, stats)
        last_piece, last_ids = "", []
        for new_ids in rounds:
            start = len(text.ids)
            piece = text.add(new_ids)
            if text.stopped:
                rounds.close()
                last_piece, last_ids = piece, text.ids[start : text.num_tokens]
                break
            yield StreamChunk(piece, new_ids)
        else:
            last_piece = text.flush()
        yield StreamChunk(last_piece, last_ids, self.make_output(text, params, stats))

    def make_output(self, text: TextStream, params: SamplingParams, stats: StatsRecorder
                    ) -> GenerationOutput:
        """The finished output of a request from its text stream and stats."""
        ids = text.ids[: text.num_tokens]
        stopped_on_eos = bool(ids) and ids[-1] in self.eos_ids and not params.ignore_eos
        finish_reason = "stop" if text.stopped or stopped_on_eos else "length"
        return GenerationOutput(text.text, ids, finish_reason, stats.finish())

    def encode(self, prompt: Prompt, chat: bool) -> torch.Tensor:
        """A prompt string (chat template applied when the tokenizer has one and chat is on) or
        a list of token ids -> ids [L] long."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            if chat and getattr(self.tokenizer, "chat_template", None):
                prompt = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True,
                    tokenize=False)
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty")
            vocab = self.target.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                       for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.target.max_positions:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the model's context "
                             f"of {self.target.max_positions}")
        return torch.tensor(ids, dtype=torch.long)


def _is_batch(prompt) -> bool:
    """A list of prompts (strings or id lists), as opposed to one prompt given as ids."""
    return isinstance(prompt, list | tuple) and bool(prompt) and all(
        isinstance(p, str | list | tuple) for p in prompt)


def make_drafter(draft, target: PreTrainedModel, tokenizer, dtype: str = "auto",
                 device: str = "cpu", runtime: str = "auto", int8: bool = False,
                 target_spec=None, tree_width: int = DEFAULT_TREE_WIDTH,
                 sampled_tree_width: int = 1) -> Drafter | None:
    """Build the drafter that `draft` names: None / "none", "ngram", a model path, or "default":
    the draft shipped for the target (`target_spec`, as given to `loading.load`), if any, paired
    with n-gram lookup as "hybrid" does, else n-gram lookup; "hybrid" / "hybrid:PATH": n-gram
    lookup where the text repeats itself, the shipped draft (or the one at PATH) elsewhere. A
    draft model runs on the same runtime, dtype and quantization as the target. tree_width:
    how wide the token trees a feature draft proposes for greedy rows are, sampled_tree_width
    for sampled rows (1: chains)."""
    check_tree_width(tree_width)
    check_tree_width(sampled_tree_width)
    if draft is None or draft == "none":
        return None
    if draft == "default":  # the shipped draft with lookup where the text repeats, else lookup
        shipped = loading.default_draft(target_spec)
        # (the shipped draft reads the target's features, which transformers' runtime lacks)
        draft = "ngram" if shipped is None or runtime == "hf" else f"hybrid:{shipped}"
    if draft == "ngram":
        return NgramDrafter()
    if isinstance(draft, str) and (draft == "hybrid" or draft.startswith("hybrid:")):
        # "hybrid" (the shipped draft) or "hybrid:PATH": lookup where the text repeats itself
        model_draft = draft.partition(":")[2] or loading.default_draft(target_spec)
        if model_draft is None:
            raise IncompatibleDraftError("no draft is shipped for this target: use "
                                         "hybrid:PATH with a draft model folder")
        drafter = make_drafter(str(model_draft), target, tokenizer, dtype, device, runtime, int8,
                               tree_width=tree_width, sampled_tree_width=sampled_tree_width)
        if not isinstance(drafter, ModelDrafter | FeatureDrafter):
            raise IncompatibleDraftError(f"hybrid lookup pairs n-grams with a draft model; "
                                         f"{model_draft} is a {drafter.name} draft")
        return HybridDrafter(drafter)
    from verispec.distill.feature import is_feature_draft, load_feature_weights
    from verispec.distill.model import is_distilled_draft, load_draft  # on use: no import cycle

    if is_feature_draft(draft):  # reads the target's features: built when it meets the runner
        weights, head_token_ids, taps = load_feature_weights(draft, target, tokenizer)
        return FeatureDrafter(weights, head_token_ids, target, vocab_size(target), taps,
                              tree_width, sampled_tree_width)
    if is_distilled_draft(draft):  # built on the target's embedding; its head covers a subset
        draft_model, head_token_ids = load_draft(draft, target, tokenizer)
        runner = make_runner(draft_model, runtime, dtype=dtype, int8=int8)
        return ModelDrafter(runner, vocab_size(target), head_token_ids=head_token_ids)
    draft_model, draft_tokenizer = loading.load(draft, dtype=dtype, device=device)
    check_vocab(target, tokenizer, draft_model, draft_tokenizer)
    runner = make_runner(draft_model, runtime, dtype=dtype, int8=int8)
    return ModelDrafter(runner, target_vocab_size=vocab_size(target))


def check_vocab(target: PreTrainedModel, tokenizer, draft: PreTrainedModel, draft_tokenizer
                ) -> None:
    """The draft must speak the target's tokenizer. Embedding tables may differ only by padding
    rows beyond the tokenizer's size."""
    target_size, draft_size = vocab_size(target), vocab_size(draft)
    if tokenizer is not None and draft_tokenizer is not None:
        if tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise IncompatibleDraftError("the draft's tokenizer differs from the target's; a draft "
                                         "model must use the target's tokenizer")
        if min(target_size, draft_size) < len(tokenizer):
            raise IncompatibleDraftError(
                f"vocabulary mismatch: target has {target_size} rows, draft {draft_size}, the "
                f"tokenizer {len(tokenizer)} tokens")
    elif target_size != draft_size:
        raise IncompatibleDraftError(
            f"vocabulary mismatch: target has {target_size} tokens, draft {draft_size}")


def vocab_size(model: PreTrainedModel) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _eos_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
