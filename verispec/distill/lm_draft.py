"""The distilled draft: a few Llama layers on the target's frozen embedding, with an LM head over
a subset of the vocabulary.

The head covers only the `head_vocab` most frequent tokens of the distillation data: on CPU a
full 49k-row head would cost as much as many layers. `ModelDrafter(head_token_ids=...)` spreads
its logits back over the full vocabulary with -inf elsewhere, so q is exactly the distribution
the draft tokens come from and verification stays lossless.

Its folder (written with `verispec.drafters.folder.save_draft`, read back with `load_draft`) is
described in `verispec.drafters.folder`.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from verispec.drafters.folder import assemble_draft


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

    The first layers start closest to the target: evenly spaced layers hand the last one inputs
    it never saw, and random layers start far from the target's distribution under its norm.
    """
    config = draft_config(target, layers)
    prefixes = tuple(f"model.layers.{i}." for i in range(layers))
    weights = {name: value for name, value in target.state_dict().items()
               if name.startswith(prefixes) or name == "model.norm.weight"}
    return assemble_draft(config, weights, target, head_token_ids, torch.float32)
