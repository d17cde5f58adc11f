"""Which tokens a trimmed draft head keeps (FR-Spec, Zhao et al. 2025, arXiv 2502.14856).

A draft model's output layer over a ranked subset of the vocabulary reads only those rows: for
Qwen2.5's 151,936 tokens the head is a third of the 0.5B draft's bytes a step, and most of it
scores tokens the target hardly ever writes. The draft's distribution is then its softmax over
the subset's logits, zero elsewhere (`ModelDrafter`'s `head_token_ids`); verification stays
exact, since a token the draft cannot propose is still reached through the correction draw
max(0, p - q).

The ranking ships per vocabulary as verispec/data/vocab/<vocabulary key>.npz: `ids` [n] and
`counts` [n], from text the target wrote on verispec's own prompts (never benchmark
questions): each token scored by how often it was written plus the probability the target gave
it along the way, most first (scripts/vocab_ranking.py writes it). Tokens outside it follow in
id order, which for byte-level BPE vocabularies is merge order, roughly frequency in the
tokenizer's own corpus. Special tokens (EOS, the chat template's) are always kept.

Example: ranking [5, 9], vocabulary of 40, specials {11}, size 4 (rounded up to 16 rows) ->
head [11, 5, 9, 0, 1, 2, 3, 4, 6, 7, 8, 10, 12, 13, 14, 15].
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import resources
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("verispec")

DATA_FOLDER = "vocab"
# The head's rows are multiplied 16 at a time (verispec/quant/kernels/panels.h): sizes round up.
HEAD_MULTIPLE = 16


def vocabulary_key(tokenizer) -> str:
    """A short hash of the tokenizer's token -> id table: tokenizers with the same vocabulary
    (a target and its draft, whatever their chat templates) share a ranking."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:16]


def ranking_path(tokenizer, folder: Path | None = None) -> Path:
    """Where the ranking of this tokenizer's vocabulary lives (in the package by default)."""
    root = folder or Path(str(resources.files("verispec") / "data" / DATA_FOLDER))
    return root / f"{vocabulary_key(tokenizer)}.npz"


def load_ranking(tokenizer, folder: Path | None = None) -> torch.Tensor | None:
    """The shipped ranking [n] long (most written first) of this tokenizer's vocabulary, or
    None where none is shipped."""
    path = ranking_path(tokenizer, folder)
    if not path.is_file():
        return None
    with np.load(path) as data:
        return torch.from_numpy(data["ids"].astype(np.int64))


def special_ids(tokenizer, eos_ids=()) -> list[int]:
    """The ids a trimmed head always keeps: the tokenizer's special and added tokens, EOS."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids.update(int(i) for i in eos_ids if i is not None)
    return sorted(ids)


def head_ids(ranking: torch.Tensor, vocab_size: int, size: int,
             always: list[int] = ()) -> torch.Tensor:
    """The `size` token ids a trimmed head keeps, [size] long, in rank order: `always` first,
    then `ranking`'s ids, then the unranked ids in id order; ids >= vocab_size are dropped.
    size is rounded up to a multiple of HEAD_MULTIPLE and capped at vocab_size."""
    size = min(-(-size // HEAD_MULTIPLE) * HEAD_MULTIPLE, vocab_size)
    order = torch.cat([torch.as_tensor(list(always), dtype=torch.long), ranking.long(),
                       torch.arange(vocab_size)])
    order = order[(order >= 0) & (order < vocab_size)]
    # first occurrence of each id, in order: a stable unique
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    keep = []
    for token in order.tolist():
        if not seen[token]:
            seen[token] = True
            keep.append(token)
            if len(keep) == size:
                break
    return torch.tensor(keep, dtype=torch.long)


def save_ranking(path: Path, counts: dict[int, int], meta: dict,
                 mass: torch.Tensor | None = None, min_score: float = 1e-3) -> None:
    """Write a ranking: ids by score, most first (ties by id), where a token's score is its
    count plus its probability mass (mass [V]: the target's probabilities summed over the
    positions it wrote; None: counts alone), ids scoring under min_score left out; their
    counts, and `meta` as JSON text."""
    score = torch.zeros(max([*counts, -1]) + 1 if mass is None else mass.numel(),
                        dtype=torch.float64)
    if mass is not None:
        score += mass.double()
    for token, count in counts.items():
        score[token] += count
    kept = torch.nonzero(score >= min_score).flatten()
    # by score, ties by id: a stable sort of the ids (ascending) by descending score
    order = kept[torch.sort(-score[kept], stable=True).indices]
    np.savez_compressed(path, ids=order.numpy().astype(np.int32),
                        counts=np.array([counts.get(int(i), 0) for i in order], dtype=np.int32),
                        meta=np.array(json.dumps(meta)))


def trim_head(model, token_ids: torch.Tensor) -> None:
    """Keep only the head rows of `token_ids` [n] in `model` (a GGUFModel, or a transformers
    causal LM), in that order: its logit j then scores token token_ids[j]. The product then
    reads n rows instead of the vocabulary's."""
    from verispec.quant.gguf import GGUFTensor
    from verispec.quant.linear import QuantMatrix
    from verispec.quant.quantized_model import GGUFModel

    ids = token_ids.long()
    if isinstance(model, GGUFModel):
        if model.native is not None:
            raise ValueError("trim the head before the model's runtime is built")
        head = model.head
        model.head = QuantMatrix(GGUFTensor("output.weight", head.qtype,
                                            (int(ids.numel()), int(head.shape[1])),
                                            head.data[ids].contiguous()))
        return
    old = model.get_output_embeddings()
    new = torch.nn.Linear(old.in_features, int(ids.numel()), bias=old.bias is not None,
                          dtype=old.weight.dtype, device=old.weight.device)
    with torch.no_grad():
        new.weight.copy_(old.weight[ids.to(old.weight.device)])
        if old.bias is not None:
            new.bias.copy_(old.bias[ids.to(old.bias.device)])
    model.config.tie_word_embeddings = False  # the head is its own now
    model.set_output_embeddings(new)
