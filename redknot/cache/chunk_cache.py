"""Document (chunk) KV in the page pool, content-keyed, LRU.

A chunk's KV is computed once, at its canonical positions (right after the prompt prefix), and
kept in pool pages that the cache holds one reference on: the same memory budget, eviction and
accounting as every request's KV. An entry names the pages ([L, Hkv, pages]) and where the chunk's
first token sits in its first page, so pages a prefill wrote in place (the first one may also hold
prefix tokens) are kept as they are, without a copy.

A request that reuses a chunk at another position needs its keys rotated to that position, so it
reads the entry (`gather`) and writes relocated K and the same V into its own pages; the cached
pages are only ever read. The cache also speaks the small `get`/`put`/`contains` interface of
`ChunkStore` (dense `ChunkKV` in and out), which the recovery prefill of the head-aware methods
reads its chunks through.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .chunk_store import ChunkKV
from .pool import PagePool, PoolExhausted


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
    def __init__(self, pool: PagePool, fingerprint: str, max_bytes: int | None = None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.pool, self.fingerprint = pool, fingerprint
        self.max_pages = None if max_bytes is None else int(max_bytes // pool.bytes_per_page)
        self._entries: OrderedDict[str, ChunkPages] = OrderedDict()
        self._pages = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def num_pages(self) -> int:
        return self._pages

    def page_ids(self) -> np.ndarray:
        """Every page id the cache references, once."""
        ids = [e.pages.ravel() for e in self._entries.values()]
        return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int32)

    def stats(self) -> dict:
        return {"entries": len(self._entries), "pages": self._pages, "bytes": self._pages * self.pool.bytes_per_page,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}

    # ------------------------------------------------------------------ entries

    def lookup(self, key: str) -> ChunkPages | None:
        """The entry (most recently used from now on), or None; counts a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def peek(self, key: str) -> ChunkPages | None:
        """The entry or None, leaving order and counts as they are."""
        return self._entries.get(key)

    def insert(self, key: str, token_ids, start: int, pages: np.ndarray, offset: int) -> bool:
        """Keep pages already holding a chunk's KV (one more reference each). False when the cache
        is capped below the entry's size; an existing entry for the key stays."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        pages = np.ascontiguousarray(pages, dtype=np.int32)
        if (pages < 0).any():
            raise ValueError("a cached chunk needs every (layer, head) page of its span")
        if not self._make_room(pages.size, evict_into_pool=False):
            return False
        self.pool.retain(pages)
        self._entries[key] = ChunkPages(tuple(int(t) for t in token_ids), int(start), pages, int(offset))
        self._pages += pages.size
        return True

    def _make_room(self, n_pages: int, evict_into_pool: bool) -> bool:
        if self.max_pages is not None:
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
        _, entry = self._entries.popitem(last=False)
        self._drop(entry)

    def _drop(self, entry: ChunkPages) -> None:
        self.pool.release(entry.pages)
        self._pages -= entry.pages.size
        self.evictions += 1

    def evict(self, pages_wanted: int, keep=()) -> int:
        """Drop least recently used entries, except those keyed in ``keep`` (a request about to
        read them), until ``pages_wanted`` pages are free; returns pages freed (an entry whose
        pages a running request still maps frees nothing yet)."""
        before = self.pool.num_free_pages
        for key in [k for k in self._entries if k not in keep]:
            if self.pool.num_free_pages - before >= pages_wanted:
                break
            self._drop(self._entries.pop(key))
        return self.pool.num_free_pages - before

    def clear(self) -> None:
        while self._entries:
            self._drop_lru()

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

    # ------------------------------------------------------------------ the ChunkStore interface

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
        self._entries[key] = ChunkPages(chunk.token_ids, chunk.start, pages, 0)
        self._pages += pages.size
        return True
