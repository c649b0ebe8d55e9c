"""What the engine reports and how its pool is rebuilt: bytes in use, capacity, stats, resizing."""

from __future__ import annotations

import numpy as np
import torch


def kv_bytes(engine) -> int:
    """Bytes of KV pages in use (shared pages once), cached prefixes included."""
    return (engine.pool.num_pages - engine.pool.num_free_pages) * engine.pool.bytes_per_page


def request_kv_bytes(engine, outputs=()) -> int:
    """Bytes of the pages requests hold: the running ones, and those that finished in ``outputs``
    counted at their last length (their pages are already back)."""
    pages = sum(engine.pool.pages_held(s.seq_id) for s in engine.running)
    for o in outputs:
        if o.seq.finished and o.seq not in engine.running:
            pages += o.seq.pages_at_finish
    return pages * engine.pool.bytes_per_page


def pages_for(engine, seq) -> int:
    """Pages the request holds at its largest (its plan resolved first): ``Scheduler.pages_for``."""
    engine.prepare_plan(seq)
    return engine.scheduler.pages_for(seq)


def pool_pages_for(engine, seq) -> int:
    """The smallest pool that admits ``seq`` on its own (its plan resolved first): what a harness
    that runs one request at a time sizes its pool by (``resize_pool``)."""
    engine.prepare_plan(seq)
    return engine.scheduler.pool_pages_for(seq)


def capture_graphs(engine, max_len: int | None = None) -> int:
    """Capture the decode CUDA graphs for contexts up to ``max_len`` (default 8192) now."""
    return engine.runner.capture(min(max_len or 8192, engine.max_model_len))


def capacity(engine, lengths=(8192, 32768, 131072), new_tokens: int = 256) -> dict:
    """Sessions of each context length (prompt + ``new_tokens``) the whole pool holds at once, per
    head plan: the analytic bound admission works against."""
    out = {}
    pool = engine.pool
    for plan in pool.plans:
        if plan == "default" or plan.endswith("+sel"):  # selected twins hold what their selection keeps
            continue
        per = {}
        for n in lengths:
            if n + new_tokens > engine.max_model_len:
                continue
            pages = pool.peak_pages(n + new_tokens, 1, plan)
            per[n] = {"pages_per_session": pages, "bytes_per_session": pages * pool.bytes_per_page,
                      "sessions": pool.num_pages // pages}
        out[plan] = per
    return out


def stats(engine) -> dict:
    pc = engine.prefix_cache
    return {"running": len(engine.running), "waiting": len(engine.waiting), "preemptions": engine.num_preemptions,
            "pool_pages": engine.pool.occupancy(), "page_bytes": engine.pool.bytes_per_page,
            "kv_bytes": kv_bytes(engine), "prefix_cache_pages": pc.num_pages() if pc else 0,
            "prefix_cache_hit_tokens": pc.hits if pc else 0, "chunk_cache": engine.chunk_cache.stats(),
            "held_pages": held_pages(engine), "leases": engine.leases.stats()}


def clear_caches(engine) -> None:
    """Drop every cached prefix and chunk (benchmarks measure cold starts with this)."""
    engine.chunk_cache.clear()
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()


def held_pages(engine) -> int:
    """Pages held beyond what the caches reference: by requests and by leases (0 when idle)."""
    cached = engine.chunk_cache.page_refs.mask()
    if engine.prefix_cache is not None:
        cached |= engine.prefix_cache.page_refs.mask()
    cached = int(np.count_nonzero(cached))
    return engine.pool.num_pages - engine.pool.num_free_pages - cached


def idle(engine) -> bool:
    """No request or lease holds a page: every page is free or referenced by the caches only."""
    return not engine.has_unfinished() and held_pages(engine) == 0


def resize_pool(engine, num_pages: int) -> None:
    """Rebuild the page pool with ``num_pages`` pages (only while nothing runs)."""
    if engine.has_unfinished():
        raise RuntimeError("resize_pool while requests are running")
    engine._ahead = None  # a finished request's unneeded next step
    plans = {name: engine.pool.head_window_sink(name) for name in engine.pool.plans}
    clear_caches(engine)
    engine.pool = engine.runner = None  # the old pool's memory goes before the new one is allocated
    engine._build(num_pages, plans)
    if engine.device.type == "cuda":  # the old pool's memory back to the device, for other processes
        torch.cuda.empty_cache()
