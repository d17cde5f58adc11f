"""The distilled draft: a few Llama layers on the target's frozen embedding, with an LM head over
a subset of the vocabulary, and its folder format.

The head covers only the `head_vocab` most frequent tokens of the distillation data: on CPU a
full 49k-row head would cost as much as many layers. `ModelDrafter(head_token_ids=...)` spreads
its logits back over the full vocabulary with -inf elsewhere, so q is exactly the distribution
the draft tokens come from and verification stays lossless.

A draft folder holds:
    config.json            the LlamaConfig (full vocab_size: the embedding is the target's)
    draft.safetensors      layers and final norm, `head_token_ids` [Vh] int64, and
                           `lm_head.weight` [Vh, H] only when the head was trained
    verispec_draft.json    {"format": "verispec-draft", "version": 1, "target": {...}, ...}
    tokenizer files        the target's, so tokenizer checks pass
    README.md              a model card
Loading needs the target: `load_draft(folder, target)` takes its embedding (and head rows).
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
EMBEDDING_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


def draft_config(target: PreTrainedModel, layers: int) -> LlamaConfig:
    """The target's config with `layers` layers and an untied head: same widths, heads, rope,
    norms and tokens."""
    if target.config.model_type != "llama":
        raise ValueError(f"distillation builds Llama drafts from Llama-family targets; this "
                         f"target is {target.config.model_type!r}")
    if not 1 <= layers <= target.config.num_hidden_layers:
        raise ValueError(f"layers must be in [1, {target.config.num_hidden_layers}] (the "
                         f"target's layer count), got {layers}")
    config = LlamaConfig.from_dict(target.config.to_dict())
    config.num_hidden_layers = layers
    config.tie_word_embeddings = False
    return config


def init_draft(target: PreTrainedModel, layers: int, head_token_ids: torch.Tensor
               ) -> LlamaForCausalLM:
    """A new draft (float32): the target's first `layers` layers and final norm, its embedding
    (frozen, shared) and its output-embedding rows for head_token_ids [Vh] as the head.

    The first layers are the best start measured on SmolLM2-135M (KL to the target 13 nats
    before training, 2.4 after 8 steps), far ahead of evenly spaced layers (66 nats: the last
    layer gets inputs it never saw) and of random layers (~100 nats under the target's norm).
    """
    config = draft_config(target, layers)
    prefixes = tuple(f"model.layers.{i}." for i in range(layers))
    weights = {name: value for name, value in target.state_dict().items()
               if name.startswith(prefixes) or name == "model.norm.weight"}
    return _assemble(config, weights, target, head_token_ids, torch.float32)


def save_draft(draft: LlamaForCausalLM, head_token_ids: torch.Tensor, folder: Path,
               target: PreTrainedModel, tokenizer, card: str, train_head: bool) -> None:
    """Write the draft folder at `folder`, replacing any previous one (staged, then renamed)."""
    weights = {name: value.detach().cpu().contiguous() for name, value in
               draft.state_dict().items()
               if name != EMBEDDING_KEY and (train_head or name != HEAD_KEY)}
    meta = {"layers": draft.config.num_hidden_layers, "trained_head": train_head}
    write_draft_folder(folder, draft.config, weights, head_token_ids, meta, target, tokenizer,
                       card)


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


def is_distilled_draft(folder) -> bool:
    return isinstance(folder, str | os.PathLike) and (Path(folder) / META_FILE).is_file()


def load_draft(folder, target: PreTrainedModel, tokenizer=None, full_head: bool = False
               ) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """Rebuild a saved draft on the target's embedding, dtype and device -> (draft, head_token_ids
    [Vh] long). Raises IncompatibleDraftError when the target is not the one it was made for.

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
    return _assemble(config, weights, target, head_token_ids, dtype).eval(), head_token_ids


def target_signature(target: PreTrainedModel, tokenizer) -> dict:
    """What a draft must match: the embedding's shape and, when known, the tokenizer's vocab."""
    rows, hidden = target.get_input_embeddings().weight.shape
    signature = {"vocab_size": int(rows), "hidden_size": int(hidden)}
    if tokenizer is not None:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
        signature["tokenizer"] = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return signature


def _assemble(config: LlamaConfig, weights: dict[str, torch.Tensor], target: PreTrainedModel,
              head_token_ids: torch.Tensor, dtype: torch.dtype) -> LlamaForCausalLM:
    """A draft from its own weights plus the target's embedding (frozen, shared when the dtypes
    agree) and, unless `weights` holds a trained head, the target's output rows for
    head_token_ids [Vh]."""
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
