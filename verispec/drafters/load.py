"""From what the user names as a draft to a drafter: the one place the decoder, the bench and
the CLI turn a draft spec into a `Drafter`.

A spec is None / "none" (plain decoding), "ngram", "suffix" (lookup over the request and
earlier requests, `verispec.drafters.suffix`), "default" (the draft shipped for the target
with n-gram lookup, else lookup alone), "hybrid" / "hybrid:PATH" (lookup where the text repeats
itself, the shipped draft or the one at PATH elsewhere), or the path of a draft: a folder that
`verispec distill` wrote (`verispec.drafters.folder`), or any causal LM folder or .gguf that
shares the target's tokenizer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from verispec import loading
from verispec.config import (  # noqa: F401 - the draft defaults, re-exported
    DEFAULT_DRAFT_QUANT,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_TREE_WIDTH,
    check_tree_width,
)
from verispec.drafters.drafter import Drafter
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.folder import (
    is_distilled_draft,
    is_feature_draft,
    load_draft,
    load_feature_weights,
)
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.drafters.vocab_rank import head_ids, load_ranking, special_ids, trim_head
from verispec.errors import IncompatibleDraftError
from verispec.quant.quantized_model import GGUFModel
from verispec.quant.requant import parse_type, requantized
from verispec.runtime import make_runner
from verispec.vocab import check_vocab, eos_ids, vocab_size

log = logging.getLogger("verispec")



@dataclass(frozen=True, slots=True)
class DraftModel:
    """A draft that is a causal LM of its own (not a feature draft)."""

    model: PreTrainedModel
    # [Vh] long: the tokens its head covers, in order (a distilled draft); None: the full
    # vocabulary, as the target's
    head_token_ids: torch.Tensor | None = None


def load_draft_model(draft: str | os.PathLike, target: PreTrainedModel, tokenizer,
                     dtype: str = "auto", device: str = "cpu",
                     dequantize: str | None = "bf16", draft_vocab: int | None = None,
                     draft_quant: str | None = None) -> DraftModel:
    """A distilled small LM draft (rebuilt on the target's embedding) or any causal LM checked
    against the target's vocabulary. Raises IncompatibleDraftError when it does not fit.

    draft_vocab: the head keeps that many of the target's most written tokens
    (`verispec.drafters.vocab_rank`) where a ranking ships for the tokenizer; None or 0: the
    full head. draft_quant: a GGUF draft at its own bit width has its wider block matrices
    re-quantised to this type ("q4_0", ...; `verispec.quant.requant`); None: as the file has
    them. Neither changes what is emitted, only what the draft proposes and what it costs."""
    parse_type(draft_quant)  # checks the value
    if is_distilled_draft(draft):  # built on the target's embedding; its head covers a subset
        model, head_token_ids = load_draft(draft, target, tokenizer)
        return DraftModel(model, head_token_ids)
    model, draft_tokenizer = loading.load(draft, dtype=dtype, device=device,
                                          dequantize=dequantize)
    check_vocab(target, tokenizer, model, draft_tokenizer)
    if isinstance(model, GGUFModel) and parse_type(draft_quant) is not None:
        model = GGUFModel(requantized(model.file, parse_type(draft_quant)))
    return trimmed(DraftModel(model), target, tokenizer, draft_vocab)


def trimmed(draft: DraftModel, target, tokenizer, draft_vocab: int | None) -> DraftModel:
    """`draft` with its head cut to the draft_vocab tokens the target writes most (special
    tokens always kept); as it is where draft_vocab is None/0 or covers the vocabulary, or no
    ranking ships for the tokenizer."""
    if draft_vocab is not None and draft_vocab < 0:
        raise ValueError(f"draft_vocab must be >= 0 (0: the full head), got {draft_vocab}")
    width = vocab_size(target)
    if not draft_vocab or draft_vocab >= width or draft.head_token_ids is not None:
        return draft
    ranking = None if tokenizer is None else load_ranking(tokenizer)
    if ranking is None:
        log.info("no vocabulary ranking ships for this tokenizer: the draft keeps its full head")
        return draft
    ids = head_ids(ranking, min(width, _head_rows(draft.model)), draft_vocab,
                   special_ids(tokenizer, eos_ids(target, tokenizer)))
    trim_head(draft.model, ids)
    log.info("draft head: %d of %d tokens", ids.numel(), width)
    return replace(draft, head_token_ids=ids)


def _head_rows(model) -> int:
    if isinstance(model, GGUFModel):
        return int(model.head.shape[0])
    return int(model.get_output_embeddings().weight.shape[0])


def resolve_draft(draft, target_spec=None, runtime: str = "auto") -> str | None:
    """The draft a spec names, as `load_drafter` loads it: None (plain decoding), "ngram",
    "hybrid:PATH" or the PATH (or model name) of a draft. Example: "default" for the embedded
    target -> "hybrid:<the shipped feature draft's folder>"; on runtime "hf" -> "ngram"."""
    if draft is None or draft == "none":
        return None
    if draft == "default":  # the shipped draft with lookup where the text repeats, else lookup
        shipped = loading.default_draft(target_spec)
        # (the shipped draft reads the target's features, which transformers' runtime lacks)
        return "ngram" if shipped is None or runtime == "hf" else f"hybrid:{shipped}"
    if draft in ("ngram", "suffix"):
        return draft
    if isinstance(draft, str) and (draft == "hybrid" or draft.startswith("hybrid:")):
        model_draft = draft.partition(":")[2] or loading.default_draft(target_spec)
        if model_draft is None:
            raise IncompatibleDraftError("no draft is shipped for this target: use "
                                         "hybrid:PATH with a draft model folder")
        return f"hybrid:{model_draft}"
    return os.fspath(draft)


def load_drafter(draft, target: PreTrainedModel, tokenizer, dtype: str = "auto",
                 device: str = "cpu", runtime: str = "auto", int8: bool = False,
                 target_spec=None, tree_width: int = DEFAULT_TREE_WIDTH,
                 sampled_tree_width: int = 1, dequantize: str | None = "bf16",
                 draft_vocab: int | None = None, draft_quant: str | None = None
                 ) -> Drafter | None:
    """The drafter that `draft` names (see the module docstring); "default" and "hybrid" look
    up the draft shipped for `target_spec` (the target as given to `loading.load`). A draft
    model runs on the same runtime, dtype and quantization as the target. tree_width: how wide
    the token trees a feature draft proposes for greedy rows are, sampled_tree_width for
    sampled rows (1: chains). dequantize: for a GGUF draft model, as `loading.load` takes it
    (None: its own formats, as a quantized target runs). draft_vocab, draft_quant: a draft
    model's trimmed head and re-quantised weights (`load_draft_model`)."""
    check_tree_width(tree_width)
    check_tree_width(sampled_tree_width)
    draft = resolve_draft(draft, target_spec, runtime)
    if draft is None:
        return None
    if draft == "ngram":
        return NgramDrafter()
    if draft == "suffix":
        return SuffixDrafter()
    if draft.startswith("hybrid:"):
        model_draft = draft.removeprefix("hybrid:")
        drafter = load_drafter(model_draft, target, tokenizer, dtype, device, runtime, int8,
                               tree_width=tree_width, sampled_tree_width=sampled_tree_width,
                               dequantize=dequantize, draft_vocab=draft_vocab,
                               draft_quant=draft_quant)
        if not isinstance(drafter, ModelDrafter | FeatureDrafter):
            raise IncompatibleDraftError(f"hybrid lookup pairs n-grams with a draft model; "
                                         f"{model_draft} is a {drafter.name} draft")
        return HybridDrafter(drafter)
    if is_feature_draft(draft):  # reads the target's features: built when it meets the runner
        weights, head_token_ids, taps = load_feature_weights(draft, target, tokenizer)
        return FeatureDrafter(weights, head_token_ids, target, vocab_size(target), taps,
                              tree_width, sampled_tree_width)
    loaded = load_draft_model(draft, target, tokenizer, dtype=dtype, device=device,
                              dequantize=dequantize, draft_vocab=draft_vocab,
                              draft_quant=draft_quant)
    runner = make_runner(loaded.model, runtime, dtype=dtype, int8=int8)
    return ModelDrafter(runner, vocab_size(target), head_token_ids=loaded.head_token_ids)
