"""Text in and out: prompts, chats and predictions to ids (`encode_prompt`, `chat_ids`,
`encode_prediction`), and ids to text as it streams, with stop strings (`TextStream`)."""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from verispec.errors import PromptTooLongError

Prompt = str | Sequence[int]


def encode_prompt(tokenizer: PreTrainedTokenizerBase | None, prompt: Prompt, chat: bool,
                  vocab_size: int, max_positions: int) -> torch.Tensor:
    """A prompt string (chat template applied when the tokenizer has one and chat is on) or a
    list of token ids -> ids [L] long. Bad input raises ValueError: an empty prompt, ids out of
    [0, vocab_size), text without a tokenizer, a prompt that fills the model's context."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prompt as token ids")
        unicode_only(prompt, "prompt")
        if chat and getattr(tokenizer, "chat_template", None):
            ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = tokenizer(prompt)["input_ids"]
    else:
        ids = _id_list(prompt, vocab_size, "prompt")
        if not ids:
            raise ValueError("prompt is empty")
    if len(ids) >= max_positions:
        raise PromptTooLongError(len(ids), max_positions)
    return torch.tensor(ids, dtype=torch.long)


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
             text: str | None = None) -> list[int]:
    """Messages under the tokenizer's chat template, ending with the assistant's turn -> ids.

    A special token's text inside a message ("<|im_end|>" written by a user) stays text there,
    as OpenAI treats it: it cannot close the turn or open another role's. Messages without such
    text are tokenised as the template renders them, whole. Those with it: the template's text
    around each message is tokenised with its special tokens, each message's content with none
    (ValueError where that cannot give the rendered text back: a template that changes a
    content it is given, trimming it say; a tokenizer that starts every text with a space).
    The template's own errors propagate. text: the messages as the template renders them, where
    the caller has it already.
    """
    if text is None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    specials = [token.content for token in tokenizer.added_tokens_decoder.values()
                if token.special]
    held = [isinstance(message.get("content"), str)
            and any(special in message["content"] for special in specials)
            for message in messages]
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not any(held):
        return whole
    # 1. the template rendered with a marker in place of each such content: two private-use
    #    characters that occur in none of the messages, nor in the template's text
    used = text + "".join(str(message.get("content")) for message in messages)
    opening, closing = next((chr(c), chr(c + 1)) for c in range(0xE000, 0xF8FF, 2)
                            if chr(c) not in used and chr(c + 1) not in used)
    marked = tokenizer.apply_chat_template(
        [{**message, "content": f"{opening}{i}{closing}"} if held[i] else message
         for i, message in enumerate(messages)], add_generation_prompt=True, tokenize=False)
    # 2. the template's pieces with their special tokens, the contents as plain text
    ids: list[int] = []
    rebuilt: list[str] = []
    for n, piece in enumerate(re.split(f"{opening}(\\d+){closing}", marked)):
        if n % 2:  # a marker's message index
            piece = messages[int(piece)]["content"]
            ids += tokenizer(piece, add_special_tokens=False,
                             split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        rebuilt.append(piece)
    # 3. the same text as the whole rendering, read back both ways
    if "".join(rebuilt) != text or tokenizer.decode(ids) != tokenizer.decode(whole):
        raise ValueError("a message holds a special token's text, and this model's chat "
                         "template or tokenizer cannot keep it as text (the template changes "
                         "message content, or pieces tokenised apart read back otherwise)")
    return ids


def encode_prediction(tokenizer: PreTrainedTokenizerBase | None, prediction: Prompt,
                      vocab_size: int) -> torch.Tensor:
    """A predicted output (text, or token ids) -> ids [P] long, as the output would hold them
    (no special tokens, no chat template)."""
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prediction as token ids")
        unicode_only(prediction, "prediction")
        ids = tokenizer(prediction, add_special_tokens=False)["input_ids"]
    else:
        ids = _id_list(prediction, vocab_size, "prediction")
    return torch.tensor(ids, dtype=torch.long)


def unicode_only(text: str, what: str | None = None) -> str:
    """`text`, where UTF-8 can encode it; else ValueError (naming `what`): a lone surrogate, as
    JSON's "\\ud800" or bytes that are not UTF-8 on a command line decode to. No tokenizer takes
    it, and no response could repeat it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        subject = "not valid Unicode" if what is None else f"{what} is not valid Unicode"
        raise ValueError(f"{subject}: {err.reason} at character {err.start}") from None
    return text


def _id_list(ids: object, vocab_size: int, what: str) -> list[int]:
    """Token ids given as a sequence of integers (a list, a tuple, a range), or a 1-D integer
    tensor or NumPy array -> a list of ints; anything else (a number, bytes, a set, floats,
    ids out of [0, vocab_size)) raises ValueError naming `what`."""
    if _integer_vector(ids):
        ids = ids.tolist()
    if not isinstance(ids, Sequence) or isinstance(ids, str | bytes | bytearray):
        raise ValueError(f"{what} must be text or a list of token ids, not "
                         f"{type(ids).__name__}")
    if ids and any(isinstance(t, Mapping) for t in ids):
        raise ValueError(f"one {what} is text or token ids, not chat messages: give the user's "
                         f"text (the model's chat template is applied to it), or the ids of "
                         f"tokenizer.apply_chat_template(messages, add_generation_prompt=True)")
    if ids and all(isinstance(t, str) for t in ids):
        raise ValueError(f"one {what} is text or token ids, not a list of texts (a batch of "
                         f"prompts goes to generate(), or one add_request each)")
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool | np.bool_) and
               0 <= t < vocab_size for t in ids):
        raise ValueError(f"{what} token ids must be integers in [0, {vocab_size})")
    return [int(t) for t in ids]


def _integer_vector(ids: object) -> bool:
    """Whether ids is a 1-D tensor or NumPy array of integers."""
    if isinstance(ids, np.ndarray):
        return ids.ndim == 1 and ids.dtype.kind in "iu"
    return isinstance(ids, torch.Tensor) and ids.dim() == 1 and not (
        ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)


class TextStream:
    """Turns a growing list of generated ids into printable text pieces.

    Text is held back while it may still change: an incomplete UTF-8 character (decoded as
    U+FFFD) or a suffix that could be the start of a stop string. When a stop string appears the
    text is cut just before it and `stopped` is set; `num_tokens` then says how many ids were
    needed to produce it.

    Example: stop ("\\n\\n",), pieces "Hi", "!\\n", "\\nBye" -> yields "Hi", "!", then stops with
    text "Hi!".

    Decoding is incremental: each round decodes only the ids since the last point where the text
    ended on a whole character (with the ids before it as context, for tokenizers that drop a
    leading space), so a long output costs the same per round as a short one (decoding all of
    2,048 ids takes ~300 us with SmolLM2's tokenizer, a twentieth of a decode step).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far, cut before a stop string once stopped
        self.emitted = 0  # characters of self.text already returned by add()
        self.stopped = False
        self.num_tokens = 0
        # self.text is decode(ids[:read]); ids[context:read] are decoded again with the new ones
        self._context = 0
        self._read = 0

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the text that is now final."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        self.num_tokens = len(self.ids)
        if self.tokenizer is None:
            return ""
        unread = self._read  # ids not in self.text yet: this round's and any held back
        self._read_new(final=False)
        if self.stop:
            cut = self._find_stop(self.text)
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                self.num_tokens = self._tokens_to_stop(unread)
        return self._release(final=self.stopped)

    def flush(self) -> str:
        """At the end of generation: return whatever is still held back."""
        if not self.stopped and self.tokenizer is not None:
            self._read_new(final=True)
        return self._release(final=True)

    def _read_new(self, final: bool) -> None:
        """Append the text of the ids after `_read` once it ends on a whole character (an
        incomplete one decodes as U+FFFD), or at the end whatever it is."""
        if self._read == len(self.ids):
            return
        known = self._decode(self.ids[self._context:self._read])
        text = self._decode(self.ids[self._context:])
        if final or (len(text) > len(known) and not text.endswith("\ufffd")):
            self.text += text[len(known):]
            self._context, self._read = self._read, len(self.ids)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end = len(self.text.rstrip("\ufffd"))
            for stop in self.stop:
                for size in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[end - size:end] == stop[:size]:
                        end -= size
                        break
        end = max(end, self.emitted)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int | None:
        # Only text past what was already released can hold a new stop string.
        longest = max(len(s) for s in self.stop)
        window_start = max(0, self.emitted - longest)
        found = [i for s in self.stop if (i := text.find(s, window_start)) >= 0]
        return min(found) if found else None

    def _tokens_to_stop(self, unread: int) -> int:
        """The fewest ids whose text contains a stop string, searching from ids[unread] (the
        first not in the text before this round: a round's text may wait for a later round to
        complete its last character, and arrive with it). The search window starts from the
        decoding of the ids before, not from `emitted`: a whole decoding need not be as long as
        the pieces decoded round by round (bytes that are no whole character decode as
        U+FFFD)."""
        longest = max(len(s) for s in self.stop)
        window_start = max(0, len(self._decode(self.ids[:unread])) - longest)
        for count in range(unread + 1, len(self.ids) + 1):
            text = self._decode(self.ids[:count])
            if any(text.find(s, window_start) >= 0 for s in self.stop):
                return count
        return len(self.ids)
