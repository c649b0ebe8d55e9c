"""OpenAI-compatible request and response bodies for ``/v1/chat/completions`` and ``/v1/completions``.

Requests are validated strictly (no "5" for 5, no true for 1, no NaN or infinities, no subnormal
floats, integers within 64 bits); unknown fields are ignored, except the ones that would silently
change the answer (``n`` > 1, logprobs, penalties, tools, ``logit_bias``, ``response_format``, and
the vLLM sampling extensions redknot does not implement), which are refused naming the field.
redknot extensions in the body: ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``documents``
(strings reused as position-independent chunks), ``method`` (one of ``redknot.engine.METHODS``) and
``cache_salt`` (vLLM's name: requests with different salts never share cached content).
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator


_INT64 = (-(2 ** 63), 2 ** 63 - 1)

# Fields of the OpenAI and vLLM request bodies that redknot does not implement, each with the values
# that mean "off" (sent by many clients as defaults). Any other value is refused, naming the field:
# ignoring it would silently change the answer.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None, 0),
    "repetition_penalty": (None, 1, 1.0),
    "length_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "bad_words": (None, []),
    "allowed_token_ids": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
}


def _check_number(v: Any, where: str) -> None:
    if isinstance(v, bool):
        return
    if isinstance(v, float) and v != 0 and abs(v) < sys.float_info.min:
        raise ValueError(f"{where}: subnormal number {v!r} is not accepted")
    if isinstance(v, int) and not _INT64[0] <= v <= _INT64[1]:
        raise ValueError(f"{where}: integer out of the 64-bit range")


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _sane_numbers(cls, data):
        """Subnormal floats and integers beyond 64 bits reach no sampler (they overflow there)."""
        if isinstance(data, dict):
            for k, v in data.items():
                if isinstance(v, (int, float)):
                    _check_number(v, k)
                elif isinstance(v, list) and any(type(x) is int and not _INT64[0] <= x <= _INT64[1] for x in v):
                    raise ValueError(f"{k}: integer out of the 64-bit range")
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str
    max_tokens: int | None = None  # None: whatever the context has left
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension; 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (as in vLLM)
    documents: list[str] | None = None  # extension: reusable document chunks
    method: str | None = None  # extension: dense, headsparse, full_reuse, redknot, ...
    stop_token_ids: list[int] | None = None  # extension (as in vLLM): token ids that end the output
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # extension (as in vLLM)
    # Accepted only at their no-op values: refusing beats silently ignoring them.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, off in UNSUPPORTED_FIELDS.items():
                if name in data and not any(data[name] == o and type(data[name]) is type(o) for o in off):
                    hint = "omit it" if off[-1] is None else f"omit it or send {off[-1]!r}"
                    raise ValueError(f"{name}: not supported by this server ({hint})")
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("presence and frequency penalties are not supported (use 0)")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    tools: list | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools are not supported")
        return v

    @model_validator(mode="after")
    def _one_max_tokens(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v


# ---- responses -------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _only_set_fields(self, delta: DeltaMessage) -> dict:  # role only in the first chunk, as OpenAI does
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # None only on streamed chunks


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "redknot"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
