"""OpenAI's wire format: request bodies (validated by pydantic), response objects, errors.

Only what verispec can honour is accepted: one choice (n=1), no log-probabilities, no
penalties, no logit bias, no tools. Fields that would change the output but verispec does not
implement (NEUTRAL: OpenAI's and vLLM's) are refused with a 400 when set to anything but their
neutral value; other fields (user, metadata, store, service_tier, ...) are ignored. Every
string must be valid Unicode (a lone surrogate, JSON's "\\ud800", is a 400). Extensions: `top_k`,
`min_p`, `ignore_eos` in requests, and `verispec` (the request's GenerationStats) in responses
and in the last stream chunk.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from verispec.params import MAX_SEED, MIN_TEMPERATURE, SamplingParams
from verispec.text import unicode_only

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 256  # OpenAI's is "up to the context"; a bounded default serves better

# Fields (OpenAI's, a few of vLLM's) verispec does not implement -> the values that mean "off".
NEUTRAL = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
    "response_format": (None, {"type": "text"}), "functions": (None, []),
    "function_call": (None, "none", "auto"), "tool_choice": (None, "none", "auto"),
    "modalities": (None, ["text"]), "audio": (None,), "repetition_penalty": (None, 1),
    "min_tokens": (None, 0), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,),
}


Text = Annotated[str, AfterValidator(unicode_only)]


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the output as it is expected to be, mostly."""

    type: Literal["content"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


class SamplingFields(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, strict=True,  # strict: no true, no "1"
                                      allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, strict=True, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=0)  # extension; 0 = off
    min_p: float | None = Field(None, ge=0, lt=1, strict=True,  # extension; 0 = off
                                allow_inf_nan=False)
    ignore_eos: StrictBool = False  # extension
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    verify: Literal["block", "token", "invariant"] | None = None  # extension: SamplingParams'
    prediction: Prediction | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    response_format: Any = None
    functions: Any = None
    function_call: Any = None
    tool_choice: Any = None
    modalities: Any = None
    audio: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int
                        ) -> SamplingParams:
        """The request as SamplingParams; unsupported settings raise APIError (400)."""
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported: verispec returns one choice per "
                                "request (n=1)", param="n")
        for name, neutral in NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise APIError(400, f"`{name}` is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")
        if self.temperature is not None and 0 < self.temperature < MIN_TEMPERATURE:
            raise APIError(400, f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                                f"got {self.temperature}", param="temperature")
        try:
            return SamplingParams(
                max_new_tokens=max_tokens or default_max_tokens,
                temperature=DEFAULT_TEMPERATURE if self.temperature is None else
                self.temperature,
                top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                min_p=self.min_p or 0.0, seed=self.seed, ignore_eos=self.ignore_eos,
                stop=self.stop or (), verify=self.verify or "block")
        except ValueError as err:  # SamplingParams names the field first ("verify='...")
            field = re.match(r"\w*", str(err)).group()
            param = "max_tokens" if field == "max_new_tokens" else field
            raise APIError(400, str(err), param=param if param in type(self).model_fields
                           else None) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Text | list[StrictInt]  # text (no chat template) or token ids

    @field_validator("prompt", mode="before")
    @classmethod
    def one_prompt(cls, value):
        """A list of one text is that text (clients that always send a list); several prompts
        in one request (texts, or lists of ids) said "should be a valid string ... a valid
        integer": named for what they are."""
        if not isinstance(value, list) or not value:
            return value
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if all(isinstance(item, str | list) for item in value):
            raise ValueError("one prompt a request: a text or a list of token ids (lists of "
                             "texts or of token lists are not supported)")
        return value

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, COMPLETION_MAX_TOKENS)

    @property
    def explicit_max_tokens(self) -> bool:
        return self.max_tokens is not None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    @model_validator(mode="after")
    def _user_speaks(self) -> ChatMessage:
        # as OpenAI: a user or system message has content (an assistant's may be absent)
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_dict(self) -> dict[str, str]:
        """The message as a chat template expects it: text parts joined."""
        content = self.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # the newer max_tokens

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_completion_tokens or self.max_tokens,
                                    CHAT_MAX_TOKENS)

    @property
    def explicit_max_tokens(self) -> bool:
        return (self.max_completion_tokens or self.max_tokens) is not None


@dataclass(frozen=True, slots=True)
class Reply:
    """Builds one request's response objects in the shape of its endpoint."""

    chat: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def full(self, output, prompt_tokens: int) -> dict:
        """The whole response; output: a verispec GenerationOutput."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                      "logprobs": None, "finish_reason": output.finish_reason}
        else:
            choice = {"index": 0, "text": output.text, "logprobs": None,
                      "finish_reason": output.finish_reason}
        return {**self._head(stream=False), "choices": [choice],
                "usage": usage(prompt_tokens, output), "verispec": output.stats.to_dict()}

    def chunk(self, text: str, role: bool = False, output=None) -> dict:
        """A stream chunk with new text; role: the chat stream's opening chunk; output: the last
        chunk (finish_reason and stats, no text)."""
        finish_reason = output.finish_reason if output is not None else None
        if self.chat:
            if role:
                delta = {"role": "assistant", "content": text}
            else:
                delta = {} if output is not None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head(stream=True), "choices": [choice]}
        if output is not None:
            chunk["verispec"] = output.stats.to_dict()
        return chunk

    def usage_chunk(self, output, prompt_tokens: int) -> dict:
        """The chunk `stream_options.include_usage` asks for: no choices, the usage."""
        return {**self._head(stream=True), "choices": [],
                "usage": usage(prompt_tokens, output)}

    @property
    def response_id(self) -> str:
        """The id every response object of the request carries: chatcmpl-... or cmpl-..."""
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}"

    def _head(self, stream: bool) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.response_id, "object": kind, "created": self.created,
                "model": self.model}


def usage(prompt_tokens: int, output) -> dict:
    """OpenAI's usage object: prompt_tokens_details.cached_tokens, the prompt's tokens an
    earlier request's cache held (not computed again); with a prediction,
    completion_tokens_details says how many of its tokens the output copied and how many it
    did not (OpenAI's own counts)."""
    completion_tokens = len(output.token_ids)
    stats = output.stats
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
            "completion_tokens_details": {
                "accepted_prediction_tokens": stats.accepted_prediction_tokens,
                "rejected_prediction_tokens": stats.rejected_prediction_tokens}}


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
