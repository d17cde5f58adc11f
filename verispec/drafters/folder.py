"""The draft folder: how a distilled draft is written (by `verispec distill`) and read back (by
the decoder and the bench), for both kinds of draft.

A draft folder holds:
    config.json            the target's LlamaConfig with the draft's layer count (full
                           vocab_size: the embedding is the target's)
    draft.safetensors      the draft's own weights and `head_token_ids` [Vh] int64
    verispec_draft.json    {"format": "verispec-draft", "version": 1, "target": {...},
                            "head_vocab": Vh, ...}; a feature draft adds "kind": "feature" and
                           "taps": [...]
    tokenizer files        the target's, so tokenizer checks pass
    README.md              a model card

The two kinds:
- a small LM draft ("layers"): a few Llama layers and the final norm, and `lm_head.weight`
  [Vh, H] only when the head was trained (otherwise the target's output rows for head_token_ids
  are its head). `load_draft` rebuilds it on the target's embedding.
- a feature draft ("feature", EAGLE-style): fc, one layer's weights (`verispec.drafters.feature`
  runs them) and, with taps, fc_taps. `load_feature_weights` returns them by name.

Reading a draft needs the target: its embedding and head rows complete the draft, and its
signature (embedding shape, tokenizer hash) must match the one recorded at distillation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import safetensors.torch
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from verispec.errors import IncompatibleDraftError

META_FILE = "verispec_draft.json"
WEIGHTS_FILE = "draft.safetensors"
FORMAT = "verispec-draft"
VERSION = 1
FEATURE_KIND = "feature"
EMBEDDING_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"
FEATURE_TAPS_KEY = "fc_taps.weight"


# -- the folder's metadata ----------------------------------------------------------------------


def target_signature(target: PreTrainedModel, tokenizer) -> dict:
    """What a draft must match: the embedding's shape and, when known, the tokenizer's vocab."""
    rows, hidden = target.get_input_embeddings().weight.shape
    signature = {"vocab_size": int(rows), "hidden_size": int(hidden)}
    if tokenizer is not None:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
        signature["tokenizer"] = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return signature


def _meta_path(folder) -> Path | None:
    """The folder's verispec_draft.json, or None when `folder` is not a draft folder."""
    if not isinstance(folder, str | os.PathLike):
        return None
    path = Path(folder) / META_FILE
    return path if path.is_file() else None


def is_distilled_draft(folder) -> bool:
    """A folder written by `verispec distill`, of either kind."""
    return _meta_path(folder) is not None


def is_feature_draft(folder) -> bool:
    path = _meta_path(folder)
    return path is not None and json.loads(path.read_text()).get("kind") == FEATURE_KIND


def taps_fit(taps: tuple[int, ...], num_layers: int) -> bool:
    """Taps read inside the stack: after 1..num_layers-1 layers (after all of them is the
    feature itself)."""
    return all(0 < tap < num_layers for tap in taps)


# -- writing ------------------------------------------------------------------------------------


def write_draft_folder(folder: Path, config, weights: dict[str, torch.Tensor],
                       head_token_ids: torch.Tensor, meta: dict, target: PreTrainedModel,
                       tokenizer, card: str) -> None:
    """A draft folder (config, weights + head ids, verispec_draft.json with the target's
    signature and `meta`, the tokenizer, a model card), staged, then renamed over any previous
    one so a reader never sees half a folder."""
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config.save_pretrained(staging)
    weights = {**weights, "head_token_ids": head_token_ids.cpu().long().contiguous()}
    safetensors.torch.save_file(weights, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {"format": FORMAT, "version": VERSION, "target": target_signature(target, tokenizer),
            "head_vocab": int(head_token_ids.numel()), **meta}
    (staging / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    (staging / "README.md").write_text(card)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(staging, folder)
    shutil.rmtree(old, ignore_errors=True)


def save_draft(draft: LlamaForCausalLM, head_token_ids: torch.Tensor, folder: Path,
               target: PreTrainedModel, tokenizer, card: str, train_head: bool) -> None:
    """Write a small LM draft's folder, without the target's embedding (and without the head
    unless it was trained: the target's rows for head_token_ids [Vh] are then the head)."""
    weights = {name: value.detach().cpu().contiguous() for name, value in
               draft.state_dict().items()
               if name != EMBEDDING_KEY and (train_head or name != HEAD_KEY)}
    meta = {"layers": draft.config.num_hidden_layers, "trained_head": train_head}
    write_draft_folder(folder, draft.config, weights, head_token_ids, meta, target, tokenizer,
                       card)


def save_feature_draft(head: nn.Module, head_token_ids: torch.Tensor, folder: Path,
                       target: PreTrainedModel, tokenizer, card: str) -> None:
    """Write a feature draft's folder from its head (a module with `taps`, as
    `verispec.distill.feature_head.FeatureHead`); bfloat16 weights."""
    config = LlamaConfig.from_dict(target.config.to_dict())
    config.num_hidden_layers = 1
    weights = {name: value.detach().to(torch.bfloat16).contiguous()
               for name, value in head.state_dict().items()}
    write_draft_folder(folder, config, weights, head_token_ids,
                       {"kind": FEATURE_KIND, "taps": list(head.taps)}, target, tokenizer, card)


# -- reading ------------------------------------------------------------------------------------


def load_draft(folder, target: PreTrainedModel, tokenizer=None, full_head: bool = False
               ) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """Rebuild a saved small LM draft on the target's embedding, dtype and device -> (draft,
    head_token_ids [Vh] long). Raises IncompatibleDraftError when the target is not the one it
    was made for.

    full_head: give the draft the target's whole output embedding as its head instead (an
    ordinary full-vocabulary causal LM, for peers such as transformers' assisted generation that
    need full-width logits); head_token_ids is then arange(V)."""
    folder = Path(folder)
    meta = json.loads((folder / META_FILE).read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise IncompatibleDraftError(f"{folder} is not a version-{VERSION} verispec draft")
    expected, actual = meta["target"], target_signature(target, tokenizer)
    for key in ("vocab_size", "hidden_size"):
        if expected[key] != actual[key]:
            raise IncompatibleDraftError(
                f"{folder} was distilled for a target with {key} {expected[key]}, but this target "
                f"has {actual[key]}: use the target it was distilled from")
    if expected.get("tokenizer") and actual.get("tokenizer") and (
            expected["tokenizer"] != actual["tokenizer"]):
        raise IncompatibleDraftError(f"{folder} was distilled with another tokenizer than this "
                                     "target's")
    config = LlamaConfig.from_json_file(str(folder / "config.json"))
    weights = safetensors.torch.load_file(str(folder / WEIGHTS_FILE))
    head_token_ids = weights.pop("head_token_ids")
    if full_head:
        weights.pop(HEAD_KEY, None)
        head_token_ids = torch.arange(target.get_output_embeddings().weight.shape[0])
    dtype = target.get_input_embeddings().weight.dtype
    return assemble_draft(config, weights, target, head_token_ids, dtype).eval(), head_token_ids


def load_feature_weights(folder, target: PreTrainedModel, tokenizer=None
                         ) -> tuple[dict[str, torch.Tensor], torch.Tensor, tuple[int, ...]]:
    """-> (the head's weights by name, head_token_ids [Vh], its taps); refuses another target's
    draft."""
    folder = Path(folder)
    meta = json.loads((folder / META_FILE).read_text())
    if meta.get("format") != FORMAT or meta.get("kind") != FEATURE_KIND:
        raise IncompatibleDraftError(f"{folder} is not a verispec feature draft")
    expected, actual = meta["target"], target_signature(target, tokenizer)
    for key in ("vocab_size", "hidden_size", "tokenizer"):
        if expected.get(key) and actual.get(key) and expected[key] != actual[key]:
            raise IncompatibleDraftError(
                f"{folder} was distilled for another target ({key} differs): use the target it "
                f"was distilled from")
    weights = safetensors.torch.load_file(str(folder / WEIGHTS_FILE))
    head_token_ids = weights.pop("head_token_ids")
    taps = tuple(int(t) for t in meta.get("taps", ()))
    num_layers = target.config.num_hidden_layers
    if not taps_fit(taps, num_layers) or (FEATURE_TAPS_KEY in weights) != bool(taps):
        raise IncompatibleDraftError(f"{folder}: its taps {taps} do not fit its weights or the "
                                     f"target's {num_layers} layers")
    return weights, head_token_ids, taps


def assemble_draft(config: LlamaConfig, weights: dict[str, torch.Tensor],
                   target: PreTrainedModel, head_token_ids: torch.Tensor, dtype: torch.dtype
                   ) -> LlamaForCausalLM:
    """A small LM draft from its own weights plus the target's embedding (frozen, shared when
    the dtypes agree) and, unless `weights` holds a trained head, the target's output rows for
    head_token_ids [Vh]. `weights` loses its head entry."""
    embedding = target.get_input_embeddings().weight.detach()  # [V, H]
    head = weights.pop(HEAD_KEY, None)
    if head is None:
        head = target.get_output_embeddings().weight.detach()[head_token_ids.to(embedding.device)]
    with no_init_weights():  # every weight is set below: skip the random init of V x H tables
        draft = LlamaForCausalLM(config)
    draft.lm_head = nn.Linear(config.hidden_size, int(head_token_ids.numel()), bias=False)
    draft.model.embed_tokens = nn.Embedding.from_pretrained(embedding.to(dtype), freeze=True)
    draft.to(device=embedding.device, dtype=dtype)
    missing, unexpected = draft.load_state_dict({**weights, HEAD_KEY: head}, strict=False)
    if unexpected or set(missing) != {EMBEDDING_KEY}:
        raise IncompatibleDraftError(f"draft weights do not fit its config: missing "
                                     f"{sorted(set(missing) - {EMBEDDING_KEY})}, unexpected "
                                     f"{sorted(unexpected)}")
    return draft
