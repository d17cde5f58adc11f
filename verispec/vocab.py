"""A loaded model's vocabulary: its width, the ids that end a generation, and whether a draft
speaks the same one."""

from __future__ import annotations

from transformers import PreTrainedModel

from verispec.errors import IncompatibleDraftError


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output embedding: the width of the model's logits."""
    return int(model.get_output_embeddings().weight.shape[0])


def eos_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    """Every end-of-sequence id the model's generation config, its config or its tokenizer
    names (they may disagree, and a chat model often has several)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


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
