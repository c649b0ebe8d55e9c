"""The KV page pool: one pool of fixed-size pages for all layers and KV heads.

Layout and visibility rule: docs/segpaged.md. In short, a page belongs to one (sequence, layer,
KV head) and holds logical page `lp`, i.e. positions `[lp*page_size, (lp+1)*page_size)`. A global
head keeps every page; a local head keeps its sink pages and the pages that still intersect its
window, so its page count stays bounded however long the sequence grows.

Bookkeeping lives on the host in numpy (free stack, reference counts, one `[L, Hkv, cap]` table
per sequence); only `k_pages`/`v_pages` and the per-batch block tables live on the device. Every
operation is vectorised over (layer, head, page); Python only loops over sequences.

Retrieval heads: the pool stores by window and sink only. A head whose selected set may reach any
earlier token must be given `window = GLOBAL_WINDOW` here, or its pages would be trimmed.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np
import torch

from ..config import GLOBAL_WINDOW


class PoolExhausted(RuntimeError):
    """Not enough free pages; the failed call allocated nothing."""


class PagesNeeded(NamedTuple):
    peak: int  # pages `ensure` takes from the free list (must be free before the step)
    kept: int  # net pages still held once `trim` ran (peak minus what trim gives back)


class _Seq:
    __slots__ = ("table", "length")

    def __init__(self, table: np.ndarray):
        self.table = table  # int32 [L, Hkv, cap], -1 = not stored; cap >= ceil(length/page_size)
        self.length = 0


def _cdiv(a, b):
    return -(-a // b)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, head_dim: int, window, sink,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        window = np.asarray(torch.as_tensor(window).cpu(), dtype=np.int64)
        sink = np.asarray(torch.as_tensor(sink).cpu(), dtype=np.int64)
        if window.ndim != 2 or window.shape != sink.shape:
            raise ValueError(f"window and sink must both be [L, Hkv]; got window {window.shape}, "
                             f"sink {sink.shape}")
        if (window < 1).any():
            raise ValueError("window must be >= 1 for every head (a query always sees itself)")
        if (sink < 0).any():
            raise ValueError("sink must be >= 0 for every head")
        if num_pages < 1 or page_size < 1 or head_dim < 1:
            raise ValueError(f"num_pages, page_size, head_dim must be >= 1; got "
                             f"{num_pages}, {page_size}, {head_dim}")
        self.num_pages, self.page_size, self.head_dim = num_pages, page_size, head_dim
        self.num_layers, self.num_kv_heads = window.shape
        self.window, self.sink = window, sink
        self.is_global = window >= GLOBAL_WINDOW  # [L, Hkv]
        self._sink_pages = _cdiv(sink, page_size)  # logical pages holding a sink token
        self.device = torch.device(device)
        self.dtype = dtype
        self.k_pages = torch.zeros(num_pages, page_size, head_dim, dtype=dtype, device=self.device)
        self.v_pages = torch.zeros_like(self.k_pages)
        # Free list as a stack: the top `_nfree` entries of `_free` are free page ids.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._nfree = num_pages
        self._ref = np.zeros(num_pages, dtype=np.int32)
        # Flat (layer, head) index of each page's owner head, for occupancy by head class.
        self._owner = np.zeros(num_pages, dtype=np.int32)
        self._seqs: dict[int, _Seq] = {}

    # ------------------------------------------------------------------ capacity

    @property
    def num_free_pages(self) -> int:
        return self._nfree

    @property
    def bytes_per_page(self) -> int:
        """Device bytes of one page, K and V together."""
        return 2 * self.page_size * self.head_dim * self.k_pages.element_size()

    def _kept_pages(self, n: int) -> np.ndarray:
        """[L, Hkv] pages a private sequence of length n holds after trim."""
        total = _cdiv(n, self.page_size)
        dead = np.maximum(0, self._dead_end(n) - self._sink_pages)
        return total - dead

    def _dead_end(self, n: int) -> np.ndarray:
        """[L, Hkv]: pages lp < this (and past the sinks) are dead for a next query at p = n.

        lp is dead iff its last position (lp+1)*ps - 1 < n - W + 1, i.e. lp < floor((n-W+1)/ps).
        """
        return np.maximum(0, (n - self.window + 1) // self.page_size)

    def pages_needed(self, new_len: int, old_len: int = 0) -> PagesNeeded:
        """Pages to grow a (trimmed, unshared) sequence from old_len to new_len, over all heads.

        `peak` is what `ensure` allocates: every head gets pages for all new tokens, which the
        step that computes them needs. `kept` is the net change once `trim` released what no
        future query can see (may be negative for a local head crossing a page edge).
        A sequence whose last partial page is shared needs one more page per head (copy on write).
        """
        if new_len < old_len:
            raise ValueError(f"new_len {new_len} < old_len {old_len}")
        heads = self.num_layers * self.num_kv_heads
        peak = heads * (_cdiv(new_len, self.page_size) - _cdiv(old_len, self.page_size))
        kept = int(self._kept_pages(new_len).sum() - self._kept_pages(old_len).sum())
        return PagesNeeded(int(peak), kept)

    def occupancy(self) -> dict[str, int]:
        """Physical pages in use (shared pages counted once), split by the owner head's class."""
        used = self._ref > 0
        glob = self.is_global.reshape(-1)[self._owner[used]]
        n_global = int(glob.sum())
        return {"global": n_global, "local": int(used.sum()) - n_global,
                "free": self._nfree, "total": self.num_pages}

    # ------------------------------------------------------------------ page refs

    def _alloc(self, n: int) -> np.ndarray:
        pages = self._free[self._nfree - n:self._nfree].copy()
        self._nfree -= n
        self._ref[pages] = 1
        return pages

    def retain(self, pages) -> None:
        """Take one more reference on each page (>= 0 entries), e.g. a chunk store keeping them."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        pages = pages[pages >= 0]
        if (pages >= self.num_pages).any() or (self._ref[pages] <= 0).any():
            raise ValueError("retain: page ids must name pages currently in use")
        np.add.at(self._ref, pages, 1)

    def release(self, pages) -> None:
        """Drop one reference on each page (>= 0 entries); pages reaching 0 go back to the free list."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        pages = pages[pages >= 0]
        if pages.size == 0:
            return
        uniq, cnt = np.unique(pages, return_counts=True)
        if uniq[-1] >= self.num_pages or (self._ref[uniq] < cnt).any():
            raise ValueError("release: page id out of range or already free (double free)")
        self._ref[uniq] -= cnt.astype(np.int32)
        freed = uniq[self._ref[uniq] == 0]
        self._free[self._nfree:self._nfree + freed.size] = freed
        self._nfree += freed.size

    # ------------------------------------------------------------------ sequences

    def _seq(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}; call add_sequence first") from None

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence id {seq_id!r} already exists")
        self._seqs[seq_id] = _Seq(np.full((self.num_layers, self.num_kv_heads, 0), -1, np.int32))

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def table(self, seq_id: int) -> np.ndarray:
        """Copy of the host table, int32 [L, Hkv, ceil(length/page_size)]."""
        s = self._seq(seq_id)
        return s.table[:, :, :_cdiv(s.length, self.page_size)].copy()

    def _grow(self, s: _Seq, n_pages: int) -> None:
        cap = s.table.shape[2]
        if n_pages > cap:  # geometric growth: amortised O(1) per decode step
            extra = max(n_pages, 2 * cap) - cap
            s.table = np.concatenate(
                [s.table, np.full(s.table.shape[:2] + (extra,), -1, np.int32)], axis=2)

    def ensure(self, seq_id: int, new_len: int) -> None:
        """Give positions [length, new_len) a page in every (layer, head); length becomes new_len.

        All-or-nothing: raises PoolExhausted and changes nothing when pages run short.
        A shared page that would receive new tokens (the last, partial one) is copied first.
        """
        s = self._seq(seq_id)
        old = s.length
        if new_len < old:
            raise ValueError(f"ensure: new_len {new_len} < current length {old} of sequence {seq_id!r}")
        if new_len == old:
            return
        ps = self.page_size
        first, end = old // ps, _cdiv(new_len, ps)
        self._grow(s, end)
        span = s.table[:, :, first:end]  # view
        missing = span == -1
        # Copy on write: the page holding position `old` is written this step; if another owner
        # shares it, this sequence gets a private copy.
        cow = np.zeros_like(missing)
        if old % ps:
            cow[:, :, 0] = (span[:, :, 0] >= 0) & (self._ref[np.maximum(span[:, :, 0], 0)] > 1)
        n_new, n_cow = int(missing.sum()), int(cow.sum())
        if n_new + n_cow > self._nfree:
            raise PoolExhausted(
                f"sequence {seq_id!r} growing {old} -> {new_len} needs {n_new + n_cow} pages, "
                f"only {self._nfree} of {self.num_pages} free")
        head_idx = np.broadcast_to(
            np.arange(self.num_layers * self.num_kv_heads, dtype=np.int32)
            .reshape(self.num_layers, self.num_kv_heads, 1), span.shape)
        if n_cow:
            src = span[cow]
            dst = self._alloc(n_cow)
            self._owner[dst] = head_idx[cow]
            src_t = torch.from_numpy(src.astype(np.int64)).to(self.device)
            dst_t = torch.from_numpy(dst.astype(np.int64)).to(self.device)
            self.k_pages[dst_t] = self.k_pages[src_t]
            self.v_pages[dst_t] = self.v_pages[src_t]
            span[cow] = dst
            self._ref[src] -= 1  # was > 1, so never reaches 0 here
        if n_new:
            pages = self._alloc(n_new)
            self._owner[pages] = head_idx[missing]
            span[missing] = pages
        s.length = new_len

    def trim(self, seq_id: int) -> int:
        """Release pages no future query can see (next query at p = length). Returns pages released.

        Page lp is dead for head (l, h) iff it holds no sink token (lp*ps >= S) and its last
        position is out of the window of p = n: (lp+1)*ps - 1 < n - W + 1. Later queries see
        even less, so dead pages stay dead. Global heads never lose a page.
        """
        s = self._seq(seq_id)
        n_pages = _cdiv(s.length, self.page_size)
        lp = np.arange(n_pages)
        dead = ((lp >= self._sink_pages[:, :, None]) & (lp < self._dead_end(s.length)[:, :, None])
                & (s.table[:, :, :n_pages] >= 0))
        pages = s.table[:, :, :n_pages][dead]
        self.release(pages)
        s.table[:, :, :n_pages][dead] = -1
        return int(pages.size)

    def free_sequence(self, seq_id: int) -> None:
        s = self._seq(seq_id)
        self.release(s.table)
        del self._seqs[seq_id]

    def share(self, seq_id: int, tables, length: int, first_page: int = 0) -> None:
        """Map existing pages (e.g. a cached chunk's) into a sequence, read-only, one ref each.

        `tables` is int32 [L, Hkv, n] of physical pages (-1 = not stored) for logical pages
        `[first_page, first_page + n)` of the sequence, holding `length` tokens from position
        `first_page * page_size`. The sequence must currently end exactly there (page aligned).
        Its length becomes `first_page * page_size + length`. Writing into a shared page later
        (appending to a partial last page) copies it first, see `ensure`.
        """
        s = self._seq(seq_id)
        ps = self.page_size
        tables = np.asarray(torch.as_tensor(tables).cpu(), dtype=np.int32)
        if tables.ndim != 3 or tables.shape[:2] != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"share: tables must be [L={self.num_layers}, "
                             f"Hkv={self.num_kv_heads}, n]; got {tables.shape}")
        n = _cdiv(length, ps)
        if tables.shape[2] < n:
            raise ValueError(f"share: {length} tokens need {n} logical pages, tables has "
                             f"{tables.shape[2]}")
        if s.length != first_page * ps:
            raise ValueError(f"share: sequence {seq_id!r} has length {s.length}, must end at "
                             f"first_page*page_size = {first_page * ps}")
        tables = tables[:, :, :n]
        self.retain(tables)  # validates the ids
        self._grow(s, first_page + n)
        s.table[:, :, first_page:first_page + n] = tables
        s.length = first_page * ps + length

    # ------------------------------------------------------------------ per-batch metadata

    def block_tables(self, seq_ids: Iterable[int], device=None) -> torch.Tensor:
        """int32 [L, B, Hkv, max_pages], max_pages = the batch's largest logical page count."""
        seqs = [self._seq(i) for i in seq_ids]
        max_pages = max([_cdiv(s.length, self.page_size) for s in seqs] + [1])
        bt = np.full((self.num_layers, len(seqs), self.num_kv_heads, max_pages), -1, np.int32)
        for b, s in enumerate(seqs):
            n = _cdiv(s.length, self.page_size)
            bt[:, b, :, :n] = s.table[:, :, :n]
        return torch.from_numpy(bt).to(device if device is not None else self.device)

    def seq_lens(self, seq_ids: Iterable[int], device=None) -> torch.Tensor:
        """int32 [B]: each sequence's length (after this step's `ensure`)."""
        lens = np.array([self._seq(i).length for i in seq_ids], dtype=np.int32)
        return torch.from_numpy(lens).to(device if device is not None else self.device)
