"""The engine's side of asynchronous tier loads: which requests wait for their documents' KV.

Before admitting the head of the queue, a request reading documents that the pool lacks is parked
(``Scheduler.park``: status WAITING_FOR_KV) while the ``TierLoader`` beside the chunk cache fetches
them; the requests behind it start and the running ones keep decoding. Each step polls the
loader; a finished load (hit, partial or miss) sends its request back to the head of the queue,
where admission finds its documents in the pool (or computes what no tier held). A request is
parked once: what is still missing after its load is computed.
"""

from __future__ import annotations

from ..cache.tier_loader import TierLoader
from .sequence import Sequence

IDLE_WAIT_S = 0.005  # how long a step with nothing else to run waits for a read


def poll(engine) -> None:
    """Requests whose loads are done go back to the head of the queue."""
    loader = engine.kv_loader
    if loader is None or not len(loader):
        return
    sched = engine.scheduler
    idle = not sched.running and not sched.waiting
    for seq, private in loader.poll(IDLE_WAIT_S if idle else 0.0):
        if seq.reuse is not None:
            seq.reuse.loaded = private
        sched.unpark(seq)


def park_head(engine) -> bool:
    """Park the head of the queue while the loader fetches the documents it reads that the pool
    lacks (the heads its plan can see, when no retrieval head selects pages); False when it has
    nothing to wait for."""
    sched, loader = engine.scheduler, engine.kv_loader
    if loader is None or not sched.waiting:
        return False
    seq = sched.waiting[0]
    r = seq.reuse
    if seq.abandoned or r is None or r.done or r.tiers_tried or not seq.needs_documents:
        return False
    r.tiers_tried = True
    wants = engine.documents.tier_wants(seq, partial=engine.selection is None and loader.per_head)
    if not wants:
        return False
    loader.begin(seq, wants)
    sched.park(seq)
    return True


def abort(engine, seq: Sequence) -> None:
    """A request leaving for good: its load stops and what it reserved goes back."""
    if engine.kv_loader is not None:
        engine.kv_loader.abort(seq)
    engine.documents.drop_loaded(seq)


def build_loader(chunk_cache, offload, old: TierLoader | None) -> TierLoader | None:
    """The loader beside a (new) chunk cache, when tiers are configured with ``async_loads``."""
    if old is not None:
        old.close()
    if chunk_cache.tiers is None or offload is None or not offload.async_loads:
        return None
    chunk_cache.load_on_miss = False  # a pool miss waits for the loader instead of loading in admission
    return TierLoader(chunk_cache, offload.load_timeout_s, offload.per_head_fetch)
