"""The OpenAI-compatible HTTP server over ``AsyncLLMEngine``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming, ``n``
choices, logprobs, structured output; chat with tools), ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``
(vLLM's: the prompt's token ids, documents included, what KV-aware routers match), ``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus text format,
``metrics.py``). Each choice is one engine sequence (``choices.py``); tool calls: ``tools.py``.

Every request is validated and admitted before the response starts, so bad input is a 4xx with
an OpenAI error body (a request that can never fit: 400 with the numbers) and a full queue a 503,
even for streams. Before any of that, ``_Guard`` checks the API key of every ``/v1`` route and of
``/metrics`` (401) and the body size (413). Tokenisation runs in a small worker pool, never on the event loop. A
client that goes away closes the engine's generator, which aborts its request and frees its KV
pages; one that goes away while its request is still queued is never prefilled. An unexpected
failure answers a clean 500 (details in the log, under the id the body names) with
``Connection: close``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import AsyncIterator

import torch
from fastapi import FastAPI, Request
from pydantic import ValidationError
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncLLMEngine, EngineOverloaded, RequestFailed, StreamDelta
from ..engine.scheduler import RequestTooLarge
from ..engine.sampling import MAX_SEED, SamplingParams
from ..engine.structured import StructuredOutputs
from . import tools as tl
from .metrics import ServerMetrics
from .choices import ChatStream, Choice, TokenText, ToolMode, chat_choice, completion_choice, merge
from .protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionChoice,
                       CompletionRequest, CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorInfo,
                       ErrorResponse, KVTransferUsage, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, Usage, new_id, now)

log = logging.getLogger("redknot.serve")

_DISCONNECT_POLL_S = 0.2
# "messages[0].content": the field a model-level check names at the start of its message
_FIELD_PATH = re.compile(r"^[A-Za-z_]\w*(?:\[\d+\]|\.[^\s:]+)*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


class _ClientGone(Exception):
    """The client disconnected before the response started."""


def _printable(text: str | None) -> str | None:
    """``text`` with lone surrogates escaped, so a message quoting the client's input always encodes."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=_printable(message), type=type, param=_printable(param), code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"


class _SSEResponse(StreamingResponse):
    """Closes its body generator however the response ends (disconnect included), so the engine
    generator inside is closed right away rather than whenever it is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class ServerLimits:
    """What one request may carry. ``None`` fields take defaults from the model's context length
    (``resolve``): a body of 64 bytes per context token (at least 1 MiB), a document of 32 bytes
    per context token (at least 256 KiB); both are far above what a fitting request needs, and
    cut off a flood long before it costs memory or CPU."""
    max_body_bytes: int | None = None
    max_documents: int = 256
    max_document_bytes: int | None = None
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    tokenizer_workers: int = 2

    def resolve(self, max_model_len: int) -> "ServerLimits":
        return replace(self, max_body_bytes=self.max_body_bytes or max(1 << 20, 64 * max_model_len),
                       max_document_bytes=self.max_document_bytes or max(256 << 10, 32 * max_model_len))


def tenant_salt(key: str) -> str:
    """The cache namespace of one API key (a digest: the key itself never leaves the guard)."""
    import hashlib

    return "key:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def tenant_label(key: str | None) -> str:
    """The non-secret name of an API key's tenant in /metrics: a short digest prefix."""
    import hashlib

    return "open" if key is None else "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:8]


CACHE_ISOLATION = ("shared", "per-key", "per-salt")


def build_app(engine: AsyncLLMEngine, model_name: str, *, api_keys=(), limits: ServerLimits | None = None,
              share_cache_across_keys: bool = False, tool_call_parser: str = "hermes",
              chat_template: str | None = None, metrics_key: str | None = None, pd=None,
              cache_isolation: str | None = None) -> FastAPI:
    """The FastAPI app. ``api_keys``: keys accepted on every ``/v1`` route (none: open).
    ``/metrics`` takes ``metrics_key`` when given, else any of ``api_keys`` (open with neither).
    ``tool_call_parser``: how ``tool_choice: auto`` outputs become tool calls (``tools.PARSERS``).
    ``chat_template``: a Jinja template (or a file holding one) replacing the tokenizer's.
    With several keys, each key's requests get their own cache namespace unless
    ``share_cache_across_keys``; that needs an engine that namespaces its caches by
    ``Sequence.cache_salt`` (``Engine.honours_cache_salt``), so without one it is refused here.
    ``pd``: ``serve.pd.PDOptions`` (prefill/decode disaggregation: the role, the KV transport).
    ``cache_isolation`` (``CACHE_ISOLATION``): ``shared`` (one namespace; ``share_cache_across_keys``
    says the same), ``per-key`` (the default: each API key its own namespace), ``per-salt`` (each key
    its own, and every request must name a ``cache_salt``: a client shares cached content only
    with requests naming the same salt under the same key). With several API keys and no
    ``metrics_key``, /metrics shows each key its own tenant's series and no other's sizes."""
    llm = engine.llm
    api_keys = tuple(k for k in api_keys if k)
    limits = (limits or ServerLimits()).resolve(llm.max_model_len)
    honours_salt = bool(getattr(llm.engine, "honours_cache_salt", False))
    isolation = cache_isolation or ("shared" if share_cache_across_keys else "per-key")
    if isolation not in CACHE_ISOLATION:
        raise ValueError(f"cache_isolation must be one of {', '.join(CACHE_ISOLATION)}, got {isolation!r}")
    if share_cache_across_keys and isolation != "shared":
        raise ValueError(f"share_cache_across_keys contradicts cache_isolation {isolation!r}")
    per_key_cache = len(api_keys) > 1 and isolation != "shared"
    if (per_key_cache or isolation == "per-salt") and not honours_salt:
        raise ValueError("this engine cannot give each API key its own cache namespace (it does not honour "
                         "cache_salt); pass share_cache_across_keys (--share-cache-across-keys) to let keys share it")
    if tool_call_parser not in tl.PARSERS:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r} (available: {', '.join(tl.PARSERS)})")
    if chat_template is not None:
        llm.tokenizer.chat_template = load_chat_template(chat_template)
    app = FastAPI(title="redknot", description="OpenAI-compatible redknot server", version=_version())
    pool = ThreadPoolExecutor(max_workers=max(1, limits.tokenizer_workers), thread_name_prefix="redknot-tokenize")
    app.state.engine, app.state.limits, app.state.tokenizer_pool = engine, limits, pool
    app.state.api_keys = api_keys  # the concurrency limit shares its slots fairly among them
    app.add_middleware(_Guard, api_keys=api_keys, max_body_bytes=limits.max_body_bytes,
                       metrics_keys=(metrics_key,) if metrics_key else api_keys)
    _add_error_handlers(app)
    srv = _Server(engine, model_name, limits, api_keys, per_key_cache, honours_salt, pool, tool_call_parser)
    srv.salt_required = isolation == "per-salt"
    srv.tenant_views = len(api_keys) > 1 and not metrics_key  # each key sees its own tenant on /metrics
    if pd is not None:
        from .pd import PDService

        srv.pd = PDService(engine, pd)
        srv.metrics.pd = srv.pd
    app.state.pd = srv.pd
    _add_routes(app, srv)
    _add_token_routes(app, srv)
    app.openapi = lambda: _openapi(app, bool(api_keys), bool(api_keys or metrics_key))
    return app


def load_chat_template(template: str) -> str:
    """A template given inline or as the path of a file holding it (vLLM's --chat-template)."""
    from pathlib import Path

    if "{" not in template and Path(template).is_file():
        return Path(template).read_text()
    if "{" not in template:
        raise ValueError(f"chat template {template!r} is neither a file nor a Jinja template")
    return template


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("redknot")
    except PackageNotFoundError:
        return "0.0.0"


def _add_token_routes(app: FastAPI, srv: "_Server") -> None:
    """vLLM's /tokenize, /detokenize and /version."""
    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        srv.check_model(req.model)
        tok = srv.llm.tokenizer
        if req.messages is not None:
            try:
                chat = ChatCompletionRequest(model=req.model, messages=req.messages, chat_template=req.chat_template,
                                             chat_template_kwargs=req.chat_template_kwargs,
                                             add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message)
            except ValidationError as e:
                msg = str(e.errors()[0].get("msg", "invalid request")).removeprefix("Value error, ")
                param = msg.split(":", 1)[0] if ": " in msg and msg.split(":", 1)[0].isidentifier() else None
                raise APIError(400, msg, param=param) from None
            ids, _ = await asyncio.get_running_loop().run_in_executor(srv.pool, _chat_prompt, srv.llm, chat)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(
                srv.pool, lambda: tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return TokenizeResponse(count=len(ids), max_model_len=srv.llm.max_model_len, tokens=list(ids))

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        srv.check_model(req.model)
        vocab = srv.llm.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary (vocab_size={vocab})",
                           param="tokens")
        return DetokenizeResponse(prompt=srv.llm.tokenizer.decode(req.tokens))

    @app.post("/v1/chat/completions/render", responses=_ERRORS)
    async def render_chat(req: ChatCompletionRequest, request: Request) -> dict:
        return _rendered(req, (await srv.tokenize(request, req))[0], srv.model_name)

    @app.post("/v1/completions/render", responses=_ERRORS)
    async def render_completion(req: CompletionRequest, request: Request) -> list:
        seqs = await srv.tokenize(request, req.model_copy(update={"n": 1}), req.prompts(),
                                  req.document_texts() or None)
        return [_rendered(req, s, srv.model_name) for s in seqs]

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}


def _rendered(req, seq, model_name: str) -> dict:
    """vLLM's render answer for one prompt: the token ids the engine would run (chat template and
    documents applied), nothing generated. Routers (vllm-router's ``cache_aware``/``kv_aware``)
    match these ids against what each replica holds."""
    p = seq.params
    return {"request_id": new_id("render"), "model": model_name, "stream": bool(getattr(req, "stream", False)),
            "token_ids": list(seq.token_ids),
            "sampling_params": {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                                "seed": p.seed}}


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers in the OpenAI error shape; a client that hung up gets 499."""
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        err = e.errors()[0]
        # drop "body" and the union-branch tags pydantic puts in locations ("str", "list[int]")
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and str(x) not in _TYPE_TAGS and "[" not in str(x)]
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return _error(400, f"malformed JSON body: {detail}".rstrip(": "))
        msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        param = ".".join(loc) or None
        if param is None and ": " in msg and _FIELD_PATH.match(msg.split(": ", 1)[0]):  # "field: why" from a model check
            param = msg.split(": ", 1)[0]
            return _error(400, msg, param=param)
        return _error(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(_ClientGone)
    async def _client_gone(_, e):
        return Response(status_code=499)


class _Server:
    """What the routes share: the request checks, tokenising in the pool, submitting to the engine."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, limits: ServerLimits, api_keys: tuple,
                 per_key_cache: bool, honours_salt: bool, pool: ThreadPoolExecutor, tool_parser: str = "hermes"):
        self.engine, self.llm, self.model_name, self.limits = engine, engine.llm, model_name, limits
        self.api_keys, self.per_key_cache, self.honours_salt, self.pool = api_keys, per_key_cache, honours_salt, pool
        self.tool_parser = tool_parser
        self.token_text = TokenText(self.llm.tokenizer, lambda: self.llm.grammars.info.decoded_vocab)
        self.errors = 0  # requests that failed inside the server (5xx)
        self.metrics = ServerMetrics(engine, model_name, lambda: self.errors)
        engine.observer = self.metrics
        self.pd = None  # serve.pd.PDService: this instance's side of prefill/decode disaggregation
        self.salt_required = False  # cache isolation per-salt: a request without cache_salt is refused
        self.tenant_views = False  # /metrics answers a key with its own tenant's series only

    async def handoff(self, req, seqs) -> None:
        """A PD router's leg: mark the prefill leg's sequence for export, or pull the decode leg's KV."""
        if self.pd is None:
            if req.kv_transfer_params and (req.kv_transfer_params.get("do_remote_decode")
                                           or req.kv_transfer_params.get("do_remote_prefill")):
                raise APIError(400, "kv_transfer_params: this server runs without prefill/decode disaggregation",
                               param="kv_transfer_params")
            return
        from .pd import PDError

        try:
            await self.pd.prepare(req, seqs)
        except PDError as e:
            raise APIError(e.status, e.message, "server_overloaded" if e.status == 503 else "invalid_request_error",
                           e.param, e.code) from None

    def kv_transfer_params(self, seqs) -> dict | None:
        return None if self.pd is None else self.pd.response_params(seqs)
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist (serving `{self.model_name}`).",
                           param="model", code="model_not_found")

    def check_limits(self, req) -> None:
        """The per-request caps, checked before anything is tokenised."""
        docs = req.document_texts() or []
        if len(docs) > self.limits.max_documents:
            raise APIError(400, f"documents: {len(docs)} documents, this server takes at most {self.limits.max_documents} "
                                f"per request", param="documents")
        for i, d in enumerate(docs):
            if len(d) > self.limits.max_document_bytes or len(d.encode("utf-8")) > self.limits.max_document_bytes:
                raise APIError(400, f"documents[{i}]: {len(d.encode('utf-8'))} bytes, this server takes at most "
                                    f"{self.limits.max_document_bytes} per document", param="documents")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > self.limits.max_stop_strings:
            raise APIError(400, f"stop: {len(stop)} stop strings, this server takes at most {self.limits.max_stop_strings}",
                           param="stop")
        if any(len(x) > self.limits.max_stop_string_chars for x in stop):
            raise APIError(400, f"stop: a stop string is longer than {self.limits.max_stop_string_chars} characters",
                           param="stop")
        if req.stop_token_ids is not None and len(req.stop_token_ids) > self.limits.max_stop_strings:
            raise APIError(400, f"stop_token_ids: {len(req.stop_token_ids)} ids, this server takes at most "
                                f"{self.limits.max_stop_strings}", param="stop_token_ids")

    def tenant(self, request: Request) -> str:
        """The /metrics tenant label of the key a request came with ("open" without keys)."""
        index = request.scope.get("state", {}).get("api_key_index")
        return tenant_label(self.api_keys[index] if index is not None and self.api_keys else None)

    def cache_salt(self, req, request: Request) -> str | None:
        if self.salt_required and req.cache_salt is None:
            raise APIError(400, "cache_salt: required by this server (--cache-isolation per-salt): name the cache "
                                "namespace this request may share", param="cache_salt")
        parts = []
        if self.per_key_cache:
            parts.append(tenant_salt(self.api_keys[request.scope["state"]["api_key_index"]]))
        if req.cache_salt is not None:
            if not self.honours_salt:
                raise APIError(400, "cache_salt: not supported by this server (its caches have no namespaces yet)",
                               param="cache_salt")
            parts.append("salt:" + req.cache_salt)
        return "\x1f".join(parts) or None

    def sampling_params(self, req, max_tokens: int, seed: int | None, logprobs: int | None,
                        structured) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, seed=seed, stop=req.stop, ignore_eos=req.ignore_eos,
                                  stop_token_ids=list(req.stop_token_ids or []), logprobs=logprobs,
                                  structured_outputs=structured)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def structured(self, req):
        """The request's output constraint (a forced tool call's, or its structured-output field's),
        compiled here so a bad schema answers 400 naming its field."""
        if isinstance(req, ChatCompletionRequest) and req.uses_tools:
            field = "tools"
            so = StructuredOutputs(json=tl.forced_schema(req.tools, req.tool_choice, req.parallel_tool_calls))
        else:
            try:
                got = req.structured()
            except ValueError as e:
                name = str(e).split(":", 1)[0]
                raise APIError(400, str(e), param=name) from None
            if got is None:
                return None
            field, so = got
        try:
            self.llm.grammars.compile(so)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None
        return so

    def build_sequences(self, req, prompts, documents, salt) -> list:
        """Tokenise and check a request (in the tokenizer pool): one engine Sequence per prompt and
        choice (choice i of a seeded request samples with seed + i)."""
        chat = isinstance(req, ChatCompletionRequest)
        param = "messages" if chat else "prompt"
        structured = self.structured(req)
        if chat:
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            prompts, documents = _chat_prompt(self.llm, req)
            prompts = [prompts]
        else:
            logprobs = req.logprobs
        seqs = []
        for prompt in prompts:
            if not chat and documents is None and isinstance(prompt, str):  # raw completion: no chat template
                try:
                    prompt = self.llm.prompt_ids(prompt)
                except (ValueError, TypeError) as e:
                    raise APIError(400, str(e), param=param) from None
            for i in range(req.n):
                # choice 0 keeps the client's seed (validated as given); the others wrap past the top
                seed = None if req.seed is None else req.seed if i == 0 else (req.seed + i) % (MAX_SEED + 1)
                params = self.sampling_params(req, 1 if req.max_tokens is None else req.max_tokens, seed, logprobs,
                                              structured)
                seqs.append(self._sequence(req, prompt, documents, params, salt, param))
        return seqs

    def _sequence(self, req, prompt, documents, params, salt, param):
        method = req.method
        if method == "auto":  # the best reuse method this model runs, whatever the server's default
            method = self.llm.auto_method
        try:
            seq = self.llm.make_sequence(prompt, params, documents, method, cache_salt=salt)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="method" if "method" in str(e) else param) from None
        if req.max_tokens is None:  # what the context and the pool leave it, as vLLM does
            most = self.llm.max_new_tokens(seq)  # the arithmetic that admits it: never a 400 for its default
            if most < 1:
                raise APIError(400, f"prompt has {seq.num_prompt} tokens: a {seq.method} request of it does not fit "
                                    f"with room for one generated token (KV pages and context: at most "
                                    f"{self.llm.context_limits(seq.method)[1]} prompt tokens)", param=param)
            seq.params = replace(params, max_tokens=most)
        return seq

    async def tokenize(self, request: Request, req, prompts=None, documents=None) -> list:
        self.check_model(req.model)
        self.check_limits(req)
        salt = self.cache_salt(req, request)
        loop = asyncio.get_running_loop()
        seqs = await loop.run_in_executor(self.pool, self.build_sequences, req, prompts, documents, salt)
        tenant = self.tenant(request)
        for seq in seqs:
            self.metrics.tenant_of(seq, tenant)
        return seqs

    def failed(self, e: RequestFailed) -> APIError:
        cause = e.__cause__
        if isinstance(cause, RequestTooLarge):  # found at admission: it can never run
            return APIError(400, str(cause))
        if isinstance(cause, torch.OutOfMemoryError):  # the request's pages are freed; retrying later can succeed
            return APIError(503, "out of accelerator memory for this request's prefill; retry later or send a "
                                 "shorter prompt", type="server_overloaded", code="out_of_memory")
        eid = _log_failure("request failed in the engine", cause or e)
        return APIError(500, f"the request failed inside the engine (error id {eid})", type="server_error")

    async def start(self, request: Request, seqs, n: int = 1) -> tuple[list, list]:
        """Submit every choice's sequence and wait for each one's first delta: input errors surface
        here as 4xx/503. With ``n`` > 1 the first choice of each prompt runs first: once it has its
        first token, its prompt's KV is in the prefix cache (documents in the chunk cache), so the
        other choices map those pages instead of computing them again. Returns (streams, engine
        generators): each stream yields its deltas."""
        gens = [None] * len(seqs)
        firsts = [None] * len(seqs)
        waves = [list(range(0, len(seqs), n))] + ([[i for i in range(len(seqs)) if i % n]] if n > 1 else [])
        try:
            for wave in waves:
                for i in wave:
                    gens[i] = self.engine.generate(sequence=seqs[i])
                got = await _unless_disconnected(
                    request, asyncio.gather(*(gens[i].__anext__() for i in wave), return_exceptions=True))
                for i, f in zip(wave, got):
                    firsts[i] = f
                err = next((f for f in got if isinstance(f, BaseException)), None)
                if err is not None:
                    break
        except _ClientGone:
            await _close([g for g in gens if g is not None])
            raise
        if err is not None:
            await _close([g for g in gens if g is not None])
            self.errors += not isinstance(err, (ValueError, TypeError, EngineOverloaded))
            try:
                raise err
            except RequestFailed as e:
                raise self.failed(e) from None
            except (ValueError, TypeError) as e:  # raised before queueing: RequestTooLarge and bad input
                raise APIError(400, str(e)) from None
            except EngineOverloaded as e:
                raise APIError(503, str(e), type="server_overloaded", code="engine_overloaded") from None
            except StopAsyncIteration:
                raise APIError(500, "the engine returned no output", type="server_error") from None
        return [_chain(f, g) for f, g in zip(firsts, gens)], gens

    async def collect(self, request: Request, streams, gens) -> list[Choice]:
        """Every choice to its end (non-streamed responses)."""
        async def drain(i, stream):
            c = Choice(i)
            async for d in stream:
                c.add(d)
            return c
        try:
            return await _unless_disconnected(request, asyncio.gather(*(drain(i, s) for i, s in enumerate(streams))))
        except RequestFailed as e:
            self.errors += 1
            raise self.failed(e) from None
        finally:
            await _close(streams + gens)

    def usage(self, choices, n: int, seqs=()) -> Usage:
        """Usage of a request: each prompt counted once (choice p*n is prompt p's first); a decode
        leg's KV handoff as ``kv_transfer``."""
        firsts = choices[::n]
        usage = Usage.of(sum(c.prompt_tokens for c in firsts), sum(c.completion_tokens for c in choices),
                         sum(c.cached_tokens for c in firsts))
        moved = [s.kv_transfer for s in seqs if s.kv_transfer is not None]
        if moved:
            usage.kv_transfer = KVTransferUsage(**moved[0])
        return usage

    def tool_mode(self, req: ChatCompletionRequest) -> ToolMode:
        if not req.tools or req.tool_choice == "none":
            return ToolMode()
        if req.uses_tools:
            return ToolMode(choice=req.tool_choice)
        return ToolMode(parser=self.tool_parser, names=frozenset(t.function.name for t in req.tools))

    def card(self) -> ModelCard:
        """The model card; ``max_model_len`` is the most a request of the default method can hold."""
        return ModelCard(id=self.model_name, root=self.model_name, max_model_len=self.llm.max_context())


def _add_routes(app: FastAPI, srv: _Server) -> None:
    """/health, /v1/models, /v1/chat/completions, /v1/completions and /metrics (the token routes: _add_token_routes)."""
    @app.get("/health")
    async def health():
        thread = getattr(srv.engine, "_thread", None)
        if thread is not None and not thread.is_alive():
            return _error(503, "the engine worker has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models", responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[srv.card()])

    @app.get("/v1/models/{model:path}", responses=_ERRORS)
    async def model(model: str) -> ModelCard:
        srv.check_model(model)
        return srv.card()

    @app.post("/v1/chat/completions", responses=_responses(ChatCompletionResponse))
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        seqs = await srv.tokenize(request, req)
        await srv.handoff(req, seqs)
        streams, gens = await srv.start(request, seqs, req.n)
        rid, created, mode = new_id("chatcmpl"), now(), srv.tool_mode(req)
        # echo: the last message's content leads the answer when it is the assistant's (vLLM)
        echo = req.messages[-1].text if req.echo and req.messages[-1].role == "assistant" else ""
        if req.stream:
            def chunk(choices, usage_=None):
                return _sse(ChatCompletionChunk(id=rid, created=created, model=srv.model_name, choices=choices,
                                                usage=usage_))

            async def body():
                states = [ChatStream(i, mode, srv.token_text, req.logprobs) for i in range(len(seqs))]
                try:
                    for st in states:
                        for ch in st.first(echo):
                            yield chunk([ch])
                    async for i, d in merge(streams):
                        for ch in states[i].feed(d):
                            yield chunk([ch])
                    if req.include_usage:
                        yield chunk([], srv.usage([st.choice for st in states], req.n, seqs))
                except Exception as e:  # the stream has started: report in-band
                    srv.errors += 1
                    yield _stream_error("chat stream failed", e)
                finally:
                    await _close(streams + gens)
                yield "data: [DONE]\n\n"
            return _SSEResponse(body(), media_type="text/event-stream")
        choices = await srv.collect(request, streams, gens)
        return ChatCompletionResponse(id=rid, created=created, model=srv.model_name,
                                      usage=srv.usage(choices, req.n, seqs), kv_transfer_params=srv.kv_transfer_params(seqs),
                                      choices=[chat_choice(c, mode, srv.token_text, req.logprobs, echo)
                                               for c in choices])

    @app.post("/v1/completions", responses=_responses(CompletionResponse))
    async def completions(req: CompletionRequest, request: Request):
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo: with logprobs it needs the prompt's logprobs, which this server does not "
                                "compute; drop one of them", param="echo")
        prompts = req.prompts()
        # no documents and an empty list are the same request (a raw prompt, no chat template)
        seqs = await srv.tokenize(request, req, prompts, req.document_texts() or None)
        await srv.handoff(req, seqs)
        streams, gens = await srv.start(request, seqs, req.n)
        rid, created = new_id("cmpl"), now()
        tok = srv.llm.tokenizer
        echoes = [(p if isinstance(p, str) else tok.decode(p)) if req.echo else "" for p in prompts for _ in range(req.n)]
        want_lp = req.logprobs is not None
        if req.stream:
            def chunk(choices, usage_=None):
                return _sse(CompletionResponse(id=rid, created=created, model=srv.model_name, choices=choices,
                                               usage=usage_))

            async def body():
                states = [Choice(i) for i in range(len(seqs))]
                offsets = [len(e) for e in echoes]
                try:
                    for i, e in enumerate(echoes):
                        if e:
                            yield chunk([CompletionChoice(index=i, text=e)])
                    async for i, d in merge(streams):
                        states[i].add(d)
                        lp = srv.token_text.completion(d.logprobs or [], d.token_ids, offsets[i]) if want_lp else None
                        offsets[i] += sum(len(x) for x in lp.tokens) if lp else 0
                        if d.text or d.finish_reason or lp:
                            yield chunk([CompletionChoice(index=i, text=d.text, logprobs=lp,
                                                          finish_reason=d.finish_reason)])
                    if req.include_usage:
                        yield chunk([], srv.usage(states, req.n, seqs))
                except Exception as e:
                    srv.errors += 1
                    yield _stream_error("completion stream failed", e)
                finally:
                    await _close(streams + gens)
                yield "data: [DONE]\n\n"
            return _SSEResponse(body(), media_type="text/event-stream")
        choices = await srv.collect(request, streams, gens)
        return CompletionResponse(id=rid, created=created, model=srv.model_name, usage=srv.usage(choices, req.n, seqs),
                                  kv_transfer_params=srv.kv_transfer_params(seqs),
                                  choices=[completion_choice(c, srv.token_text, want_lp, echoes[c.index])
                                           for c in choices])

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format 0.0.4",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}, 401: _ERRORS[401]})
    async def metrics(request: Request):
        index = request.scope.get("state", {}).get("metrics_key_index")
        tenant = tenant_label(srv.api_keys[index]) if srv.tenant_views and index is not None else None
        return PlainTextResponse(srv.metrics.render(tenant), media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- guard, errors, schema ---------------------------------------------------------------------

_ERRORS = {code: {"model": ErrorResponse, "description": why} for code, why in [
    (400, "Invalid request"), (401, "Missing or wrong API key (when the server has one)"),
    (404, "Unknown model"), (413, "Request body too large"), (500, "Internal error (details in the server log)"),
    (503, "Overloaded: retry later")]}


# One server-sent event: its data is a JSON chunk, an in-band {"error": ...}, or the closing [DONE].
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _responses(model) -> dict:
    ok = {200: {"model": model, "description": "The completion; with `stream: true`, server-sent events of chunks",
                "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}
    return {**ok, **_ERRORS}


def _openapi(app: FastAPI, auth: bool, metrics_auth: bool = False) -> dict:
    """FastAPI's schema, corrected to what the server does: validation errors are 400 (never 422)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        if auth or metrics_auth:
            schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for p, path in schema.get("paths", {}).items():
                if (auth and p.startswith("/v1")) or (metrics_auth and p == "/metrics"):
                    for op in path.values():
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


def _log_failure(what: str, e: BaseException) -> str:
    """Log an unexpected failure with its traceback; the id links a client's error body to it."""
    eid = uuid.uuid4().hex[:12]
    log.error("%s [error id %s]", what, eid, exc_info=(type(e), e, e.__traceback__))
    return eid


async def _send_json(send, status: int, body: dict, close: bool = False, extra=()) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *extra]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _err_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


class _Guard:
    """Pure ASGI middleware in front of every route: the API key on ``/v1`` routes (401, as vLLM
    checks it; ``/metrics`` against ``metrics_keys``), the body size (413: at once when Content-Length announces far more, else once the
    body passes the limit and the rest, if not far more, is read and dropped), and a clean 500 with ``Connection: close`` for any error
    nothing else handled (the exception's text goes to the log only)."""

    def __init__(self, app, api_keys=(), max_body_bytes: int = 1 << 20, metrics_keys=()):
        self.app, self.keys, self.max_body = app, tuple(k.encode("utf-8") for k in api_keys), max_body_bytes
        # /metrics shows every tenant's token counts and timings: it is behind a key whenever one exists
        self.metrics_keys = tuple(k.encode("utf-8") for k in metrics_keys if k)
        # a body up to this much past the limit is read (and dropped) before the 413, so the client
        # sees the answer rather than a reset from closing on unread data; larger ones are cut off
        self.drain = max(max_body_bytes, 1 << 20)

    async def _drain(self, receive, message, size: int) -> None:
        while message.get("more_body", False) and size <= self.max_body + self.drain:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.keys and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            index = self._key_index(scope)
            if index is None:
                return await _send_json(send, 401, _err_body(
                    "missing or incorrect API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key"),
                    extra=[(b"www-authenticate", b"Bearer")])
            scope.setdefault("state", {})["api_key_index"] = index
        elif self.metrics_keys and scope["path"] == "/metrics":
            index = self._key_index(scope, self.metrics_keys)
            if index is None:
                return await _send_json(send, 401, _err_body(
                    "missing or incorrect key for /metrics: send it as 'Authorization: Bearer <key>'",
                    code="invalid_api_key"), extra=[(b"www-authenticate", b"Bearer")])
            scope.setdefault("state", {})["metrics_key_index"] = index
        receive = await self._bounded_body(scope, receive, send)
        if receive is None:
            return
        started = False

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)
        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:
            eid = _log_failure(f"{scope['method']} {scope['path']} failed", e)
            if not started:
                await _send_json(send, 500, _err_body(f"internal server error (error id {eid})", "server_error"),
                                 close=True)

    def _key_index(self, scope, keys=None) -> int | None:
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return None
        token = token.strip()
        found = None
        for i, key in enumerate(self.keys if keys is None else keys):  # compare with every key: the time says nothing about which matched
            if hmac.compare_digest(token, key) and found is None:
                found = i
        return found

    async def _bounded_body(self, scope, receive, send):
        """The body read up front within the limit, replayed to the app (then the client's own
        receive, so disconnects still show); None once a 413 went out."""
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        too_large = _err_body(f"request body exceeds {self.max_body} bytes (the server's --max-body-bytes)",
                              code="request_too_large")
        if length is not None and not length.isdigit():
            await _send_json(send, 400, _err_body("invalid Content-Length header"), close=True)
            return None
        if length is not None and int(length) > self.max_body + self.drain:  # not worth reading: refuse now
            await _send_json(send, 413, too_large, close=True)
            return None
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") and length is None:
            return receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                await self._drain(receive, message, size)
                await _send_json(send, 413, too_large, close=True)
                return None
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return replay


# ---- prompts ----------------------------------------------------------------------------------

# Keys of chat_template_kwargs that the request's own fields set.
_TEMPLATE_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding", "truncation"}


def _chat_prompt(llm, req: ChatCompletionRequest):
    """(prompt, documents) for the engine: the rendered conversation as token ids, or, with
    documents, the conversation (the engine renders the documents before its last message in
    the same user turn, with the model's own template)."""
    messages = req.messages
    if getattr(llm.tokenizer, "chat_template", None) is None and req.chat_template is None:
        raise APIError(400, "the model has no chat template; use /v1/completions or send chat_template",
                       param="messages")
    conversation = [tl.template_message(m) for m in messages]
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(_TEMPLATE_RESERVED & set(kwargs))
    if bad:
        raise APIError(400, f"chat_template_kwargs: {bad[0]!r} is set by the request itself, not through "
                            f"chat_template_kwargs", param="chat_template_kwargs")
    tools = tl.template_tools(req.tools) if req.tools and req.tool_choice != "none" else None
    documents = req.document_texts()
    if documents is not None:
        for name, on in (("chat_template", req.chat_template is not None), ("chat_template_kwargs", bool(kwargs)),
                         ("tools", tools is not None), ("continue_final_message", req.continue_final_message),
                         ("add_generation_prompt", not req.add_generation_prompt)):
            if on:
                raise APIError(400, f"{name}: cannot be combined with documents (their prompt is rendered with the "
                                    f"model's own template, documents inside the last user turn)", param=name)
        if messages[-1].role != "user":
            raise APIError(400, "with documents, the last message must be the user's: its content is the question, "
                                "and the documents go before it in the same user turn", param="messages")
        return conversation, documents  # earlier messages (system, turns) render before the documents
    try:
        ids = llm.tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=req.chat_template, tokenize=True, return_dict=False,
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            **kwargs)
    except Exception as e:  # jinja2 TemplateError: roles out of order, unsupported role, ...
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding regardless
        ids = ids["input_ids"]
    return list(ids), None


# ---- streaming helpers ------------------------------------------------------------------------

async def _close(gens) -> None:
    for g in gens:
        with suppress(Exception):
            await g.aclose()


async def _chain(first: StreamDelta, gen) -> AsyncIterator[StreamDelta]:
    yield first
    if first.finish_reason is None:
        async for d in gen:
            yield d
            if d.finish_reason is not None:
                return


async def _unless_disconnected(request: Request, awaitable):
    """Await ``awaitable``, cancelling it (and raising _ClientGone) if the client disconnects first.
    Starlette does not cancel a handler whose client left, so non-streamed waits watch for it."""

    async def run():
        return await awaitable

    task = asyncio.ensure_future(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with suppress(BaseException):
                await task


def _stream_error(what: str, e: Exception) -> str:
    """An error after the stream has started is reported in-band, as OpenAI does; its details go
    to the log under the id the message names."""
    eid = _log_failure(what, e.__cause__ if isinstance(e, RequestFailed) and e.__cause__ else e)
    return _sse({"error": {"message": f"the request failed inside the server (error id {eid})",
                           "type": "server_error", "param": None, "code": None}})
