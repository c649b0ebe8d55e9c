"""Admission: starting the requests the scheduler lets in.

The scheduler decides (``next_admission``: slots, budget, pages, the caches it may evict); this
does what starting a request takes: its documents computed or found and copied into its pages
(``DocumentKV``), or the longest cached prefix of its prompt mapped in (the prefix cache).
"""

from __future__ import annotations

from ..cache import PoolExhausted
from ..reuse.registry import get_method
from . import handoff, kv_loading
from .output import StepOutput
from .scheduler import RequestTooLarge
from .sequence import Sequence


def admit(engine, budget: int, prefill: list[Sequence], outputs: list) -> int:
    """Start waiting requests while the scheduler admits them; returns the token budget left."""
    recovery_rows = 0  # rows the step's recovery forwards start with
    kv_loading.poll(engine)
    engine.scheduler.order_arrivals(lambda s: start_work(engine, s))
    while True:
        if kv_loading.park_head(engine):  # its documents load from a tier: the next one may start
            continue
        adm = engine.scheduler.next_admission(budget, recovery_rows, engine.documents.needs)
        if adm is None:
            _fail_if_stuck(engine, outputs)
            break
        seq = adm.seq
        if seq.abandoned:  # its client has gone: nothing it would compute is read
            engine.scheduler.drop_head()
            kv_loading.abort(engine, seq)
            seq.finish(seq.finish_reason or "abort")
            outputs.append(StepOutput(seq))
            continue
        pinned = None
        if adm.documents is not None:
            try:
                pinned, computed = engine.documents.ensure(seq, adm.pages - adm.documents.missing_pages)
            except PoolExhausted:  # its missing chunks do not fit beside the running requests yet
                _fail_if_stuck(engine, outputs)
                break
            except Exception as e:
                engine.scheduler.drop_head()
                engine._fail(seq, e, outputs)
                continue
            budget -= computed
        engine.scheduler.start(adm)
        if seq.kv_import is not None:  # its prompt's KV came from a prefill instance: it decodes next step
            handoff.adopt(engine, seq, outputs)
            continue
        if pinned is not None:
            try:
                engine.documents.place(seq, pinned)
            except Exception as e:
                engine._fail(seq, e, outputs)
            finally:
                engine.documents.release(pinned)
            if seq.finished:
                continue
            if seq.recovery is not None:
                recovery_rows += len(seq.token_ids)
                budget -= engine.executor.recovery_charge(seq)
                prefill.append(seq)
                continue
        elif engine.prefix_cache is not None and seq.num_computed == 0:
            _match_prefix(engine, seq)
        if seq.prefill_start is None:
            seq.prefill_start = seq.num_computed
        prefill.append(seq)
    return budget


def start_work(engine, seq: Sequence) -> int:
    """Tokens of a step's budget starting the request takes: a recovery's charge, a placed
    request's question, else the prompt left to compute."""
    if seq.needs_documents:
        if get_method(seq.method).recovers:
            return engine.executor.recovery_charge(seq)
        return len(seq.token_ids) - seq.chunked_prompt.suffix_start
    return seq.num_pending


def _fail_if_stuck(engine, outputs: list) -> None:
    """Fail the head of the queue when no page will ever come back for it (``Scheduler.stuck``)."""
    w = engine.scheduler.waiting
    if w and not w[0].abandoned and engine.scheduler.stuck():
        seq = engine.scheduler.drop_head()
        engine._fail(seq, RequestTooLarge(f"the request does not fit the empty pool of {engine.pool.num_pages} "
                                          f"pages"), outputs)


def _match_prefix(engine, seq: Sequence) -> None:
    """Map the longest cached prefix of the prompt (short of the rows its last forward must compute)."""
    limit = len(seq.token_ids) - max(1, engine._selection_rows(seq))
    n, table = engine.prefix_cache.match(seq.plan, seq.token_ids, limit, seq.cache_salt) if limit > 0 else (0, None)
    if n:
        engine.pool.share(seq.seq_id, table, n)
        resume = getattr(engine.prefix_cache, "resume", None)  # a hybrid's: the linear state there
        if resume is not None:
            resume(seq.plan, seq.token_ids, n, seq.cache_salt, engine.pool.slot(seq.seq_id))
        seq.num_computed = n
        seq.cached_tokens = max(seq.cached_tokens, n)
