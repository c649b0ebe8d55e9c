"""The scheduler: who waits, who runs, what each step computes, and the page arithmetic behind it.

Pure bookkeeping over the page pool and the caches' page counts: it runs no model. Admission is
FIFO: the head of the queue starts when sequence slots, the token budget and pages allow (cached
prefixes and chunks are evicted for it; a request whose documents are cached keeps them). Each
admitted request is committed the pages it holds at its full length under its head plan
(``reserve_full_length``), so running requests do not outgrow the pool; when they still do (shared
pages, optimistic admission), the newest running request is preempted (recompute: its pages go back
and it re-queues first). A request whose documents load from the tiers below the pool is parked
(``park``: WAITING_FOR_KV, out of the queue, so the requests behind it may start) until the
loader beside the engine is done with it (``unpark``: back to the head of the queue).

Every number a front needs about what fits (``check_fits``, ``context_limits``, ``max_new_tokens``)
comes from the same functions admission uses.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..cache import PagePool, PoolExhausted
from ..config import GLOBAL_WINDOW
from ..reuse.registry import MethodSpec, get_method
from .engine_config import EngineConfig
from .sequence import Sequence, SequenceStatus


class RequestTooLarge(ValueError):
    """The request can never fit the pool or the context, whatever else is running."""


@dataclass
class DocumentNeeds:
    """What admitting a request that reads documents asks of the pool beyond its own pages."""
    keep: frozenset = frozenset()  # keys of its cached chunks: they must not be evicted for it
    kept_pages: int = 0  # the pages those chunks hold
    missing_pages: int = 0  # pages the prefills of its missing chunks hold at most


@dataclass
class Admission:
    seq: Sequence
    pages: int  # free pages its first step needs (documents' prefills included)
    steady: int  # pages committed to it while it runs
    documents: DocumentNeeds | None = None


class Scheduler:
    def __init__(self, pool: PagePool, cfg: EngineConfig, max_model_len: int, caches=()):
        """``caches``: the prefix and chunk caches (``num_pages()`` and ``evict(pages, keep)``), in
        the order they are evicted from."""
        self.pool, self.cfg, self.max_model_len = pool, cfg, max_model_len
        self.caches = [c for c in caches if c is not None]
        self.max_num_seqs = cfg.max_num_seqs  # a front may lower it (never above the slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # parked while their documents load from the tiers (no pages of their own)
        self._arrivals: set[int] = set()  # ids of requests added since the last admission (order_arrivals)
        self.committed = 0  # pages promised to the running requests (their full lengths)
        self.num_preemptions = 0
        L, hkv = pool.window.shape
        self.heads = L * hkv
        self.local_heads = max(int((pool.window_sink(p)[0] < GLOBAL_WINDOW).sum()) for p in pool.plans)

    # ------------------------------------------------------------------ page arithmetic

    def pages_for(self, seq: Sequence) -> int:
        """Pages the request needs at its largest: its whole context under its plan, and while a
        prompt chunk is stored, that chunk's pages for every head; a request reading documents also
        holds its chunks' cached pages (and one chunk prefill's prefix pages) while they are copied in."""
        spec = get_method(seq.method)
        total = len(seq.token_ids) + seq.params.max_tokens
        if seq.kv_import is not None:  # its prompt's pages arrive trimmed: no prefill peak
            return self.pool.peak_pages(total, 1, seq.plan) + seq.kv_import.extra_pages
        chunk = len(seq.token_ids) if spec.recovers else self.cfg.max_num_batched_tokens
        need = self.pool.peak_pages(total, chunk, seq.plan)
        if spec.reads_chunks and seq.chunked_prompt is not None:
            ps, cp = self.pool.page_size, seq.chunked_prompt
            p = len(cp.prefix)
            per_head = sum(-(-(p % ps + len(c)) // ps) for c in cp.chunks) + 2 * (-(-p // ps)) + 1
            need += per_head * self.heads
        return need

    def steady_pages(self, seq: Sequence) -> int:
        """Pages the request holds at its full length (prompt + max_tokens, at most
        reserve_decode_tokens of them) once decoding under its plan: what admission commits."""
        decode = min(seq.params.max_tokens, self.cfg.reserve_decode_tokens)
        extra = seq.kv_import.extra_pages if seq.kv_import is not None else 0  # selected pages it brings
        return self.pool.peak_pages(len(seq.token_ids) + decode, 1, seq.plan) + extra

    def headroom(self, capped: bool = True) -> int:
        """Pages kept out of the commitments for what prefill holds only for a while: local heads'
        pages of one token budget, stored before trim drops them (at most an eighth of the pool)."""
        per_head = -(-self.cfg.max_num_batched_tokens // self.pool.page_size) + 1
        need = self.local_heads * per_head
        return min(need, self.pool.num_pages // 8) if capped else need

    def admission_pages(self, seq: Sequence, budget: int | None = None) -> int:
        """Free pages admission asks for a request's first step: its first prompt chunk under its
        plan (the whole prompt for a recovery, the question's start for a placed-chunk request,
        else what the step's token ``budget`` takes), plus one page per head for the token after it."""
        spec = get_method(seq.method)
        if seq.kv_import is not None:  # the pages it brings, then one per head for its next token
            return seq.kv_import.num_pages + self.heads
        if seq.needs_documents and spec.recovers:
            first = len(seq.token_ids)
        elif seq.needs_documents:  # the question's start (no layout: the whole prompt, an upper bound)
            first = len(seq.token_ids) if seq.chunked_prompt is None else seq.chunked_prompt.suffix_start
        else:
            first = min(seq.num_pending, self.cfg.max_num_batched_tokens if budget is None else budget)
        return self.pool.pages_needed(first, plan=seq.plan).peak + self.heads

    def pool_pages_for(self, seq: Sequence) -> int:
        """The smallest pool that admits this request on its own: what a harness that runs one
        request at a time sizes its pool by. The headroom grows with the pool (an eighth of it)."""
        steady, headroom = self.steady_pages(seq), self.headroom(capped=False)
        pages = max(self.pages_for(seq), steady, self.admission_pages(seq))
        while pages < steady + min(headroom, pages // 8):
            pages += 1
        return pages

    def check_fits(self, seq: Sequence) -> None:
        """Raises RequestTooLarge when the request can never run, whatever else is running."""
        n = len(seq.token_ids)
        if n + seq.params.max_tokens > self.max_model_len:
            raise RequestTooLarge(f"prompt ({n} tokens) + max_tokens ({seq.params.max_tokens}) exceeds the "
                                  f"model's {self.max_model_len} (max_model_len)")
        need = max(self.pages_for(seq), self.steady_pages(seq) + self.headroom())
        if need > self.pool.num_pages:
            raise RequestTooLarge(f"the request needs {need} KV pages ({need * self.pool.bytes_per_page} bytes) "
                                  f"under plan {seq.plan!r}; the pool has {self.pool.num_pages}")
        if self.admission_pages(seq) > self.pool.num_pages:
            raise RequestTooLarge(f"prompt has {n} tokens: its first step needs {self.admission_pages(seq)} KV pages "
                                  f"under plan {seq.plan!r}; the pool has {self.pool.num_pages}")

    def fits(self, seq: Sequence) -> bool:
        try:
            self.check_fits(seq)
        except RequestTooLarge:
            return False
        return True

    def max_new_tokens(self, seq: Sequence) -> int:
        """The most tokens the request can generate: the largest max_tokens ``check_fits`` accepts
        for its prompt (0 when even one does not fit). What a request that leaves max_tokens unset gets."""
        saved = seq.params.max_tokens

        def fits_with(n: int) -> bool:
            seq.params.max_tokens = n
            return self.fits(seq)
        try:
            return _largest(lambda n: n == 0 or fits_with(n), self.max_model_len - len(seq.token_ids))
        finally:
            seq.params.max_tokens = saved

    def context_limits(self, spec: MethodSpec, make_seq) -> tuple[int, int]:
        """(most tokens of prompt + max_tokens, most prompt tokens) one request of ``spec`` can ever
        hold, documents aside. ``make_seq(n)`` builds a request of an n-token prompt and one output
        token under the method."""
        total = _largest(lambda n: self.fits(make_seq(max(n - 1, 1))), self.max_model_len)
        return total, min(_largest(lambda n: self.fits(make_seq(n)), self.max_model_len), total)

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._arrivals.add(seq.seq_id)

    def order_arrivals(self, work) -> None:
        """Queue the requests that arrived since the last admission behind those waiting from
        before, the least ``work(seq)`` first (arrival order among equals): a short request that
        arrives beside a heavy one starts first, and the heavy one waits one admission at most for
        it (the next admission's arrivals queue behind it)."""
        if len(self._arrivals) > 1:
            new = [s for s in self.waiting if s.seq_id in self._arrivals]
            old = [s for s in self.waiting if s.seq_id not in self._arrivals]
            self.waiting.clear()
            self.waiting.extend(old + sorted(new, key=work))
        self._arrivals.clear()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def park(self, seq: Sequence) -> None:
        """The head of the queue waits for its documents' KV (loaded beside the engine); the
        requests behind it may start meanwhile."""
        assert self.waiting[0] is seq
        self.waiting.popleft()
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.loading.append(seq)

    def unpark(self, seq: Sequence) -> None:
        """Its load is done (or given up): it goes back to the head of the queue."""
        if seq in self.loading:
            self.loading.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def split_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decoding: one pending token after their prompt, prefilling: the rest)."""
        decode, prefill = [], []
        for s in self.running:
            (decode if s.num_pending == 1 and s.num_computed > 0 else prefill).append(s)
        return decode, prefill

    def cached_pages(self) -> int:
        """Pages the caches reference (an upper bound on what evicting frees)."""
        return sum(c.num_pages() for c in self.caches)

    def reclaim(self, pages: int, keep=()) -> int:
        """Free up to ``pages`` pages from the caches, least recently used first across all of them
        (a hot prompt prefix outlives a cold document), keeping the chunks keyed in ``keep``."""
        freed = 0
        while freed < pages:
            aged = [(age, i) for i, c in enumerate(self.caches) if (age := c.oldest_use(keep)) is not None]
            if not aged:
                break
            # one entry at a time: a prefix block and a document can share pages, and dropping the
            # older one alone may free nothing yet; the newer entries stay until it has to be them
            freed += self.caches[min(aged)[1]].evict_one(keep)
        return freed

    # ------------------------------------------------------------------ admission

    def next_admission(self, budget: int, recovery_rows: int, needs=None) -> Admission | None:
        """The head of the queue, if it can start now (caches evicted to make room for it), else
        None. ``needs(seq)``: a request's DocumentNeeds (its documents' cache state). Pages are not
        taken here: the caller starts the request (``start``) or leaves it queued."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return None
        seq = self.waiting[0]
        if seq.abandoned:
            return Admission(seq, 0, 0)
        if (seq.needs_documents and get_method(seq.method).recovers and recovery_rows
                and recovery_rows + len(seq.token_ids) > self.cfg.recovery_rows):
            return None  # its layer-0 rows would push the recovery forward past its activation size
        steady = self.steady_pages(seq)
        if self.cfg.reserve_full_length and self.committed + steady + self.headroom() > self.pool.num_pages:
            return None  # the running requests' full contexts leave no room for this one's yet
        docs = needs(seq) if seq.needs_documents and needs is not None else DocumentNeeds()
        need = self.admission_pages(seq, budget) + docs.missing_pages
        if need > self.pool.num_free_pages + self.cached_pages() - docs.kept_pages:
            return None  # even emptying the caches would not make room: keep them and wait
        if need > self.pool.num_free_pages:
            self.reclaim(need - self.pool.num_free_pages, docs.keep)
        if need > self.pool.num_free_pages:
            return None
        return Admission(seq, need, steady, docs if seq.needs_documents else None)

    def stuck(self) -> bool:
        """Nothing runs and the caches hold nothing to give back: the head of the queue will never
        find its pages (``check_fits`` refuses such requests up front; this keeps the engine from
        waiting forever should one slip through). Evicts what the caches hold first."""
        return not self.running and not self.loading and not self.reclaim(self.pool.num_pages)

    def start(self, adm: Admission) -> None:
        """The admitted request leaves the queue, gets its pool sequence and its commitment."""
        seq = self.waiting.popleft()
        assert seq is adm.seq
        self.pool.add_sequence(seq.seq_id, seq.plan)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.scheduled_time is None:
            seq.scheduled_time = time.perf_counter()
        seq.committed_pages = adm.steady
        self.committed += adm.steady

    def drop_head(self) -> Sequence:
        return self.waiting.popleft()

    # ------------------------------------------------------------------ the step's tokens

    def prompt_chunk_cap(self, busy: bool) -> int | None:
        """The most tokens a long prompt's chunk takes this step: the configured threshold while
        the step has other work (``busy``) or requests wait, else the whole budget."""
        if self.cfg.long_prefill_token_threshold is None or not (busy or self.waiting):
            return None
        return self.cfg.long_prefill_token_threshold

    def short_prompt(self, seq: Sequence) -> bool:
        """Its prompt's rest fits an eighth of the token budget (it goes first in a step)."""
        return seq.num_pending <= max(1, self.cfg.max_num_batched_tokens // 8)

    def prompt_chunks(self, prefill: list[Sequence], budget: int, tail_rows,
                      cap: int | None = None) -> list[tuple[Sequence, int]]:
        """Prompt chunks of prefilling requests under the token ``budget``, each at most ``cap``
        tokens. ``tail_rows(seq)``: rows
        the forward completing its prompt must compute together (a selection's observation window).
        The prompts with the least left go first (shortest remaining first; arrival order among
        equals), so a long prompt's chunks never hold a shorter request back more than a step
        (head-of-line blocking): it takes what the shorter ones leave. Only a sustained stream of
        shorter prompts, more than the budget serves, keeps a long one waiting."""
        chunks = []
        for s in sorted(prefill, key=lambda s: s.num_pending):  # stable: arrival order among equals
            if budget <= 0:
                break
            n = min(s.num_pending, budget, cap or budget)
            tail = min(tail_rows(s), self.cfg.max_num_batched_tokens)  # a budget that fits it
            if n < s.num_pending < n + tail:  # the last chunk keeps the selection's rows
                n = s.num_pending - tail
                if n <= 0:
                    continue  # all of it in one later step, with more budget
            chunks.append((s, n))
            budget -= n
        return chunks

    def make_room(self, batch: list[tuple[Sequence, int]], preempt, pinned=None) -> list[tuple[Sequence, int]]:
        """Ensure pages for every scheduled token; evict cached prefixes and chunks, then preempt the
        newest running requests (``preempt(seq)``; those ``pinned(seq)`` names, recoveries under way,
        only when no other is left), while the pool is short. Returns the part of the batch that runs."""
        out = []
        for s, n in batch:
            while s.seq_id in self.pool:  # else preempted to make room for an earlier one
                try:
                    self.pool.ensure(s.seq_id, s.num_computed + n)
                    out.append((s, n))
                    break
                except PoolExhausted:
                    need = self.pool.pages_needed(s.num_computed + n, self.pool.length(s.seq_id), s.plan).peak
                    if self.reclaim(need):
                        continue
                    others = [v for v in reversed(self.running) if v is not s]
                    victim = next((v for v in others if pinned is None or not pinned(v)), None)
                    victim = victim if victim is not None else next(iter(others), None)
                    if victim is None:
                        if n > 1:  # a prompt chunk: try a smaller one next step
                            break
                        raise
                    preempt(victim)
                    out = [(v, m) for v, m in out if v is not victim]
        return out

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: its pages go back, it re-queues first and re-prefills its prompt
        and what it generated (in the pool, from whatever prefix is still cached)."""
        self.free(seq)
        seq.num_computed = 0
        if seq.reuse is not None:
            seq.reuse.recovery, seq.reuse.spans, seq.reuse.linear = None, [], None
            seq.reuse.done = True  # its re-prefill runs in the pool: exact KV under its plan
        seq.exact_kv = True
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def free(self, seq: Sequence) -> None:
        """Its pages and its commitment go back; it leaves the running list."""
        self.committed -= seq.committed_pages
        seq.committed_pages = 0
        if seq.seq_id in self.pool:
            seq.pages_at_finish = self.pool.pages_held(seq.seq_id)
            self.pool.free_sequence(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.loading:
            self.loading.remove(seq)
        self.free(seq)
        if seq.finish_reason is None:
            seq.finish("abort")


def _largest(ok, hi: int) -> int:
    """The largest n in [0, hi] with ``ok(n)``, where ``ok`` turns false once as n grows (0 when none)."""
    if ok(hi):
        return hi
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
