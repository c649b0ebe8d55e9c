"""OpenAI-compatible request and response bodies for ``/v1/chat/completions`` and ``/v1/completions``.

Requests are validated strictly (no "5" for 5, no true for 1, no NaN or infinities, no subnormal
floats, integers within 64 bits); unknown fields are ignored, except the ones that would silently
change the answer (penalties, ``logit_bias``, beam search and the other vLLM sampling extensions
redknot does not implement), which are refused naming the field. Implemented beyond the basics:
``n``, logprobs, ``echo``, structured output (``response_format``, vLLM's ``structured_outputs``
and ``guided_*``), tools, and the chat-template options. redknot extensions in the body:
``top_k``, ``ignore_eos``, ``stop_token_ids``, ``documents`` (strings or ``{"title", "text"}``
objects reused as position-independent chunks), ``method`` (one of ``redknot.engine.METHODS``)
and ``cache_salt`` (vLLM's name: requests with different salts never share cached content).
docs/serving.md lists every field and whether it is honoured.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_serializer, model_validator


_INT64 = (-(2 ** 63), 2 ** 63 - 1)

# Fields of the OpenAI and vLLM request bodies that redknot does not implement, each with the values
# that mean "off" (sent by many clients as defaults). Any other value is refused, naming the field:
# ignoring it would silently change the answer.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "prompt_logprobs": (None, 0),
    "repetition_penalty": (None, 1, 1.0),
    "length_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "bad_words": (None, []),
    "allowed_token_ids": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "prediction": (None,),
    "mm_processor_kwargs": (None, {}),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "add_special_tokens": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
}


# Fields of the OpenAI and vLLM request bodies that never change the answer, so they are accepted
# and ignored (docs/serving.md lists them beside the honoured and the refused ones).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                  "request_id", "priority")


def _check_number(v: Any, where: str) -> None:
    if isinstance(v, bool):
        return
    if isinstance(v, float) and v != 0 and abs(v) < sys.float_info.min:
        raise ValueError(f"{where}: subnormal number {v!r} is not accepted")
    if isinstance(v, int) and not _INT64[0] <= v <= _INT64[1]:
        raise ValueError(f"{where}: integer out of the 64-bit range")


def _check_text(data: Any, where: str) -> None:
    """Every string (dict keys included) encodes as UTF-8: JSON's escapes can spell lone surrogates
    ("\\ud800"), which no tokenizer, byte limit or response body can take. A loop, not recursion:
    nesting as deep as the JSON parser allows must not exhaust the stack here."""
    stack = [(data, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{at or 'body'}: text with a lone surrogate (\\u{ord(v[e.start]):04x}) is not "
                                 f"valid Unicode") from None
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(x, (str, dict, list, tuple)):
                    stack.append((x, f"{at}.{k}" if at else str(k)))
                stack.append((k, at or "body"))  # popped first: a bad key is named by where it is
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v) if isinstance(x, (str, dict, list, tuple)))


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _sane_numbers(cls, data):
        """Subnormal floats and integers beyond 64 bits reach no sampler (they overflow there)."""
        _check_text(data, "")
        if isinstance(data, dict):
            for k, v in data.items():
                if isinstance(v, (int, float)):
                    _check_number(v, k)
                elif isinstance(v, list) and any(type(x) is int and not _INT64[0] <= x <= _INT64[1] for x in v):
                    raise ValueError(f"{k}: integer out of the 64-bit range")
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class Document(_Request):
    """A document with a title: served as its title, a newline, then its text."""
    title: str | None = None
    text: str

    def render(self) -> str:
        return f"{self.title}\n{self.text}" if self.title else self.text


class JSONSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` body field (exactly one constraint)."""
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Most choices one request may ask for (n); each is its own sequence in the engine.
MAX_N = 16


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
    documents: list[str | Document] | None = None  # extension: reusable document chunks
    method: str | None = None  # extension: dense, headsparse, full_reuse, redknot, ...
    stop_token_ids: list[int] | None = None  # extension (as in vLLM): token ids that end the output
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # extension (as in vLLM)
    # vLLM's prefill/decode handoff (serve/pd.py): {"do_remote_decode": true} on a prefill leg, a
    # prefill response's kv_transfer_params on the decode leg
    kv_transfer_params: dict | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1)  # only as many as n: choices are not ranked
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted only at their no-op values: refusing beats silently ignoring them
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            kv = data.get("kv_transfer_params")
            prefill_leg = isinstance(kv, dict) and kv.get("do_remote_decode") is True
            for name, off in UNSUPPORTED_FIELDS.items():
                if name == "min_tokens" and prefill_leg:
                    continue  # a PD router's prefill leg sends min_tokens 1: its one token is never the answer
                if name in data and not any(data[name] == o and type(data[name]) is type(o) for o in off):
                    hint = "omit it" if off[-1] is None else f"omit it or send {off[-1]!r}"
                    raise ValueError(f"{name}: not supported by this server ({hint})")
        return data

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

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of equal to n is supported (got best_of={self.best_of}, "
                             f"n={self.n}); omit it")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self.constraint_fields()
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one structured-output constraint per request "
                             f"(also got {given[0]})")
        return self

    def constraint_fields(self) -> list[str]:
        """The structured-output fields this request sets (at most one is accepted)."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                given.append(name)
        return given

    def structured(self):
        """(field name, StructuredOutputs) of the request's constraint, or None; raises ValueError
        naming the field when it is malformed."""
        from ..engine.structured import StructuredOutputs

        given = self.constraint_fields()
        if not given:
            return None
        name = given[0]
        try:
            if name == "response_format":
                rf = self.response_format
                if rf.type == "json_object":
                    return name, StructuredOutputs(json_object=True)
                schema = rf.json_schema.schema_
                return name, (StructuredOutputs(json=schema) if schema is not None
                              else StructuredOutputs(json_object=True))
            if name == "structured_outputs":
                so = self.structured_outputs
                return name, StructuredOutputs(json=so.json_, regex=so.regex, grammar=so.grammar,
                                               choice=None if so.choice is None else tuple(so.choice),
                                               json_object=bool(so.json_object))
            value = getattr(self, name)
            kind = name.removeprefix("guided_")
            if kind == "choice":
                value = tuple(value)
            return name, StructuredOutputs(**{kind: value})
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def document_texts(self) -> list[str] | None:
        if self.documents is None:
            return None
        return [d if isinstance(d, str) else d.render() for d in self.documents]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # chat-template options (vLLM's)
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    @model_validator(mode="after")
    def _one_max_tokens(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (send "
                             "add_generation_prompt: false)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools")
        if self.uses_tools and self.constraint_fields():
            raise ValueError(f"{self.constraint_fields()[0]}: cannot be combined with a tool_choice that "
                             f"forces a call")
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether a tool call is forced (required or named): guided decoding makes it valid."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix: not supported by this server (fill-in-the-middle); omit it")
        return v

    def prompts(self) -> list:
        """The request's prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or not p:
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TokenizeRequest(_Request):
    """vLLM's /tokenize body: a prompt, or messages rendered with the chat template."""
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must contain at least one message")
        return self


class DetokenizeRequest(_Request):
    model: str
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses -------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class KVTransferUsage(BaseModel):
    """What a disaggregated request's KV handoff moved into this (decode) instance."""
    bytes: int
    bytes_by_head_class: dict[str, int]
    transport: str
    seconds: float
    pages: int


def _without_none(names):
    """A serializer that leaves ``names`` out while they are None (vLLM-compatible bodies stay as they were)."""
    def serialize(self, handler):
        out = handler(self)
        for n in names:
            if out.get(n, 0) is None:
                del out[n]
        return out
    return model_serializer(mode="wrap")(serialize)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kv_transfer: KVTransferUsage | None = None  # a decode leg's handoff (prefill/decode disaggregation)

    _drop = _without_none(("kv_transfer",))

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] = []


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict | None = None  # a prefill leg's: where its KV is pulled

    _drop = _without_none(("kv_transfer_params",))


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
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


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # None only on streamed chunks
    kv_transfer_params: dict | None = None  # a prefill leg's: where its KV is pulled

    _drop = _without_none(("kv_transfer_params",))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "redknot"
    root: str | None = None  # vLLM's: the model the name serves
    parent: str | None = None
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
