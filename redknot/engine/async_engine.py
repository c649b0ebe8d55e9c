"""Continuous batching for serving: one worker thread owns the model; requests stream tokens back.

Each loop iteration admits waiting requests while the KV pool can hold them (prefill, with chunk
reuse when the method uses it), then runs one decode step for every running sequence together.
A request whose consumer goes away is aborted and its pages freed. Requests that can never fit
are refused with ``EngineOverloaded`` (the server answers 503) instead of running out of memory.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from .llm import LLM, prefills_through_reuse
from .sampling import SamplingParams, sample
from .sequence import Sequence


# Upper edges (seconds) of the time-to-first-token histogram.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineOverloaded(RuntimeError):
    """The request cannot be admitted: the queue is full or it needs more KV than the pool has."""


@dataclass
class StreamDelta:
    token_ids: list[int]  # tokens generated since the previous delta
    text: str  # text generated since the previous delta
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class _Request:
    seq: Sequence
    prompt: object
    documents: list | None
    method: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    pages: int = 0  # pool pages reserved at admission
    cached_tokens: int = 0
    sent_tokens: int = 0
    sent_text: str = ""
    aborted: bool = False


class AsyncLLMEngine:
    def __init__(self, llm: LLM, max_num_seqs: int = 64, max_waiting: int = 1024):
        self.llm, self.max_num_seqs, self.max_waiting = llm, max_num_seqs, max_waiting
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._lock = threading.Condition()
        self._stop = False
        self._ids = itertools.count()
        self._reserved = 0
        # metrics
        self._ttft_counts = [0] * len(TTFT_BUCKETS)
        self._ttft_sum, self._ttft_n = 0.0, 0
        self.generated_tokens = 0
        self.reused_tokens = 0
        self.requests_finished = 0
        self.started = time.time()
        self._thread = threading.Thread(target=self._loop, name="redknot-engine", daemon=True)
        self._thread.start()

    # ---- public -------------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, documents=None,
                       method: str | None = None) -> AsyncIterator[StreamDelta]:
        """Stream a request's output. Bad input raises ValueError/TypeError before anything runs."""
        method = self.llm._check_method(method or self.llm.method)
        ids = self.llm._prompt_ids(prompt, documents)
        if len(ids) + params.max_tokens > self.llm.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's {self.llm.max_model_len} (max_position_embeddings)")
        seq = Sequence(ids, params)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.llm.device).manual_seed(params.seed)
        req = _Request(seq, prompt, documents, method, asyncio.get_running_loop(), asyncio.Queue())
        self._check_fits(req)
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests are waiting; try again later")
            self._waiting.append(req)
            self._lock.notify()
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if req.seq.finish_reason is None:  # consumer left early (client disconnected)
                self.abort(req)

    def abort(self, req: _Request) -> None:
        with self._lock:
            req.aborted = True
            if req in self._waiting:
                self._waiting.remove(req)
            self._lock.notify()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        """Counters for /metrics; KV and pool pages summed over every backend in use."""
        backends = list(self.llm._backends.values())
        pools = [b.pool.occupancy() for b in backends if hasattr(b, "pool")]
        occupancy = {k: sum(p[k] for p in pools) for k in pools[0]} if pools else {}
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "generated_tokens": self.generated_tokens, "reused_tokens": self.reused_tokens,
                    "requests_finished": self.requests_finished,
                    "ttft_buckets": list(zip(TTFT_BUCKETS, self._ttft_counts)), "ttft_sum": self._ttft_sum,
                    "ttft_count": self._ttft_n, "uptime_s": time.time() - self.started,
                    "kv_bytes": sum(b.kv_bytes() for b in backends), "pool_pages": occupancy}

    def _record_ttft(self, seconds: float) -> None:
        with self._lock:
            for i, edge in enumerate(TTFT_BUCKETS):
                if seconds <= edge:
                    self._ttft_counts[i] += 1  # cumulative buckets, as Prometheus expects
            self._ttft_sum += seconds
            self._ttft_n += 1

    # ---- admission ------------------------------------------------------------------------------
    def _pages_for(self, req: _Request) -> int:
        backend = self.llm.backend(req.method)
        if not hasattr(backend, "pool"):
            return 0
        return backend.pool.pages_needed(len(req.seq.token_ids) + req.seq.params.max_tokens).peak

    def _check_fits(self, req: _Request) -> None:
        backend = self.llm.backend(req.method)
        if hasattr(backend, "pool") and self._pages_for(req) > backend.pool.num_pages:
            raise EngineOverloaded(f"the request needs {self._pages_for(req)} KV pages; the pool has "
                                   f"{backend.pool.num_pages}")

    def _admissible(self, req: _Request) -> bool:
        backend = self.llm.backend(req.method)
        if not hasattr(backend, "pool"):
            return True
        return self._reserved + self._pages_for(req) <= backend.pool.num_pages

    # ---- worker ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._running:
                    self._lock.wait()
                if self._stop:
                    return
                admitted = []
                while (self._waiting and len(self._running) + len(admitted) < self.max_num_seqs
                       and (self._waiting[0].aborted or self._admissible(self._waiting[0]))):
                    req = self._waiting.popleft()
                    if req.aborted:
                        continue
                    req.pages = self._pages_for(req)
                    self._reserved += req.pages
                    admitted.append(req)
            for req in admitted:
                self._guard(req, self._prefill, req)
            self._reap()
            if self._running:
                self._decode()
            self._reap()

    def _guard(self, req: _Request, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a failing request must not take the engine down
            if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()  # give the failed request's activations back before the next one
            self._fail(req, e)

    def _prefill(self, req: _Request) -> None:
        llm, seq = self.llm, req.seq
        backend = llm.backend(req.method)
        backend.add_sequence(seq.seq_id)
        self._running.append(req)
        if not prefills_through_reuse(req.method):
            logits = llm._prefill(backend, [seq])[seq.seq_id]
        else:
            result = llm._reuse_prefill(req.prompt, req.documents, req.method)
            backend.import_kv(seq.seq_id, result.recovered.k, result.recovered.v)
            seq.num_computed = len(seq.token_ids)
            logits = result.recovered.logits
            req.cached_tokens = result.cached_tokens
            self.reused_tokens += result.cached_tokens
        self._accept(req, sample(logits[None], [seq.params], [seq.generator])[0])
        self._record_ttft(time.perf_counter() - req.arrival)

    def _decode(self) -> None:
        by_method: dict[str, list[_Request]] = {}
        for req in self._running:
            if not req.seq.finished and not req.aborted:
                by_method.setdefault(req.method, []).append(req)
        for method, reqs in by_method.items():
            backend = self.llm.backend(method)
            try:
                logits = self.llm.runner.step(backend, [(r.seq, 1) for r in reqs])
                tokens = sample(logits, [r.seq.params for r in reqs], [r.seq.generator for r in reqs])
            except Exception as e:
                for r in reqs:
                    self._fail(r, e)
                continue
            for r, t in zip(reqs, tokens):
                self._accept(r, t)

    def _accept(self, req: _Request, token: int) -> None:
        seq = req.seq
        self.llm._append(seq, token)
        self.generated_tokens += 1
        stops = seq.params.stop
        text = seq.text
        if not seq.finished:
            # hold back a trailing partial character (bytes of it are still to come) and what
            # could still become a stop string
            keep = len(text.rstrip("\ufffd"))
            if stops:
                keep = min(keep, len(text) - max(len(s) for s in stops) + 1)
            text = text[: max(len(req.sent_text), keep)]
        delta = StreamDelta(seq.output_token_ids[req.sent_tokens:], text[len(req.sent_text):], seq.finish_reason,
                            seq.num_prompt, len(seq.output_token_ids), req.cached_tokens)
        req.sent_tokens, req.sent_text = len(seq.output_token_ids), text
        req.loop.call_soon_threadsafe(req.queue.put_nowait, delta)

    def _fail(self, req: _Request, error: Exception) -> None:
        req.aborted = True
        req.loop.call_soon_threadsafe(req.queue.put_nowait, error)

    def _reap(self) -> None:
        """Free finished and aborted sequences."""
        keep = []
        for req in self._running:
            if req.seq.finished or req.aborted:
                self.llm.backend(req.method).free_sequence(req.seq.seq_id)
                with self._lock:
                    self._reserved -= req.pages
                if req.seq.finished:
                    self.requests_finished += 1
            else:
                keep.append(req)
        self._running = keep
