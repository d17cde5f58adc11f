"""Request prompts -> token ids, on the engine thread (the tokenizer's one user).

Completions take text as it is (no chat template) or token ids; chat completions render the
whole message list with the tokenizer's chat template, ending with the assistant's turn.
"""

from __future__ import annotations

import jinja2
import torch


def completion_ids(decoder, prompt: str | list[int]) -> torch.Tensor:
    """-> ids [L]; ValueError for an empty prompt, bad ids or one too long for the context."""
    return decoder.encode(prompt, chat=False)


def chat_ids(decoder, messages: list[dict[str, str]]) -> torch.Tensor:
    """-> ids [L] of the messages under the chat template, with the generation prompt."""
    tokenizer = decoder.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    except jinja2.TemplateError as err:  # templates may refuse a role order, say
        raise ValueError(f"the chat template refused the messages: {err}") from None
    return decoder.encode(tokenizer(text, add_special_tokens=False)["input_ids"], chat=False)
