"""Document (chunk) KV in the page pool, content-keyed, LRU.

A chunk's KV is computed once, at its canonical positions (right after the prompt prefix), and
kept in pool pages that the cache holds one reference on: the same memory budget, eviction and
accounting as every request's KV. An entry names the pages ([L, Hkv, pages]) and where the chunk's
first token sits in its first page, so pages a prefill wrote in place (the first one may also hold
prefix tokens) are kept as they are, without a copy.

A request that reuses a chunk at another position needs its keys rotated to that position, so it
reads the entry (`gather`) and writes relocated K and the same V into its own pages; the cached
pages are only ever read. The cache also speaks a small `get`/`put`/`contains` interface of dense
`ChunkKV` in and out (tests and tools that hold chunk K/V as tensors).

Below the pool, optional tiers (``tiers/``: CPU, disk, Redis) keep entries the pool lets go. With
the write-through policy every entry computed here is also written down at once (so a restart or
another replica finds it); with write-back only on eviction. An entry the pool evicts is written
down (no copy when the CPU tier still holds it); a ``lookup`` the pool misses asks the tiers and,
on a hit, loads the KV into fresh pool pages. A load only takes free pages and evicts no other
entry (an entry ``lookup`` returned a moment ago may not be pinned yet by its caller): with no
free pages it is a miss and the caller computes; it may take the cache past ``max_bytes`` until
the next insert, which evicts back under it.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .chunk_kv import ChunkKV
from .events import block_hash, block_removed, block_stored
from .page_refs import PageRefs
from .pool import PagePool, PoolExhausted
from .recency import tick
from .tiers import KVEntry, Layout, TierStack, plan_digest, tier_key
from .tiers.entry import dtype_name, stack_kv

log = logging.getLogger(__name__)


@dataclass
class ChunkPages:
    token_ids: tuple[int, ...]
    start: int  # canonical position of the first token
    pages: np.ndarray  # int32 [L, Hkv, n_pages], every entry a page id
    offset: int  # slot of the first token in pages[..., 0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pages(self) -> int:
        return int(self.pages.size)


class ChunkCache:
    def __init__(self, pool: PagePool, fingerprint: str, max_bytes: int | None = None,
                 tiers: TierStack | None = None, events=None):
        """``tiers``: where entries go below the pool (None: an evicted entry is gone), written
        down by its ``write_policy``: "write_through" (every new entry at once) or "write_back"
        (when the pool evicts it). ``events``: a KV event publisher; with its ``documents`` on,
        each entry's arrival and departure is announced as one block."""
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.pool, self.fingerprint = pool, fingerprint
        self.max_pages = None if max_bytes is None else int(max_bytes // pool.bytes_per_page)
        self._entries: OrderedDict[str, ChunkPages] = OrderedDict()
        self._used: dict[str, int] = {}  # key -> last use (recency.tick), shared with the prefix cache
        self._pages = 0
        self.page_refs = PageRefs(pool.num_pages)  # which pages the entries reference
        self.hits = self.misses = self.evictions = 0
        self.tiers = tiers
        self.events = events if events is not None and getattr(events, "documents", False) else None
        self.write_policy = tiers.write_policy if tiers is not None else None
        # the chunks' KV is computed under the pool's default plan (every head global, the model's
        # own windows kept): part of the tiers' key, with the dtype and paging
        self.layout = None if tiers is None else Layout(
            fingerprint, plan_digest(*pool.window_sink("default")), dtype_name(pool.dtype), pool.page_size,
            pool.head_dim, pool.num_layers, pool.num_kv_heads)
        self._pin = pool.device.type == "cuda"
        self._d2h = None  # the side stream of write-downs' device-to-host copies (CUDA)
        self.tier_hits: dict[str, int] = {}  # lookups the pool missed and a tier served, by tier
        self.tier_misses = self.tier_no_room = self.written_down = self.write_errors = self.fetch_errors = 0
        self.load_on_miss = True  # off while a TierLoader loads misses asynchronously
        self.loader_stats = None  # that loader's counters (``stats``), when there is one

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def num_pages(self) -> int:
        return self._pages

    def page_ids(self) -> np.ndarray:
        """Every page id the cache references, sorted, once each."""
        return self.page_refs.ids()

    def stats(self) -> dict:
        out = {"entries": len(self._entries), "pages": self._pages, "bytes": self._pages * self.pool.bytes_per_page,
               "hits": self.hits, "misses": self.misses, "evictions": self.evictions}
        if self.tiers is not None:
            out["tiers"] = {"hits": dict(self.tier_hits), "misses": self.tier_misses, "no_room": self.tier_no_room,
                            "written_down": self.written_down,
                            "write_errors": self.write_errors + self.tiers.down_errors,
                            "write_dropped": self.tiers.downs_dropped,
                            "fetch_errors": self.fetch_errors,
                            **({"loader": self.loader_stats.as_dict()} if self.loader_stats is not None else {}),
                            "write_policy": self.write_policy, **self.tiers.info()}
        return out

    # ------------------------------------------------------------------ entries

    def lookup(self, key: str) -> ChunkPages | None:
        """The entry (most recently used from now on), or None; counts a hit or a miss. A miss
        asks the tiers below the pool, and an entry one holds comes back into pool pages."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return self._load(key)
        self.hits += 1
        self._entries.move_to_end(key)
        self._used[key] = tick()
        return entry

    def peek(self, key: str) -> ChunkPages | None:
        """The entry or None, leaving order and counts as they are."""
        return self._entries.get(key)

    def insert(self, key: str, token_ids, start: int, pages: np.ndarray, offset: int) -> bool:
        """Keep pages already holding a chunk's KV (one more reference each). False when the cache
        is capped below the entry's size; an existing entry for the key stays."""
        if key in self._entries:
            self._entries.move_to_end(key)
            self._used[key] = tick()
            return True
        pages = np.ascontiguousarray(pages, dtype=np.int32)
        if (pages < 0).any():
            raise ValueError("a cached chunk needs every (layer, head) page of its span")
        entry = ChunkPages(tuple(int(t) for t in token_ids), int(start), pages, int(offset))
        if self.write_policy == "write_through":
            self._write_down(key, entry, through=True)
        if not self._make_room(pages.size, evict_into_pool=False):
            return False
        self.pool.retain(pages)
        self._add(key, entry)
        return True

    def adopt(self, key: str, entry: ChunkPages, tier: str = "loader") -> None:
        """Keep an entry whose pages a tier load filled (the cache takes their one reference)."""
        self._add(key, entry)
        self.tier_hits[tier] = self.tier_hits.get(tier, 0) + 1

    def _add(self, key: str, entry: ChunkPages) -> None:
        self._entries[key] = entry
        self._used[key] = tick()
        self._pages += entry.pages.size
        self.page_refs.add(entry.pages)
        if self.events is not None:
            self.events.record(block_stored([block_hash(key)], None, entry.token_ids, entry.num_tokens))

    def _make_room(self, n_pages: int, evict_into_pool: bool) -> bool:
        if self.max_pages is not None:
            while self._pages > self.max_pages:  # what tier loads took past the cap
                self._drop_lru()
            if n_pages > self.max_pages:
                return False
            while self._pages + n_pages > self.max_pages:
                self._drop_lru()
        if evict_into_pool:
            while self.pool.num_free_pages < n_pages and self._entries:
                self._drop_lru()
            if self.pool.num_free_pages < n_pages:
                return False
        return True

    def _drop_lru(self) -> None:
        key, entry = self._entries.popitem(last=False)
        self._drop(key, entry)

    def _drop(self, key: str, entry: ChunkPages, write_down: bool = True) -> None:
        self._used.pop(key, None)
        if write_down:
            self._write_down(key, entry)
        if self.events is not None:
            self.events.record(block_removed([block_hash(key)]))
        self.pool.release(entry.pages)
        self.page_refs.remove(entry.pages)
        self._pages -= entry.pages.size
        self.evictions += 1

    def oldest_use(self, keep=()) -> int | None:
        """Last use of the least recently used entry not keyed in ``keep`` (None: none)."""
        key = next((k for k in self._entries if k not in keep), None)
        return None if key is None else self._used.get(key, -1)

    def evict_one(self, keep=()) -> int:
        """Drop the least recently used entry not keyed in ``keep``; returns pages freed (0 while
        another holder still maps them)."""
        key = next((k for k in self._entries if k not in keep), None)
        if key is None:
            return 0
        before = self.pool.num_free_pages
        self._drop(key, self._entries.pop(key))
        return self.pool.num_free_pages - before

    def evict(self, pages_wanted: int, keep=()) -> int:
        """Drop least recently used entries, except those keyed in ``keep`` (a request about to
        read them), until ``pages_wanted`` pages are free; returns pages freed (an entry whose
        pages a running request still maps frees nothing yet)."""
        before = self.pool.num_free_pages
        for key in [k for k in self._entries if k not in keep]:
            if self.pool.num_free_pages - before >= pages_wanted:
                break
            self._drop(key, self._entries.pop(key))
        return self.pool.num_free_pages - before

    def clear(self) -> None:
        """Drop every entry from the pool (the tiers below keep what they hold; nothing is written
        down: a cold start stays cold in the pool)."""
        while self._entries:
            key, entry = self._entries.popitem(last=False)
            self._drop(key, entry, write_down=False)

    def persist(self) -> int:
        """Write every pool entry down to the tiers (before a shutdown, with write-back); returns
        entries written."""
        if self.tiers is None:
            return 0
        before = self.written_down
        for key, entry in list(self._entries.items()):
            self._write_down(key, entry, through=True)
        self.tiers.flush()
        return self.written_down - before

    # ------------------------------------------------------------------ tiers

    def _write_down(self, key: str, entry: ChunkPages, through: bool = False) -> None:
        """Keep an entry's KV in the tiers (unless the CPU tier has it): its pages are gathered on
        the device, copied to a pinned host buffer on a side stream (CUDA; on the CPU a plain
        copy) and handed to the tiers' down thread, which checksums and stores them; the step loop
        never waits for the copy. ``through``: a new entry, written to every tier. Never raises:
        a failure or a full queue is counted and the entry is only missing from the tiers."""
        if self.tiers is None:
            return
        tkey = tier_key(key, self.layout)
        try:
            if self.tiers.has(tkey):
                return
            payload, event = self._to_host(entry)
            build = functools.partial(KVEntry.from_payload, tkey, key, self.layout, entry.token_ids, entry.start,
                                      payload)
            if self.tiers.store_later(tkey, build, event, through):
                self.written_down += 1
        except Exception as e:  # e.g. no host memory left: the pool still evicts
            self.write_errors += 1
            log.warning("chunk cache: could not write %s down to the tiers: %s", key, e)

    def _to_host(self, entry: ChunkPages) -> tuple[torch.Tensor, object]:
        """The entry's payload bytes on the host (uint8) and the event its copy ends with (None:
        already there). The device gather is a new tensor, so the pages may be reused at once."""
        kv = stack_kv(*self.gather(entry), self.layout)
        if not kv.is_cuda:
            return kv.reshape(-1).view(torch.uint8), None
        if self._d2h is None:
            self._d2h = torch.cuda.Stream(kv.device)
        host = torch.empty(kv.numel() * kv.element_size(), dtype=torch.uint8, pin_memory=True)
        self._d2h.wait_stream(torch.cuda.current_stream(kv.device))
        with torch.cuda.stream(self._d2h):
            host.view(kv.dtype).view(kv.shape).copy_(kv, non_blocking=True)
        kv.record_stream(self._d2h)  # its memory is not reused before the copy has read it
        event = torch.cuda.Event()
        event.record(self._d2h)
        return host, event

    def _load(self, key: str) -> ChunkPages | None:
        """The entry from the tiers, loaded into fresh pool pages and cached; None on a miss, a
        rejected entry (the tier dropped it), or too few free pages."""
        if self.tiers is None or not self.load_on_miss:
            return None
        try:
            got = self.tiers.fetch(tier_key(key, self.layout), self.layout)
        except Exception as e:  # a tier bug must cost a recompute, not the request
            self.fetch_errors += 1
            log.warning("chunk cache: tier fetch of %s failed: %s", key, e)
            return None
        if got is None:
            self.tier_misses += 1
            return None
        stored, tier = got
        h = stored.header
        if h.chunk_key != key:  # the tier key matched but the entry names another chunk
            log.warning("chunk cache: tier entry for %s names chunk %s; recomputing", key, h.chunk_key)
            self.tier_misses += 1
            return None
        L, hkv, ps = self.pool.num_layers, self.pool.num_kv_heads, self.pool.page_size
        n_pages = -(-h.n_tokens // ps)
        if self.pool.num_free_pages < L * hkv * n_pages or (self.max_pages is not None
                                                            and L * hkv * n_pages > self.max_pages):
            self.tier_no_room += 1  # no free pages, or larger than the cache may ever hold
            return None
        pages = self.pool.allocate(L * hkv * n_pages).reshape(L, hkv, n_pages)
        idx = torch.from_numpy(pages.astype(np.int64)).to(self.pool.device)
        pad = n_pages * ps - h.n_tokens
        # one host-to-device copy of the whole payload (pinned on CUDA), then K and V are views of it
        kv = stored.payload.to(self.pool.device, non_blocking=True).view(self.pool.dtype)
        kv = kv.view(L, hkv, 2, h.n_tokens, self.pool.head_dim)
        for i, dst in enumerate((self.pool.k_pages, self.pool.v_pages)):
            x = torch.nn.functional.pad(kv[:, :, i], (0, 0, 0, pad))
            dst[idx] = x.view(L, hkv, n_pages, ps, self.pool.head_dim)
        entry = ChunkPages(h.token_ids, h.start, pages, 0)
        self._add(key, entry)
        self.tier_hits[tier] = self.tier_hits.get(tier, 0) + 1
        return entry

    # ------------------------------------------------------------------ K/V

    def gather(self, entry: ChunkPages) -> tuple[torch.Tensor, torch.Tensor]:
        """The entry's K and V as [L, n_tokens, Hkv, D] (keys rotated at the canonical positions)."""
        idx = torch.from_numpy(entry.pages.astype(np.int64)).to(self.pool.device)
        L, h, n_pages = entry.pages.shape
        ps, d = self.pool.page_size, self.pool.head_dim
        span = slice(entry.offset, entry.offset + entry.num_tokens)

        def read(pages: torch.Tensor) -> torch.Tensor:
            return pages[idx].view(L, h, n_pages * ps, d)[:, :, span].transpose(1, 2)

        return read(self.pool.k_pages), read(self.pool.v_pages)

    def gather_many(self, entries: list[ChunkPages]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of several entries, their tokens one after another, as [L, sum of n_tokens,
        Hkv, D]: one read of just their tokens' rows, whatever their number (a request naming a
        hundred short documents places them in one copy, not a hundred; short entries share pages,
        so reading whole pages would read each page once per entry)."""
        if len(entries) == 1:
            return self.gather(entries[0])
        ps, d = self.pool.page_size, self.pool.head_dim
        rows = []
        for e in entries:  # [L, Hkv, n]: each token's row in the pool, page * page_size + slot
            slot = np.arange(e.offset, e.offset + e.num_tokens)
            rows.append(e.pages[:, :, slot // ps].astype(np.int64) * ps + slot % ps)
        idx = torch.from_numpy(np.concatenate(rows, axis=2)).to(self.pool.device)

        def read(pool_pages: torch.Tensor) -> torch.Tensor:
            return pool_pages.view(-1, d)[idx].transpose(1, 2)

        return read(self.pool.k_pages), read(self.pool.v_pages)

    # ------------------------------------------------------------------ dense ChunkKV in and out

    def contains(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> ChunkKV | None:
        entry = self.lookup(key)
        if entry is None:
            return None
        k, v = self.gather(entry)
        return ChunkKV(entry.token_ids, entry.start, k, v, fingerprint=self.fingerprint)

    def put(self, key: str, chunk: ChunkKV) -> bool:
        """Copy a dense chunk into fresh pages (from its first slot). False when the pool or the
        cap leaves no room even after evicting older entries."""
        if key in self._entries:
            return True
        L, n, h, d = chunk.k.shape
        ps = self.pool.page_size
        n_pages = -(-n // ps)
        if not self._make_room(L * h * n_pages, evict_into_pool=True):
            return False
        try:
            flat = self.pool.allocate(L * h * n_pages)
        except PoolExhausted:
            return False
        pages = flat.reshape(L, h, n_pages)
        idx = torch.from_numpy(pages.astype(np.int64)).to(self.pool.device)
        pad = n_pages * ps - n
        for src, dst in ((chunk.k, self.pool.k_pages), (chunk.v, self.pool.v_pages)):
            x = torch.nn.functional.pad(src.to(dst.device, dst.dtype), (0, 0, 0, 0, 0, pad))
            dst[idx] = x.view(L, n_pages, ps, h, d).permute(0, 3, 1, 2, 4)
        entry = ChunkPages(chunk.token_ids, chunk.start, pages, 0)
        self._add(key, entry)
        if self.write_policy == "write_through":
            self._write_down(key, entry, through=True)
        return True
