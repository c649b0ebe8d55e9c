"""Serving front: one worker thread drives ``Engine.step()``; requests stream tokens back.

Requests enter through a thread-safe inbox; the worker moves them into the engine, steps it,
and hands each request's new text to its consumer: what the consumer has not taken yet is merged
into one pending delta (vLLM's output collector), so a client that reads slowly holds one growing
delta, never a queue of them. A request whose consumer goes away is
aborted and its pages freed; one abandoned while still queued never reaches the engine. One that
can never fit (context or page pool) is refused with ``RequestTooLarge`` (a ValueError: the server
answers 400) and a full queue with ``EngineOverloaded`` (503), both before anything is queued.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from .host_memory import HeapTrimPolicy
from .llm import LLM
from .output import streamable_text
from .sampling import SamplingParams
from .sequence import Sequence


# Upper edges (seconds) of the time-to-first-token histogram.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineOverloaded(RuntimeError):
    """The request cannot be admitted now (the queue is full); retrying later can succeed."""


class RequestFailed(RuntimeError):
    """The engine failed this request while running it (the original error is ``__cause__``);
    the engine itself keeps serving."""


def _failed(e: BaseException) -> RequestFailed:
    err = RequestFailed(f"{type(e).__name__} while running the request")
    err.__cause__ = e
    return err


@dataclass
class StreamDelta:
    token_ids: list[int]  # tokens generated since the previous delta
    text: str  # text generated since the previous delta
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list | None = None  # the new tokens' (logprob, top-k) entries, with params.logprobs


@dataclass
class _Request:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event  # set on the loop when ``pending`` holds something
    arrival: float = field(default_factory=time.perf_counter)
    sent_tokens: int = 0
    sent_text: str = ""
    aborted: bool = False
    pending: object = None  # StreamDelta(s) merged, or the failure, not yet taken by the consumer
    woken: bool = False  # a wake-up is on its way to the loop
    guard: threading.Lock = field(default_factory=threading.Lock)

    def put(self, item) -> None:
        """On the worker thread: merge ``item`` into what waits, and wake the consumer once."""
        with self.guard:
            if isinstance(self.pending, BaseException):
                return  # a failure ends the stream: nothing after it is read
            self.pending = item if self.pending is None or isinstance(item, BaseException) else _merged(self.pending, item)
            wake, self.woken = not self.woken, True
        if wake:
            self.loop.call_soon_threadsafe(self.ready.set)

    async def take(self):
        """On the loop: everything delivered since the last take (one delta, or the failure)."""
        while True:
            await self.ready.wait()
            with self.guard:
                item, self.pending, self.woken = self.pending, None, False
                self.ready.clear()
            if item is not None:
                return item


def _merged(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return StreamDelta(a.token_ids + b.token_ids, a.text + b.text, b.finish_reason, b.prompt_tokens,
                       b.completion_tokens, b.cached_tokens, logprobs)


class AsyncLLMEngine:
    def __init__(self, llm: LLM, max_num_seqs: int = 64, max_waiting: int = 1024):
        self.llm, self.engine = llm, llm.engine
        self.engine.max_num_seqs = min(max_num_seqs, llm.engine.cfg.max_num_seqs)
        self.max_num_seqs, self.max_waiting = self.engine.max_num_seqs, max_waiting
        self._inbox: deque[_Request] = deque()
        self._aborts: deque[_Request] = deque()
        self._live: dict[int, _Request] = {}  # seq_id -> request, once in the engine
        self._lock = threading.Condition()
        self._stop = False
        self._leases_ready = False  # a prefilled request's lease was pulled: its pages can go
        # metrics
        self._ttft_counts = [0] * len(TTFT_BUCKETS)
        self._ttft_sum, self._ttft_n = 0.0, 0
        self.generated_tokens = 0
        self.reused_tokens = 0
        self.requests_finished = 0
        self.abandoned_before_prefill = 0  # requests whose client left before they reached the engine
        # observer.delivered(seq, arrival, new_tokens, now) after each delivery, on the worker thread
        # (the server's Prometheus metrics); None: nothing observes
        self.observer = None
        self.started = time.time()
        # freed host memory back to the OS: on going idle after work, and under load by the policy
        self.heap_trim = HeapTrimPolicy()
        self._trimmed_at = 0  # requests_finished at the last idle trim
        self._thread = threading.Thread(target=self._loop, name="redknot-engine", daemon=True)
        self._thread.start()

    # ---- public -------------------------------------------------------------------------------
    async def generate(self, prompt=None, params: SamplingParams | None = None, documents=None,
                       method: str | None = None, sequence: Sequence | None = None) -> AsyncIterator[StreamDelta]:
        """Stream a request's output: of ``prompt`` (tokenised here, on the caller's thread), or of
        ``sequence``, one made by ``LLM.make_sequence`` beforehand (the server tokenises in a worker
        thread). Bad input raises ValueError/TypeError (``RequestTooLarge`` for a request that can
        never fit) and a full queue EngineOverloaded, before anything runs."""
        seq = sequence if sequence is not None else self.llm.make_sequence(prompt, params, documents, method)
        seq.stream = True
        self.engine.prepare(seq)  # RequestTooLarge (a ValueError): it can never fit, whatever else runs
        req = _Request(seq, asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if len(self._inbox) + len(self.engine.waiting) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self.engine.waiting)} requests are waiting; try again later")
            self._inbox.append(req)
            self._lock.notify()
        try:
            while True:
                item = await req.take()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if req.seq.finish_reason is None:  # consumer left early (client disconnected)
                self.abort(req)

    def abort(self, req: _Request) -> None:
        req.seq.abandoned = True  # seen at once, before the worker takes the lock
        with self._lock:
            req.aborted = True
            self._aborts.append(req)
            self._lock.notify()

    def wake(self) -> None:
        """Something for the worker to do outside a step (a pulled lease's pages to free)."""
        with self._lock:
            self._leases_ready = True
            self._lock.notify()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        """Counters for /metrics."""
        with self._lock:
            engine = self.engine.stats()
            return {**engine, "waiting": engine["waiting"] + len(self._inbox),
                    "generated_tokens": self.generated_tokens, "reused_tokens": self.reused_tokens,
                    "requests_finished": self.requests_finished,
                    "abandoned_before_prefill": self.abandoned_before_prefill, "heap_trims": self.heap_trim.trims,
                    "heap_trim_seconds": self.heap_trim.seconds,
                    "ttft_buckets": list(zip(TTFT_BUCKETS, self._ttft_counts)), "ttft_sum": self._ttft_sum,
                    "ttft_count": self._ttft_n, "uptime_s": time.time() - self.started}

    def _record_ttft(self, seconds: float) -> None:
        for i, edge in enumerate(TTFT_BUCKETS):
            if seconds <= edge:
                self._ttft_counts[i] += 1  # cumulative buckets, as Prometheus expects
        self._ttft_sum += seconds
        self._ttft_n += 1

    # ---- worker ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while (not self._stop and not self._inbox and not self._aborts and not engine.has_unfinished()
                       and not self._leases_ready):
                    deadline = engine.leases.next_deadline()  # an unpulled lease expires then
                    if deadline is not None and deadline <= time.monotonic():
                        break
                    self._lock.wait(None if deadline is None else deadline - time.monotonic() + 0.01)
                if self._stop:
                    return
                inbox, aborts = list(self._inbox), list(self._aborts)
                self._inbox.clear()
                self._aborts.clear()
                self._leases_ready = False
            engine.collect_leases()
            for req in aborts:
                if self._live.pop(req.seq.seq_id, None) is not None:
                    if req.seq in engine.waiting and req.seq.num_computed == 0:  # queued, never prefilled
                        self.abandoned_before_prefill += 1
                    engine.abort(req.seq)
            for req in inbox:
                if req.aborted or req.seq.abandoned:  # its client left while it was queued: never prefilled
                    self.abandoned_before_prefill += 1
                    continue
                try:
                    engine.add_request(req.seq)
                except Exception as e:
                    self._send(req, _failed(e))
                    continue
                self._live[req.seq.seq_id] = req
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # the engine stays up: fail what was running
                for req in list(self._live.values()):
                    engine.abort(req.seq)
                    self._send(req, _failed(e))
                self._live.clear()
                continue
            with self._lock:
                for out in outputs:
                    req = self._live.get(out.seq.seq_id)
                    if req is not None:
                        self._deliver(req)
            self._trim_heap(engine)

    @property
    def heap_trims(self) -> int:
        return self.heap_trim.trims

    def _trim_heap(self, engine) -> None:
        """At a step boundary: trim the heap when the engine has just gone idle after work, or when
        the policy says memory grew under load (bounded to a share of wall time)."""
        if not engine.has_unfinished():
            if self.requests_finished != self._trimmed_at:
                self._trimmed_at = self.requests_finished
                self.heap_trim.trim(self.requests_finished)
        elif self.heap_trim.due(self.requests_finished):
            self.heap_trim.trim(self.requests_finished)

    def _deliver(self, req: _Request) -> None:
        seq = req.seq
        if seq.error is not None:
            self._live.pop(seq.seq_id, None)
            self._send(req, _failed(seq.error))
            return
        if req.sent_tokens == 0 and seq.output_token_ids:
            self._record_ttft(time.perf_counter() - req.arrival)
            self.reused_tokens += seq.cached_tokens
        n_new = len(seq.output_token_ids) - req.sent_tokens
        self.generated_tokens += n_new
        text = streamable_text(seq)
        if len(text) < len(req.sent_text):  # what was sent stays sent
            text = seq.text[:len(req.sent_text)]
        if seq.finished:
            self._live.pop(seq.seq_id, None)
            self.requests_finished += 1
        delta = StreamDelta(seq.output_token_ids[req.sent_tokens:], text[len(req.sent_text):], seq.finish_reason,
                            seq.num_prompt, len(seq.output_token_ids), seq.cached_tokens,
                            None if seq.logprobs is None else seq.logprobs[req.sent_tokens:])
        if self.observer is not None:
            self.observer.delivered(seq, req.arrival, n_new, time.perf_counter())
        req.sent_tokens, req.sent_text = len(seq.output_token_ids), text
        self._send(req, delta)

    @staticmethod
    def _send(req: _Request, item) -> None:
        req.put(item)
