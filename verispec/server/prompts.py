"""Request prompts -> token ids under the server's limits, in a thread of their own.

Completions take text as it is (no chat template) or token ids; chat completions render the
whole message list with the tokenizer's chat template, ending with the assistant's turn.

Tokenising runs in a small thread pool, never on the engine thread or the event loop, so a long
prompt delays no other request. A text is refused before it is tokenised when it is longer in
UTF-8 bytes than `max_prompt_tokens` of the vocabulary's longest token could cover: it cannot
fit, and tokenising it would cost ~1 us a byte.

    prompts = Prompts(decoder, max_prompt_tokens=None)   # None: the context less one token
    ids = await prompts.completion("Hello")             # [L] ints, or APIError (400)
    params = prompts.fit(len(ids), params, explicit=True)  # max_tokens within the context
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jinja2
from tokenizers import decoders

from verispec.errors import PromptTooLongError
from verispec.params import SamplingParams
from verispec.server.protocol import APIError
from verispec.text import chat_ids

TOKENIZE_THREADS = 4  # fast tokenizers release the GIL; a few long prompts run side by side
TOO_LONG = "context_length_exceeded"  # OpenAI's code for a prompt or max_tokens too long


class Prompts:
    def __init__(self, decoder, max_prompt_tokens: int | None = None) -> None:
        self.decoder = decoder
        self.context = decoder.target.max_positions
        self.max_prompt_tokens = min(max_prompt_tokens or self.context - 1, self.context - 1)
        self.max_token_bytes = longest_token_bytes(decoder.tokenizer)
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="verispec-tokenize")

    async def completion(self, prompt: str | list[int]) -> list[int]:
        """-> ids of a text (no chat template) or of token ids, checked; APIError (400)."""
        return await self._off_loop(self._completion_ids, prompt)

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """-> ids of the messages under the chat template, with the generation prompt."""
        return await self._off_loop(self._chat_ids, messages)

    async def prediction(self, text: str) -> list[int]:
        """-> ids of a predicted output (no special tokens), checked like a prompt."""
        return await self._off_loop(self._prediction_ids, text)

    def fit(self, prompt_tokens: int, params: SamplingParams, explicit: bool) -> SamplingParams:
        """max_tokens within the context: one asked for beyond the room the prompt leaves is a
        400 (as vLLM answers); a default one is cut to that room."""
        room = self.context - prompt_tokens
        if params.max_new_tokens <= room:
            return params
        if explicit:
            raise APIError(400, f"max_tokens is {params.max_new_tokens}, but the model's context "
                                f"of {self.context} tokens leaves {room} after the prompt's "
                                f"{prompt_tokens}", param="max_tokens", code=TOO_LONG)
        return dataclasses.replace(params, max_new_tokens=room)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, encode, prompt) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode, prompt)

    # -- in the pool ---------------------------------------------------------------------------

    def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self._check_text(prompt)
        elif len(prompt) > self.max_prompt_tokens:
            raise self._too_long(len(prompt))
        return self._checked(self._encode(prompt))

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        tokenizer = self.decoder.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
            self._check_text(text)
            ids = chat_ids(tokenizer, messages, text)  # rendered once
        except jinja2.TemplateError as err:  # templates may refuse a role order, say
            raise APIError(400, f"the chat template refused the messages: {err}",
                           param="messages") from None
        except ValueError as err:  # content the template rewrites holds a special token
            raise APIError(400, str(err), param="messages") from None
        return self._checked(self._encode(ids))

    def _prediction_ids(self, text: str) -> list[int]:
        self._check_text(text, param="prediction", tokens=self.context)
        try:
            ids = self.decoder.encode_prediction(text).tolist()
        except ValueError as err:
            raise APIError(400, str(err), param="prediction") from None
        if len(ids) > self.context:
            raise APIError(400, f"the prediction's {len(ids)} tokens exceed the model's "
                                f"context of {self.context}", param="prediction", code=TOO_LONG)
        return ids

    def _encode(self, prompt) -> list[int]:
        try:
            return self.decoder.encode(prompt, chat=False).tolist()
        except PromptTooLongError as err:  # as any prompt over the limit is answered
            raise self._too_long(err.tokens) from None
        except ValueError as err:  # empty, ids outside the vocabulary
            raise APIError(400, str(err), param="prompt") from None

    def _check_text(self, text: str, param: str = "prompt", tokens: int | None = None) -> None:
        """Refuse, before tokenising, text that is not valid Unicode or has more bytes than
        `tokens` tokens could hold (default the prompt limit; a prediction's is the context)."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as err:  # a lone surrogate: no tokenizer takes it
            raise APIError(400, f"the {param} is not valid Unicode: {err.reason} at character "
                                f"{err.start}", param=param) from None
        if tokens is None:
            tokens, limit = self.max_prompt_tokens, "this server's prompt limit; "
        else:
            limit = ""
        if self.max_token_bytes and size > tokens * self.max_token_bytes:
            raise APIError(400, f"the {param}'s {size} bytes of text cannot fit in {tokens} "
                                f"tokens ({limit}the model's context is {self.context})",
                           param=param, code=TOO_LONG)

    def _checked(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_prompt_tokens:
            raise self._too_long(len(ids))
        return ids

    def _too_long(self, tokens: int) -> APIError:
        return APIError(400, f"the prompt has {tokens} tokens; this server takes at most "
                             f"{self.max_prompt_tokens} (the model's context is {self.context})",
                        param="prompt", code=TOO_LONG)


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token can stand for (0 without a tokenizer), from the
    vocabulary's spellings: exact for byte-level BPE, whose alphabet spells each byte as one
    character (SmolLM2: 81, a newline and 80 spaces), else an upper bound (a spelling is at least
    as long in UTF-8 as the text it covers: "▁the", "<0x0A>")."""
    if tokenizer is None:
        return 0
    vocab, added = tokenizer.get_vocab(), set(tokenizer.get_added_vocab())
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if not isinstance(decoder, decoders.ByteLevel):
        return max(len(token.encode("utf-8", "replace")) for token in vocab)
    return max(len(token.encode("utf-8", "replace")) if token in added else len(token)
               for token in vocab)
