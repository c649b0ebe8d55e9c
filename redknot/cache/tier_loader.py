"""Asynchronous loads of document KV from the tiers below the pool into pool pages.

A request whose documents are below the pool waits (the scheduler parks it) while a job reads
their entries on a background thread (disk seeks, Redis ``GETRANGE``, CPU slices; into pinned host
buffers where CUDA is available). The step loop polls: when a job's reads are done it takes free
pool pages for each entry and starts the host-to-device copy (on a side stream, an event marks its
end; on the CPU a plain copy), and when the copies are done the entries join the chunk cache (or,
for an entry fetched for only some heads, stay with the request) and the request goes back to the
queue to be admitted as a hit. Nothing here fails a request: a miss, a corrupt entry, a tier
error, a load past ``timeout_s`` or a pool without free pages leaves the document to be computed.

``heads`` of a key: the flat (layer * Hkv + head) indices the request can see (None: all). An
entry fetched for some heads only is placed into pages for every head, the others zeroed: the
pool keeps one page list per (layer, KV head) and chunk entries hold every head, so such an entry
is private to its request (never shared through the cache, whose readers may need other heads).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from .chunk_cache import ChunkCache, ChunkPages
from .tiers import tier_key

log = logging.getLogger(__name__)


@dataclass
class LoaderStats:
    jobs: int = 0
    loaded: int = 0  # entries placed into pool pages
    partial: int = 0  # of which fetched for some heads only
    missed: int = 0  # keys no tier held (or a rejected entry)
    failed: int = 0  # reads that raised
    timed_out: int = 0  # jobs given up after timeout_s
    no_room: int = 0  # entries dropped for want of free pages
    aborted: int = 0
    bytes_fetched: int = 0  # payload bytes read from the tiers
    bytes_whole: int = 0  # payload bytes the same entries hold for every head

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(eq=False)
class LoadJob:
    owner: object  # the request
    wants: list  # (chunk key, heads or None)
    started: float = field(default_factory=time.monotonic)
    future: Future | None = None
    copies: list = field(default_factory=list)  # (chunk key, ChunkPages, its tier or None) awaiting their copy
    event: object = None  # the side stream's event after the last copy (CUDA)
    private: dict = field(default_factory=dict)  # chunk key -> ChunkPages held for the request only


class TierLoader:
    def __init__(self, cache: ChunkCache, timeout_s: float = 10.0, per_head: bool = True, threads: int = 1):
        """``per_head``: callers may ask for some heads of an entry (``begin``'s heads)."""
        self.cache, self.pool, self.timeout_s, self.per_head = cache, cache.pool, timeout_s, per_head
        self.stats = LoaderStats()
        cache.loader_stats = self.stats
        self._exec = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-tier-loader")
        self._jobs: list[LoadJob] = []
        self._wake = threading.Event()
        self._stream = torch.cuda.Stream(self.pool.device) if self.pool.device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self._jobs)

    def begin(self, owner, wants: list) -> LoadJob:
        """Start reading ``wants`` ((chunk key, heads or None), none of them in the pool) for ``owner``."""
        job = LoadJob(owner, list(wants))
        job.future = self._exec.submit(self._read, job.wants)
        job.future.add_done_callback(lambda _: self._wake.set())
        self._jobs.append(job)
        self.stats.jobs += 1
        return job

    def _read(self, wants: list) -> list:
        """(chunk key, verified KVEntry or None) per want; on the loader thread, never raises."""
        tiers, layout, out = self.cache.tiers, self.cache.layout, []
        for key, heads in wants:
            try:
                got = tiers.fetch(tier_key(key, layout), layout, heads)
            except Exception as e:  # a tier bug costs a recompute, not the request
                log.warning("tier loader: fetch of %s failed: %s", key, e)
                out.append((key, "failed", None))
                continue
            ok = got is not None and got[0].header.chunk_key == key
            out.append((key, got[0] if ok else None, got[1] if ok else None))
        return out

    def poll(self, wait_s: float = 0.0) -> list[tuple[object, dict]]:
        """Advance the jobs; returns (owner, private entries) of those finished (loaded or not).
        ``wait_s``: block up to that long for a read to finish when nothing else would run."""
        if wait_s > 0 and self._jobs and not any(j.future.done() for j in self._jobs):
            self._wake.wait(wait_s)
        self._wake.clear()
        done = []
        now = time.monotonic()
        for job in list(self._jobs):
            if job.event is None and not job.copies and job.future.done():
                self._place(job)
            if job.copies and (job.event is None or job.event.query()):
                self._finish(job)
                done.append(job)
            elif not job.copies and job.future.done():
                done.append(job)
            elif now - job.started > self.timeout_s and not job.copies:
                self.stats.timed_out += 1  # its late reads are dropped with the job
                job.future.cancel()
                done.append(job)
        for job in done:
            self._jobs.remove(job)
        return [(j.owner, j.private) for j in done]

    def abort(self, owner) -> dict:
        """Drop ``owner``'s job (its reserved pages go back); returns nothing to place."""
        for job in list(self._jobs):
            if job.owner is owner:
                self._jobs.remove(job)
                job.future.cancel()
                if job.event is not None:
                    job.event.synchronize()  # the pages are written until the copy ends
                for _, entry, _ in job.copies:
                    self.pool.release(entry.pages)
                self.stats.aborted += 1
        return {}

    # ------------------------------------------------------------------ placing

    def _place(self, job: LoadJob) -> None:
        """Free pages for each read entry and its host-to-device copy (side stream on CUDA)."""
        for key, stored, tier in job.future.result():
            if isinstance(stored, str):
                self.stats.failed += 1
                continue
            if stored is None or key in self.cache:
                self.stats.missed += stored is None
                continue
            h, lay = stored.header, stored.header.layout
            n_pages = -(-h.n_tokens // self.pool.page_size)
            total = lay.heads * n_pages
            if self.pool.num_free_pages < total:
                self.stats.no_room += 1
                continue
            pages = self.pool.allocate(total).reshape(lay.num_layers, lay.num_kv_heads, n_pages)
            self._copy(stored, pages)
            self.stats.loaded += 1
            self.stats.bytes_fetched += stored.payload.numel()
            self.stats.bytes_whole += h.payload_bytes
            self.stats.partial += stored.heads is not None
            job.copies.append((key, ChunkPages(h.token_ids, h.start, pages, 0), tier if stored.heads is None else None))
        if job.copies and self._stream is not None:
            job.event = torch.cuda.Event()
            job.event.record(self._stream)

    def _copy(self, stored, pages: np.ndarray) -> None:
        """Write an entry's K and V (all its heads, or the heads it holds, zeros in the others)."""
        h, pool = stored.header, self.pool
        L, hkv, n_pages = pages.shape
        ps, d = pool.page_size, pool.head_dim
        held = np.arange(L * hkv) if stored.heads is None else np.asarray(stored.heads, np.int64)
        dev = pool.device
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))  # pages freed by earlier work are free on device too
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx, torch.inference_mode():
            flat = torch.from_numpy(pages.reshape(L * hkv, n_pages).astype(np.int64)).to(dev, non_blocking=True)
            kv = stored.payload.to(dev, non_blocking=True).view(pool.dtype).view(len(held), 2, h.n_tokens, d)
            kv = torch.nn.functional.pad(kv, (0, 0, 0, n_pages * ps - h.n_tokens)).view(len(held), 2, n_pages, ps, d)
            idx = flat[torch.from_numpy(held).to(dev, non_blocking=True)]
            pool.k_pages[idx] = kv[:, 0]
            pool.v_pages[idx] = kv[:, 1]
            if len(held) < L * hkv:  # pages of heads the request cannot see: zeros, never garbage
                rest = np.setdiff1d(np.arange(L * hkv), held)
                ridx = flat[torch.from_numpy(rest).to(dev, non_blocking=True)]
                pool.k_pages[ridx] = 0
                pool.v_pages[ridx] = 0

    def _finish(self, job: LoadJob) -> None:
        for key, entry, shared in job.copies:  # shared: the tier it came from (None: some heads only)
            if shared and key not in self.cache:
                self.cache.adopt(key, entry, shared)  # the cache takes the pages' reference
            elif shared:
                self.pool.release(entry.pages)  # computed meanwhile: the cache's copy wins
            else:
                job.private[key] = entry  # the request holds the reference until it places it
        job.copies = []

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)

