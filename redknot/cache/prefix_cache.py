"""Automatic prefix caching over the page pool: full pages of prompt tokens, content-hashed.

A prompt's page-sized blocks are keyed by a hash chain (block k's key covers every token of
blocks 0..k and the model fingerprint and head plan), so a key names one exact prefix. The
cache holds one pool reference on each block's pages ([L, Hkv] page ids, -1 where the plan's
local heads had already dropped the page); a request whose prompt starts with cached blocks maps
those pages into its table read-only (`PagePool.share`) and computes only the rest. Pages are
never written once cached: a sequence only ever appends past its shared full pages.

Eviction is LRU over blocks and only ever drops the cache's own reference, so a page in use by a
running sequence stays where it is until that sequence frees it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..visibility import kept_page_mask
from .events import all_blocks_cleared, block_hash, block_removed, block_stored
from .page_refs import PageRefs
from .pool import PagePool
from .recency import tick


def block_keys(salt: str, token_ids, page_size: int) -> list[bytes]:
    """Hash-chain keys of the full page-sized blocks of ``token_ids``."""
    ids = np.asarray(token_ids, dtype=np.int64)
    keys, prev = [], hashlib.sha256(salt.encode()).digest()
    for b in range(len(ids) // page_size):
        prev = hashlib.sha256(prev + ids[b * page_size:(b + 1) * page_size].tobytes()).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    def __init__(self, pool: PagePool, fingerprint: str, events=None):
        """``events``: where block stored/removed events go (``events.ZmqEventPublisher``), or None."""
        self.pool, self.fingerprint, self.events = pool, fingerprint, events
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()  # key -> int32 [L, Hkv] pages
        self._used: dict[bytes, int] = {}  # key -> last use (recency.tick), shared with the chunk cache
        self._pages = 0  # page references the blocks hold
        self.page_refs = PageRefs(pool.num_pages)  # which pages the blocks reference
        self.hits = self.queries = 0  # prompt tokens served from the cache / looked up

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, plan: str, token_ids, salt: str | None = None) -> list[bytes]:
        ns = f"{self.fingerprint}/{plan}" if salt is None else f"{self.fingerprint}/{plan}/salt:{salt}"
        return block_keys(ns, token_ids, self.pool.page_size)

    def match(self, plan: str, token_ids, limit: int, salt: str | None = None) -> tuple[int, np.ndarray | None]:
        """Longest cached prefix of at most ``limit`` tokens that a sequence under ``plan`` can
        continue from: (tokens, int32 [L, Hkv, pages]) or (0, None).

        A local head continuing at position n needs its sink pages and the pages within its window
        of n; a cached block where it had already dropped one of those cannot serve that length."""
        ps = self.pool.page_size
        keys = self._keys(plan, token_ids[: (limit // ps) * ps], salt)
        blocks = []
        for k in keys:
            pages = self._blocks.get(k)
            if pages is None:
                break
            blocks.append(pages)
        self.queries += len(token_ids)
        window, sink = self.pool.window_sink(plan)
        for m in range(len(blocks), 0, -1):
            table = np.stack(blocks[:m], axis=-1)  # [L, Hkv, m]
            n = m * ps
            need = kept_page_mask(n, window, sink, ps)  # [L, Hkv, m]
            if (table[need] >= 0).all():
                for k in reversed(keys[:m]):  # parents end most recent: evicted after their children
                    self._blocks.move_to_end(k)
                    self._used[k] = tick()
                self.hits += n
                return n, table
        return 0, None

    def insert(self, plan: str, token_ids, table: np.ndarray, salt: str | None = None) -> None:
        """Cache the full blocks of ``token_ids`` whose pages ``table`` ([L, Hkv, >= blocks]) holds
        (``salt``: the requests' cache namespace; only the same salt matches them)."""
        keys = self._keys(plan, token_ids, salt)
        new = []
        for b, k in enumerate(keys):
            if k in self._blocks:
                self._blocks.move_to_end(k)
                self._used[k] = tick()
                continue
            pages = table[:, :, b].copy()
            if (pages < 0).all():
                continue
            self.pool.retain(pages)
            self.page_refs.add(pages)
            self._blocks[k] = pages
            self._used[k] = tick()
            self._pages += int((pages >= 0).sum())
            new.append(b)
        if self.events is not None and new:
            self._announce(keys, new, token_ids)

    def _announce(self, keys: list[bytes], new: list[int], token_ids) -> None:
        """One BlockStored per run of consecutive new blocks, linked to the block before it."""
        ps = self.pool.page_size
        runs = [[new[0]]]
        for b in new[1:]:
            if b == runs[-1][-1] + 1:
                runs[-1].append(b)
            else:
                runs.append([b])
        for run in runs:
            parent = block_hash(keys[run[0] - 1]) if run[0] else None
            tokens = list(token_ids[run[0] * ps:(run[-1] + 1) * ps])
            self.events.record(block_stored([block_hash(keys[b]) for b in run], parent, tokens, ps))

    def evict(self, pages_wanted: int, keep=()) -> int:
        """Drop least recently used blocks until ``pages_wanted`` pages are free; returns pages freed.
        ``keep`` names chunk-cache entries (the caches' common eviction call): no prefix block is one."""
        before = self.pool.num_free_pages
        gone = []
        while self._blocks and self.pool.num_free_pages - before < pages_wanted:
            key, pages = self._blocks.popitem(last=False)
            self._used.pop(key, None)
            self._drop(pages)
            gone.append(block_hash(key))
        if self.events is not None and gone:
            self.events.record(block_removed(gone))
        return self.pool.num_free_pages - before

    def evict_one(self, keep=()) -> int:
        """Drop the least recently used block; returns pages freed (0 while another holder maps them)."""
        if not self._blocks:
            return 0
        before = self.pool.num_free_pages
        key, pages = self._blocks.popitem(last=False)
        self._used.pop(key, None)
        self._drop(pages)
        if self.events is not None:
            self.events.record(block_removed([block_hash(key)]))
        return self.pool.num_free_pages - before

    def oldest_use(self, keep=()) -> int | None:
        """Last use of the least recently used block (None: none); ``keep`` names chunk-cache
        entries, never a block."""
        key = next(iter(self._blocks), None)
        return None if key is None else self._used.get(key, -1)

    def clear(self) -> None:
        self._used.clear()
        while self._blocks:
            self._drop(self._blocks.popitem()[1])
        if self.events is not None:
            self.events.record(all_blocks_cleared())

    def _drop(self, pages: np.ndarray) -> None:
        self.pool.release(pages)
        self.page_refs.remove(pages)
        self._pages -= int((pages >= 0).sum())

    def page_ids(self) -> np.ndarray:
        """Every page id the cache references, sorted, once each."""
        return self.page_refs.ids()

    def num_pages(self) -> int:
        """Page references the cached blocks hold."""
        return self._pages
