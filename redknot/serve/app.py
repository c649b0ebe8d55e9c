"""The OpenAI-compatible HTTP server over ``AsyncLLMEngine``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Every request is validated and admitted before the response starts, so bad input is a 4xx with
an OpenAI error body and an overloaded engine a 503, even for streams. A client that goes away
closes the engine's generator, which aborts its request and frees its KV pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import suppress
from typing import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncLLMEngine, EngineOverloaded, StreamDelta
from ..engine.sampling import SamplingParams
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage,
                       ErrorInfo, ErrorResponse, ModelCard, ModelList, Usage, new_id, now)

log = logging.getLogger("redknot.serve")

_DISCONNECT_POLL_S = 0.2
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


class _ClientGone(Exception):
    """The client disconnected before the response started."""


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
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


def build_app(engine: AsyncLLMEngine, model_name: str) -> FastAPI:
    llm = engine.llm
    app = FastAPI(title="redknot", description="OpenAI-compatible redknot server")
    app.state.engine = engine

    # ---- errors -------------------------------------------------------------------------------
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
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        param = ".".join(loc) or None
        return _error(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(_ClientGone)
    async def _client_gone(_, e):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(_, e: Exception):  # e.g. a request failing inside the engine worker
        return _error(500, f"{type(e).__name__}: {e}", "server_error")

    # ---- helpers ------------------------------------------------------------------------------
    def check_model(model: str) -> None:
        if model != model_name:
            raise APIError(404, f"The model `{model}` does not exist (serving `{model_name}`).",
                           param="model", code="model_not_found")

    def sampling_params(req, prompt_len) -> SamplingParams:
        max_tokens = req.max_tokens
        if max_tokens is None:  # whatever the context has left, as vLLM does
            n = prompt_len()
            if n >= llm.max_model_len:
                raise APIError(400, f"prompt has {n} tokens, the model allows {llm.max_model_len} "
                                    f"with room for at least one generated token",
                               param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
            max_tokens = llm.max_model_len - n
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, seed=req.seed, stop=req.stop, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def start(request: Request, prompt, params, documents, method) -> tuple[AsyncIterator[StreamDelta], StreamDelta]:
        """Submit to the engine and wait for the first delta: input errors surface here as 4xx/503."""
        gen = engine.generate(prompt, params, documents=documents, method=method)
        try:
            first = await _unless_disconnected(request, gen.__anext__())
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        except EngineOverloaded as e:
            raise APIError(503, str(e), type="server_overloaded", code="engine_overloaded") from None
        except torch.OutOfMemoryError:  # the request's pages are freed; retrying later can succeed
            raise APIError(503, "out of accelerator memory for this request's prefill; retry later or "
                                "send a shorter prompt", type="server_overloaded", code="out_of_memory") from None
        except _ClientGone:
            await gen.aclose()
            raise
        except StopAsyncIteration:
            raise APIError(500, "the engine returned no output", type="server_error") from None
        return gen, first

    async def rest(request: Request, gen, first: StreamDelta) -> tuple[str, StreamDelta]:
        async def drain():
            text, last = first.text, first
            while last.finish_reason is None:
                last = await gen.__anext__()
                text += last.text
            return text, last
        try:
            return await _unless_disconnected(request, drain())
        finally:
            await gen.aclose()

    def usage(d: StreamDelta) -> Usage:
        return Usage.of(d.prompt_tokens, d.completion_tokens, d.cached_tokens)

    # ---- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        thread = getattr(engine, "_thread", None)
        if thread is not None and not thread.is_alive():
            return _error(503, "the engine worker has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name, max_model_len=llm.max_model_len)])

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return ModelCard(id=model_name, max_model_len=llm.max_model_len)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        prompt, documents = _chat_prompt(llm, req)
        params = sampling_params(req, lambda: len(prompt) if documents is None else
                                 len(_prompt_ids(llm, prompt, documents)))
        gen, first = await start(request, prompt, params, documents, req.method)
        rid, created = new_id("chatcmpl"), now()
        if req.stream:
            def chunk(delta: DeltaMessage | None, finish=None, usage_=None):
                choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
                return _sse(ChatCompletionChunk(id=rid, created=created, model=model_name, choices=choices,
                                                usage=usage_))

            async def body():
                try:
                    yield chunk(DeltaMessage(role="assistant", content=""))
                    async for d in _chain(first, gen):
                        if d.text or d.finish_reason:
                            yield chunk(DeltaMessage(content=d.text), d.finish_reason)
                        last = d
                    if req.include_usage:
                        yield chunk(None, usage_=usage(last))
                except Exception as e:  # the stream has started: report in-band
                    yield _stream_error("chat stream failed", e)
                finally:
                    await gen.aclose()
                yield "data: [DONE]\n\n"
            return _SSEResponse(body(), media_type="text/event-stream")
        text, last = await rest(request, gen, first)
        return ChatCompletionResponse(id=rid, created=created, model=model_name, usage=usage(last), choices=[
            ChatChoice(message=AssistantMessage(content=text), finish_reason=last.finish_reason)])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        prompt, documents = req.prompt, req.documents
        if documents is None:  # tokenize once, here
            prompt = _prompt_ids(llm, prompt, None)
        params = sampling_params(req, lambda: len(prompt) if documents is None else
                                 len(_prompt_ids(llm, prompt, documents)))
        gen, first = await start(request, prompt, params, documents, req.method)
        rid, created = new_id("cmpl"), now()
        if req.stream:
            def chunk(choice: CompletionChoice | None, usage_=None):
                return _sse(CompletionResponse(id=rid, created=created, model=model_name,
                                               choices=[] if choice is None else [choice], usage=usage_))

            async def body():
                try:
                    async for d in _chain(first, gen):
                        if d.text or d.finish_reason:
                            yield chunk(CompletionChoice(text=d.text, finish_reason=d.finish_reason))
                        last = d
                    if req.include_usage:
                        yield chunk(None, usage(last))
                except Exception as e:
                    yield _stream_error("completion stream failed", e)
                finally:
                    await gen.aclose()
                yield "data: [DONE]\n\n"
            return _SSEResponse(body(), media_type="text/event-stream")
        text, last = await rest(request, gen, first)
        return CompletionResponse(id=rid, created=created, model=model_name, usage=usage(last),
                                  choices=[CompletionChoice(text=text, finish_reason=last.finish_reason)])

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ---- prompts ----------------------------------------------------------------------------------

def _prompt_ids(llm, prompt, documents) -> list[int]:
    try:
        return llm.prompt_ids(prompt, documents)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="prompt") from None


def _chat_prompt(llm, req: ChatCompletionRequest):
    """(prompt, documents) for the engine: the rendered conversation as token ids, or, with
    documents, the question string (the engine puts the documents before it in the user turn)."""
    messages = req.messages
    if getattr(llm.tokenizer, "chat_template", None) is None:
        raise APIError(400, "the model has no chat template; use /v1/completions", param="messages")
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
    if req.documents is not None:
        if messages[-1].role != "user":
            raise APIError(400, "with documents, the last message must be the user's: its content is the question, "
                                "and the documents go before it in the same user turn", param="messages")
        return conversation, req.documents  # earlier messages (system, turns) render before the documents
    try:
        ids = llm.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
    except Exception as e:  # jinja2 TemplateError: roles out of order, unsupported role, ...
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding regardless
        ids = ids["input_ids"]
    return list(ids), None


# ---- streaming helpers ------------------------------------------------------------------------

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
    """An error after the stream has started is reported in-band, as OpenAI does."""
    log.exception(what)
    return _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})


# ---- metrics ----------------------------------------------------------------------------------

def render_metrics(stats: dict) -> str:
    """Prometheus text exposition (format 0.0.4) of ``AsyncLLMEngine.stats()``."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            lines.append(f"{name}{label} {_num(value)}")

    count = stats.get("ttft_count", 0)
    buckets = [({"le": _num(float(b))}, n) for b, n in stats.get("ttft_buckets", [])] + [({"le": "+Inf"}, count)]
    name = "redknot_time_to_first_token_seconds"
    lines += [f"# HELP {name} Time from a request's arrival to its first generated token.",
              f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{lab["le"]}"}} {n}' for lab, n in buckets]
    lines += [f"{name}_sum {_num(float(stats.get('ttft_sum', 0.0)))}", f"{name}_count {count}"]

    uptime = max(stats.get("uptime_s", 0.0), 1e-9)
    generated = stats.get("generated_tokens", 0)
    metric("redknot_generation_tokens_total", "counter", "Tokens generated since start.", [({}, generated)])
    metric("redknot_generation_tokens_per_second", "gauge", "Tokens generated per second since start.",
           [({}, generated / uptime)])
    metric("redknot_reused_chunk_tokens_total", "counter", "Prompt tokens served from the chunk cache.",
           [({}, stats.get("reused_tokens", 0))])
    metric("redknot_requests_finished_total", "counter", "Requests that finished (not aborted).",
           [({}, stats.get("requests_finished", 0))])
    metric("redknot_requests_running", "gauge", "Requests running (prefilled, decoding).",
           [({}, stats.get("running", 0))])
    metric("redknot_requests_waiting", "gauge", "Requests waiting for admission.", [({}, stats.get("waiting", 0))])
    metric("redknot_kv_cache_bytes", "gauge", "Device bytes of KV held by running requests.",
           [({}, stats.get("kv_bytes", 0))])
    pool = stats.get("pool_pages") or {}
    if pool:
        metric("redknot_kv_pool_pages", "gauge", "SegPaged KV pool pages in use, by the owner head's class.",
               [({"head_class": c}, pool.get(c, 0)) for c in ("global", "local")])
        metric("redknot_kv_pool_free_pages", "gauge", "SegPaged KV pool pages free.", [({}, pool.get("free", 0))])
        metric("redknot_kv_pool_total_pages", "gauge", "SegPaged KV pool size in pages.", [({}, pool.get("total", 0))])
        page = stats.get("page_bytes", 0)
        metric("redknot_kv_pool_bytes", "gauge", "SegPaged KV pool bytes in use, by the owner head's class.",
               [({"head_class": c}, pool.get(c, 0) * page) for c in ("global", "local")])
    metric("redknot_requests_preempted_total", "counter", "Requests preempted (pages freed, re-queued).",
           [({}, stats.get("preemptions", 0))])
    metric("redknot_prefix_cache_pages", "gauge", "Pool pages the prefix cache references.",
           [({}, stats.get("prefix_cache_pages", 0))])
    metric("redknot_chunk_cache_pages", "gauge", "Pool pages cached document KV holds.",
           [({}, (stats.get("chunk_cache") or {}).get("pages", 0))])
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)
