"""The KV page pool: one pool of fixed-size pages for all layers and KV heads.

Layout and visibility rule: docs/segpaged.md. In short, a page belongs to one (sequence, layer,
KV head) and holds logical page `lp`, i.e. positions `[lp*page_size, (lp+1)*page_size)`. A global
head keeps every page; a local head keeps its sink pages and the pages that still intersect its
window, so its page count stays bounded however long the sequence grows.

Bookkeeping lives on the host in numpy (free stack, reference counts, one `[L, Hkv, cap]` table
per sequence). Every operation is vectorised over (layer, head, page); Python only loops over
sequences. With `attach_device_tables`, each sequence also owns a slot of one persistent device
table `[L, slots, Hkv, max_pages]`: every table change is recorded and `sync_device_tables`
applies only the changed columns (one small pinned copy), so a decode step never rebuilds tables.

One pool serves every head plan: each sequence names the plan (window and sink per (layer, KV
head)) its pages are trimmed by; dense is the all-global plan. A plan may class more heads than
the pool stores (``stored_heads``: MLA's query heads over one latent head per layer): each stored
head then serves a group of plan heads and keeps what any of them can still see (the largest
window and sink of the group); ``head_window_sink`` gives the plan per plan head.

Retrieval heads: until a sequence has a selected set (`select`), a head whose selected set may
reach any earlier token must be given `window = GLOBAL_WINDOW`, or its pages would be trimmed.
`select` then gives every (layer, KV head) of the sequence its selected positions, moves it to a
plan with the heads' real windows, and keeps sink pages, window pages and the pages holding
selected tokens; every other page of the head goes back (shared pages lose this sequence's
reference only). With `attach_selection` the sets also live in a persistent device table read by
slot, like the block tables, so captured decode graphs stay valid.
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


class _Plan(NamedTuple):
    window: np.ndarray  # int64 [L, Hkv]
    sink: np.ndarray  # int64 [L, Hkv]
    sink_pages: np.ndarray  # logical pages holding a sink token
    is_global: np.ndarray  # bool [L, Hkv]
    trim_at: tuple  # trim_at[n % page_size]: some local head's window leaves a page at length n
    heads: tuple  # (window, sink) [L, plan heads] as registered (one per stored head, or a group each)


class _Seq:
    __slots__ = ("table", "length", "plan", "slot", "trimmed_len", "shared_tail", "keep", "sel", "by_page")

    def __init__(self, table: np.ndarray, plan: _Plan, slot: int):
        self.table = table  # int32 [L, Hkv, cap], -1 = not stored; cap >= ceil(length/page_size)
        self.length = 0
        self.plan = plan
        self.slot = slot  # row of the device table (0: none attached)
        self.trimmed_len = 0  # length at the last trim
        self.shared_tail = False  # the last, partial page may be shared (copy it before writing)
        self.keep = None  # bool [L, Hkv, n]: pages holding selected tokens (trim keeps them)
        self.sel = None  # int32 [L, Hkv, m]: selected positions, sorted, -1 padded
        self.by_page = None  # bool [L, Hkv]: heads whose set is every position of their kept pages


def _cdiv(a, b):
    return -(-a // b)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, head_dim: int, window, sink,
                 dtype: torch.dtype = torch.float32, device="cpu", stored_heads: int | None = None):
        """``window``/``sink`` [L, H]: the default plan; ``stored_heads``: KV heads per layer with
        pages (default H; else H must be a multiple of it, each stored head serving H / it plan heads)."""
        if num_pages < 1 or page_size < 1 or head_dim < 1:
            raise ValueError(f"num_pages, page_size, head_dim must be >= 1; got "
                             f"{num_pages}, {page_size}, {head_dim}")
        self.num_pages, self.page_size, self.head_dim = num_pages, page_size, head_dim
        self._plans: dict[str, _Plan] = {}
        self.num_layers, plan_heads = np.asarray(torch.as_tensor(window).cpu()).shape[:2]
        self.num_kv_heads = stored_heads or plan_heads
        self.add_plan("default", window, sink)
        default = self._plans["default"]
        self.window, self.sink, self.is_global = default.window, default.sink, default.is_global
        self.device = torch.device(device)
        self.dtype = dtype
        self.k_pages = torch.zeros(num_pages, page_size, head_dim, dtype=dtype, device=self.device)
        self.v_pages = torch.zeros_like(self.k_pages)
        # Free list as a stack: the top `_nfree` entries of `_free` are free page ids.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._nfree = num_pages
        self._ref = np.zeros(num_pages, dtype=np.int32)
        # Whether each page belongs to a global head of its owner's plan (occupancy by class).
        self._global_page = np.zeros(num_pages, dtype=bool)
        self._seqs: dict[int, _Seq] = {}
        self.device_tables: torch.Tensor | None = None  # int32 [L, slots, Hkv, max_pages]
        self._free_slots: list[int] = []
        self._dirty: dict[int, list[int]] = {}  # slot -> [lo, hi) logical pages changed since sync
        self.device_sel: torch.Tensor | None = None  # int32 [L, slots, Hkv, max_sel], -1 padded
        self.device_sel_lens: torch.Tensor | None = None  # int32 [L, slots, Hkv]
        # A hybrid model's linear-layer state, one per sequence slot (cache/linear_state.py), or None
        self.linear_state = None

    def add_plan(self, name: str, window, sink) -> None:
        """Register a head plan (window and sink per (layer, KV head)) sequences can be trimmed by."""
        window = np.asarray(torch.as_tensor(window).cpu(), dtype=np.int64)
        sink = np.asarray(torch.as_tensor(sink).cpu(), dtype=np.int64)
        if window.ndim != 2 or window.shape != sink.shape:
            raise ValueError(f"window and sink must both be [L, Hkv]; got window {window.shape}, "
                             f"sink {sink.shape}")
        if window.shape[0] != self.num_layers or window.shape[1] % self.num_kv_heads:
            raise ValueError(f"plan {name!r} is {window.shape}, the pool is "
                             f"[L={self.num_layers}, Hkv={self.num_kv_heads}] (or a multiple of Hkv heads)")
        if (window < 1).any():
            raise ValueError("window must be >= 1 for every head (a query always sees itself)")
        if (sink < 0).any():
            raise ValueError("sink must be >= 0 for every head")
        heads = (window, sink)
        if window.shape[1] != self.num_kv_heads:  # a stored head keeps what any head of its group sees
            group = (self.num_layers, self.num_kv_heads, -1)
            window, sink = window.reshape(group).max(-1), sink.reshape(group).max(-1)
        is_global = window >= GLOBAL_WINDOW
        trim_at = [False] * self.page_size
        for w in np.unique(window[~is_global]):
            trim_at[int(w - 1) % self.page_size] = True
        self._plans[name] = _Plan(window, sink, _cdiv(sink, self.page_size), is_global, tuple(trim_at), heads)

    @property
    def plans(self) -> tuple[str, ...]:
        return tuple(self._plans)

    def window_sink(self, plan: str) -> tuple[np.ndarray, np.ndarray]:
        """The plan per stored head [L, Hkv] (what its pages are trimmed by)."""
        p = self._plans[plan]
        return p.window, p.sink

    def head_window_sink(self, plan: str) -> tuple[np.ndarray, np.ndarray]:
        """The plan as registered, per plan head [L, H] (what the attention of each head sees)."""
        return self._plans[plan].heads

    def plan_of(self, seq_id: int) -> str:
        plan = self._seq(seq_id).plan
        return next(k for k, v in self._plans.items() if v is plan)

    # ------------------------------------------------------------------ capacity

    @property
    def num_free_pages(self) -> int:
        return self._nfree

    @property
    def bytes_per_page(self) -> int:
        """Device bytes of one page, K and V together."""
        return 2 * self.page_size * self.head_dim * self.k_pages.element_size()

    def _kept_pages(self, n: int, plan: _Plan) -> np.ndarray:
        """[L, Hkv] pages a private sequence of length n holds after trim."""
        total = _cdiv(n, self.page_size)
        dead = np.maximum(0, self._dead_end(n, plan) - plan.sink_pages)
        return total - dead

    def _dead_end(self, n: int, plan: _Plan) -> np.ndarray:
        """[L, Hkv]: pages lp < this (and past the sinks) are dead for a next query at p = n.

        lp is dead iff its last position (lp+1)*ps - 1 < n - W + 1, i.e. lp < floor((n-W+1)/ps).
        """
        return np.maximum(0, (n - plan.window + 1) // self.page_size)

    def pages_needed(self, new_len: int, old_len: int = 0, plan: str = "default") -> PagesNeeded:
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
        p = self._plans[plan]
        kept = int(self._kept_pages(new_len, p).sum() - self._kept_pages(old_len, p).sum())
        return PagesNeeded(int(peak), kept)

    def peak_pages(self, total: int, chunk: int, plan: str = "default") -> int:
        """Most pages a private sequence growing to ``total`` tokens holds at once when its tokens
        arrive ``chunk`` at a time (a chunk is stored for every head before trim drops what local
        heads no longer see)."""
        p = self._plans[plan]
        full = _cdiv(total, self.page_size)
        per_head = np.minimum(full, self._kept_pages(total, p) + _cdiv(min(chunk, total), self.page_size) + 1)
        return int(per_head.sum())

    def occupancy(self) -> dict[str, int]:
        """Physical pages in use (shared pages counted once), split by the owner head's class."""
        used = self._ref > 0
        n_global = int(self._global_page[used].sum())
        return {"global": n_global, "local": int(used.sum()) - n_global,
                "free": self._nfree, "total": self.num_pages}

    # ------------------------------------------------------------------ page refs

    def _alloc(self, n: int) -> np.ndarray:
        pages = self._free[self._nfree - n:self._nfree].copy()
        self._nfree -= n
        self._ref[pages] = 1
        return pages

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` free pages (one reference each) for an owner outside any sequence, e.g. the
        chunk cache; they count as global-head pages. Raises PoolExhausted, taking nothing."""
        if n > self._nfree:
            raise PoolExhausted(f"{n} pages wanted, only {self._nfree} of {self.num_pages} free")
        pages = self._alloc(n)
        self._global_page[pages] = True
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

    def add_sequence(self, seq_id: int, plan: str = "default") -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence id {seq_id!r} already exists")
        if plan not in self._plans:
            raise ValueError(f"unknown head plan {plan!r} (registered: {', '.join(self._plans)})")
        slot = 0
        if self.device_tables is not None:
            if not self._free_slots:
                raise PoolExhausted(f"all {self.device_tables.shape[1] - 1} sequence slots are in use")
            slot = self._free_slots.pop()
        self._seqs[seq_id] = _Seq(np.full((self.num_layers, self.num_kv_heads, 0), -1, np.int32),
                                  self._plans[plan], slot)

    def slot(self, seq_id: int) -> int:
        """The sequence's row of the device table."""
        return self._seq(seq_id).slot

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def pages_held(self, seq_id: int) -> int:
        """Pages the sequence's table references (its own and shared ones)."""
        return int((self._seq(seq_id).table >= 0).sum())

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

    def ensure(self, seq_id: int, new_len: int, skip_dead: bool = False) -> None:
        """Give positions [length, new_len) a page in every (layer, head); length becomes new_len.

        All-or-nothing: raises PoolExhausted and changes nothing when pages run short.
        A shared page that would receive new tokens (the last, partial one) is copied first.
        ``skip_dead``: leave out the pages `trim` would drop at new_len (for K/V computed elsewhere
        and stored at once: a local head only gets its sink pages and the pages of its window).
        """
        s = self._seq(seq_id)
        old = s.length
        if new_len < old:
            raise ValueError(f"ensure: new_len {new_len} < current length {old} of sequence {seq_id!r}")
        if new_len == old:
            return
        ps = self.page_size
        if old % ps and new_len <= _cdiv(old, ps) * ps and not s.shared_tail:
            s.length = new_len  # fast path (decode): the tokens fit the last page every head holds
            return
        first, end = old // ps, _cdiv(new_len, ps)
        self._grow(s, end)
        span = s.table[:, :, first:end]  # view
        missing = span == -1
        if skip_dead:
            lp = np.arange(first, end)
            plan = s.plan
            missing &= ~((lp >= plan.sink_pages[:, :, None]) & (lp < self._dead_end(new_len, plan)[:, :, None]))
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
        if new_len > self.max_len:
            raise ValueError(f"sequence {seq_id!r} would hold {new_len} tokens, the device table "
                             f"holds {self.max_len}")
        is_global = np.broadcast_to(s.plan.is_global[:, :, None], span.shape)
        if n_cow:
            src = span[cow]
            dst = self._alloc(n_cow)
            self._global_page[dst] = is_global[cow]
            src_t = torch.from_numpy(src.astype(np.int64)).to(self.device)
            dst_t = torch.from_numpy(dst.astype(np.int64)).to(self.device)
            self.k_pages[dst_t] = self.k_pages[src_t]
            self.v_pages[dst_t] = self.v_pages[src_t]
            span[cow] = dst
            self._ref[src] -= 1  # was > 1, so never reaches 0 here
        if n_new:
            pages = self._alloc(n_new)
            self._global_page[pages] = is_global[missing]
            span[missing] = pages
        s.length = new_len
        s.shared_tail = False
        self._mark(s, first, end)

    @property
    def max_len(self) -> int:
        """Most tokens one sequence can hold (the device table's width), unbounded without one."""
        if self.device_tables is None:
            return 1 << 62
        return self.device_tables.shape[3] * self.page_size

    def trim(self, seq_id: int) -> int:
        """Release pages no future query can see (next query at p = length). Returns pages released.

        Page lp is dead for head (l, h) iff it holds no sink token (lp*ps >= S) and its last
        position is out of the window of p = n: (lp+1)*ps - 1 < n - W + 1. Later queries see
        even less, so dead pages stay dead. Global heads never lose a page.
        """
        s = self._seq(seq_id)
        plan = s.plan
        grown, s.trimmed_len = s.length - s.trimmed_len, s.length
        if plan.is_global.all() or (grown == 1 and not plan.trim_at[s.length % self.page_size]):
            return 0  # one more token only kills pages at lengths where some window leaves a page
        n_pages = _cdiv(s.length, self.page_size)
        # Only pages in [min sink pages, max dead end) can die: look at that span alone.
        lo, hi = int(plan.sink_pages.min()), min(n_pages, int(self._dead_end(s.length, plan).max()))
        if hi <= lo:
            return 0
        lp = np.arange(lo, hi)
        span = s.table[:, :, lo:hi]
        dead = ((lp >= plan.sink_pages[:, :, None]) & (lp < self._dead_end(s.length, plan)[:, :, None])
                & (span >= 0))
        if s.keep is not None:  # pages holding selected tokens stay
            keep = s.keep[:, :, lo:hi]
            dead[:, :, :keep.shape[2]] &= ~keep
        pages = span[dead]
        if pages.size:
            self.release(pages)
            span[dead] = -1
            self._mark(s, lo, hi)
        return int(pages.size)

    def free_sequence(self, seq_id: int) -> None:
        s = self._seq(seq_id)
        self.release(s.table)
        del self._seqs[seq_id]
        if s.slot:
            if s.sel is not None and self.device_sel is not None:
                self.device_sel[:, s.slot] = -1
                self.device_sel_lens[:, s.slot] = 0
            self._dirty.pop(s.slot, None)
            n = _cdiv(s.length, self.page_size)
            if n:  # leave the slot all -1 for its next owner
                self.device_tables[:, s.slot, :, :n] = -1
            self._free_slots.append(s.slot)

    def adopt(self, seq_id: int, held: np.ndarray, length: int) -> np.ndarray:
        """Give an empty sequence ``length`` tokens whose K/V arrive from elsewhere (another
        instance's prefill): a fresh page for each (layer, head, logical page) ``held`` (bool [L,
        Hkv, ceil(length / page_size)]) marks, nothing for the rest. Returns the new pages in
        (layer, head, page) order, for the caller to fill. All-or-nothing (PoolExhausted)."""
        s = self._seq(seq_id)
        n_pages = _cdiv(length, self.page_size)
        if s.length:
            raise ValueError(f"adopt: sequence {seq_id!r} already holds {s.length} tokens")
        if held.shape != (self.num_layers, self.num_kv_heads, n_pages):
            raise ValueError(f"adopt: held must be [L={self.num_layers}, Hkv={self.num_kv_heads}, {n_pages}]; "
                             f"got {held.shape}")
        if length > self.max_len:
            raise ValueError(f"sequence {seq_id!r} would hold {length} tokens, the device table holds {self.max_len}")
        n = int(held.sum())
        if n > self._nfree:
            raise PoolExhausted(f"adopting {length} tokens needs {n} pages, only {self._nfree} of "
                                f"{self.num_pages} free")
        pages = self._alloc(n)
        self._global_page[pages] = np.broadcast_to(s.plan.is_global[:, :, None], held.shape)[held]
        self._grow(s, n_pages)
        s.table[:, :, :n_pages][held] = pages
        s.length = s.trimmed_len = length
        s.shared_tail = False
        self._mark(s, 0, n_pages)
        return pages

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
        s.shared_tail = bool(length % ps)
        self._mark(s, first_page, first_page + n)

    # ------------------------------------------------------------------ selected sets

    def select(self, seq_id: int, sel_pos, plan: str | None = None) -> int:
        """Give the sequence's heads selected sets and release what no head sees any more.

        ``sel_pos``: int [L, Hkv, m] selected positions per (layer, KV head), sorted ascending,
        unique, -1 padded (a head with none: all -1). ``plan``: the head plan the sequence is
        trimmed by from now on (the heads' real windows and sinks; default: its current one).
        Pages holding a selected position are kept by every later `trim`; the rest of what the
        plan's windows no longer see is released now (a page shared with a cache or another
        sequence only loses this sequence's reference: it is never written or freed here).
        Calling it again replaces the sets (a smaller set releases more). Returns pages released.
        """
        s = self._seq(seq_id)
        if plan is not None and plan not in self._plans:
            raise ValueError(f"unknown head plan {plan!r} (registered: {', '.join(self._plans)})")
        sel = np.asarray(torch.as_tensor(sel_pos).cpu(), dtype=np.int64)
        if sel.ndim != 3 or sel.shape[:2] != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"select: sel_pos must be [L={self.num_layers}, Hkv={self.num_kv_heads}, m]; "
                             f"got {sel.shape}")
        valid = sel >= 0
        if (sel < -1).any() or (valid[:, :, 1:] & ~valid[:, :, :-1]).any():
            raise ValueError("select: sel_pos holds positions first, then -1 padding (no other negatives)")
        if ((sel[:, :, 1:] <= sel[:, :, :-1]) & valid[:, :, 1:]).any():
            raise ValueError("select: each head's positions must be sorted ascending and unique")
        if (sel >= self.max_len).any():
            raise ValueError(f"select: a position is past the {self.max_len} tokens a sequence can hold")
        if self.device_sel is not None and sel.shape[2] > self.device_sel.shape[3]:
            width = int(valid.sum(2).max(initial=0))
            if width > self.device_sel.shape[3]:
                raise ValueError(f"select: {width} selected positions in one head, the device table holds "
                                 f"{self.device_sel.shape[3]} (attach_selection's max_sel)")
            sel = sel[:, :, :self.device_sel.shape[3]]
            valid = valid[:, :, :sel.shape[2]]
        # One entry per (head, page): positions are sorted, so a page's first selected position
        # stands for the page (thousands of positions per head map to tens of pages).
        page = np.where(valid, sel // self.page_size, -1)
        first = valid.copy()
        first[:, :, 1:] &= page[:, :, 1:] != page[:, :, :-1]
        l_idx, h_idx, i_idx = np.nonzero(first)
        lp = page[l_idx, h_idx, i_idx]
        stored = lp < s.table.shape[2]
        gone = (sel[l_idx, h_idx, i_idx] < s.length) & (~stored | (s.table[l_idx, h_idx, np.minimum(lp, s.table.shape[2] - 1)] < 0))
        if gone.any():
            i = int(np.argmax(gone))
            raise ValueError(f"select: position {int(sel[l_idx[i], h_idx[i], i_idx[i]])} of layer {int(l_idx[i])} KV head "
                             f"{int(h_idx[i])} is no longer stored (its page was released)")
        n_pages = max(_cdiv(s.length, self.page_size), int(sel.max(initial=-1)) // self.page_size + 1)
        keep = np.zeros((self.num_layers, self.num_kv_heads, n_pages), dtype=bool)
        keep[l_idx, h_idx, lp] = True
        s.keep = keep
        old_width = 0 if s.sel is None else s.sel.shape[2]
        if s.by_page is not None and s.by_page.any() and self.device_sel is not None:
            old_width = self.device_sel.shape[3]  # select_pages wrote whole rows
        s.sel = sel.astype(np.int32)
        s.by_page = None
        if plan is not None:
            s.plan = self._plans[plan]
        if s.slot and self.device_sel is not None:
            w = sel.shape[2]
            self.device_sel[:, s.slot, :, :w] = torch.from_numpy(s.sel).to(self.device_sel.device)
            if old_width > w:  # the old set's tail columns
                self.device_sel[:, s.slot, :, w:old_width] = -1
            self.device_sel_lens[:, s.slot] = torch.from_numpy(valid.sum(2).astype(np.int32)).to(self.device_sel.device)
        s.trimmed_len = 0  # the next trim looks at every page
        return self.trim(seq_id)

    def select_pages(self, seq_ids: list[int], layers: np.ndarray, heads: np.ndarray, keep: np.ndarray,
                     sel_pos: torch.Tensor, sel_lens: torch.Tensor, plan: str | None = None) -> int:
        """Give R heads (``layers``, ``heads`` [R]) of each of C sequences the set of every
        position of some of their pages, and release what no head sees any more; the other heads
        keep their sets. A decode budget's checks call it for all their requests at once: the
        positions go to the device table from the device, and the host keeps pages only.

        ``keep``: bool [C, R, P], the pages (below the sequence's length, stored) each head keeps;
        ``sel_pos`` int32 [C * R, w] / ``sel_lens`` [C * R] on the device: those pages' positions
        in order, -1 padded (``redknot.cache.selection.pages_to_positions``). ``plan`` as in
        ``select``. Returns pages released."""
        if plan is not None and plan not in self._plans:
            raise ValueError(f"unknown head plan {plan!r} (registered: {', '.join(self._plans)})")
        seqs = [self._seq(i) for i in seq_ids]
        C, R = len(seqs), len(layers)
        if keep.ndim != 3 or keep.shape[:2] != (C, R) or tuple(sel_pos.shape[:1]) != (C * R,):
            raise ValueError(f"select_pages: keep must be [C={C}, R={R}, P] and sel_pos [C*R, w]; got "
                             f"{keep.shape} and {tuple(sel_pos.shape)}")
        if self.device_sel is not None and sel_pos.shape[1] > self.device_sel.shape[3]:
            raise ValueError(f"select_pages: {sel_pos.shape[1]} selected positions in one head, the device table "
                             f"holds {self.device_sel.shape[3]} (attach_selection's max_sel)")
        P = keep.shape[2]
        for i, s in enumerate(seqs):  # check everything before changing anything
            n = _cdiv(s.length, self.page_size)
            rows = np.zeros((R, P), bool)
            w = min(n, P, s.table.shape[2])
            rows[:, :w] = s.table[layers, heads, :w] >= 0
            if (keep[i] & ~rows).any():
                r, lp = np.argwhere(keep[i] & ~rows)[0]
                raise ValueError(f"select_pages: page {int(lp)} of layer {int(layers[r])} KV head {int(heads[r])} "
                                 f"is not stored (released, or past the sequence's length)")
        for i, s in enumerate(seqs):
            n_pages = max(P, _cdiv(s.length, self.page_size), 0 if s.keep is None else s.keep.shape[2])
            k = np.zeros((self.num_layers, self.num_kv_heads, n_pages), dtype=bool)
            if s.keep is not None:
                k[:, :, :s.keep.shape[2]] = s.keep
            k[layers, heads] = False
            k[layers, heads, :P] = keep[i]
            s.keep = k
            if s.sel is None:
                s.sel = np.full((self.num_layers, self.num_kv_heads, 1), -1, np.int32)
            s.sel[layers, heads] = -1  # these heads' positions follow from their pages
            if s.by_page is None:
                s.by_page = np.zeros((self.num_layers, self.num_kv_heads), bool)
            s.by_page[layers, heads] = True
            if plan is not None:
                s.plan = self._plans[plan]
        if self.device_sel is not None and any(s.slot for s in seqs):
            dev = self.device_sel.device
            slots = torch.tensor([s.slot for s in seqs], device=dev).repeat_interleave(R)
            ls = torch.from_numpy(np.tile(layers, C)).to(dev)
            hs = torch.from_numpy(np.tile(heads, C)).to(dev)
            ok = slots > 0  # a sequence without a slot has no device rows
            rows = torch.full((C * R, self.device_sel.shape[3]), -1, dtype=torch.int32, device=dev)
            rows[:, :sel_pos.shape[1]] = sel_pos
            self.device_sel[ls[ok], slots[ok], hs[ok]] = rows[ok]
            self.device_sel_lens[ls[ok], slots[ok], hs[ok]] = sel_lens.to(torch.int32)[ok]
        released = 0
        for i, s in zip(seq_ids, seqs):
            s.trimmed_len = 0  # the next trim looks at every page
            released += self.trim(i)
        return released

    def kept_pages(self, seq_id: int) -> np.ndarray | None:
        """Copy of the pages holding the sequence's selected positions, bool [L, Hkv, n], or None."""
        keep = self._seq(seq_id).keep
        return None if keep is None else keep.copy()

    def selection(self, seq_id: int) -> np.ndarray | None:
        """Copy of the sequence's selected positions, int32 [L, Hkv, m] (-1 padded), or None."""
        s = self._seq(seq_id)
        if s.sel is None:
            return None
        if s.by_page is None or not s.by_page.any():
            return s.sel.copy()
        ls, hs = np.nonzero(s.by_page)  # every position of those heads' kept pages, in order
        pages = s.keep[ls, hs]
        width = max(int((s.sel >= 0).sum(-1).max(initial=0)), int(pages.sum(1).max(initial=0)) * self.page_size, 1)
        out = np.full((self.num_layers, self.num_kv_heads, width), -1, np.int32)
        w = min(width, s.sel.shape[2])
        out[:, :, :w] = s.sel[:, :, :w]
        out[ls, hs] = -1
        for l, h, row in zip(ls, hs, pages):
            pos = (np.nonzero(row)[0][:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
            out[l, h, :len(pos)] = pos
        return out

    def attach_selection(self, max_sel: int) -> None:
        """Keep every sequence's selected sets in a persistent device table, int32 [L, slots, Hkv,
        max_sel] (-1 padded) with their sizes [L, slots, Hkv]; needs the device block tables."""
        if self.device_tables is None:
            raise RuntimeError("attach_selection after attach_device_tables")
        if max_sel < 1:
            raise ValueError(f"max_sel must be >= 1, got {max_sel}")
        slots = self.device_tables.shape[1]
        self.device_sel = torch.full((self.num_layers, slots, self.num_kv_heads, max_sel), -1, dtype=torch.int32,
                                     device=self.device)
        self.device_sel_lens = torch.zeros((self.num_layers, slots, self.num_kv_heads), dtype=torch.int32,
                                           device=self.device)
        for i, s in self._seqs.items():
            if s.sel is not None:
                self.select(i, self.selection(i))

    def selection_tables(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's selected sets gathered by slot on the device: sel_pos int32 [L, B, Hkv,
        max_sel] and sel_lens int32 [L, B, Hkv] (slot 0, the padding row, selects nothing)."""
        if self.device_sel is None:
            raise RuntimeError("no selection table: call attach_selection first")
        return self.device_sel.index_select(1, slots), self.device_sel_lens.index_select(1, slots)

    # ------------------------------------------------------------------ device tables

    def attach_device_tables(self, max_seqs: int, max_len: int) -> None:
        """Keep a persistent device copy of every sequence's table: int32 [L, max_seqs + 1, Hkv,
        ceil(max_len / page_size)]. Slot 0 stays all -1 (padding rows of a captured batch)."""
        if self._seqs:
            raise RuntimeError("attach_device_tables before adding sequences")
        pages = _cdiv(max_len, self.page_size)
        self.device_tables = torch.full((self.num_layers, max_seqs + 1, self.num_kv_heads, pages), -1,
                                        dtype=torch.int32, device=self.device)
        self._free_slots = list(range(max_seqs, 0, -1))

    def _mark(self, s: _Seq, lo: int, hi: int) -> None:
        if s.slot and hi > lo:
            d = self._dirty.get(s.slot)
            self._dirty[s.slot] = [lo, hi] if d is None else [min(d[0], lo), max(d[1], hi)]

    def sync_device_tables(self) -> None:
        """Copy the columns changed since the last sync to the device table (one H2D copy)."""
        if not self._dirty or self.device_tables is None:
            return
        by_slot = {s.slot: s for s in self._seqs.values()}
        slots, lps, cols = [], [], []
        for slot, (lo, hi) in self._dirty.items():
            s = by_slot.get(slot)
            if s is None:
                continue
            hi = min(hi, s.table.shape[2])
            slots.append(np.full(hi - lo, slot, np.int64))
            lps.append(np.arange(lo, hi, dtype=np.int64))
            cols.append(s.table[:, :, lo:hi].transpose(2, 0, 1))  # [n, L, Hkv]
        self._dirty.clear()
        if not slots:
            return
        idx = np.stack([np.concatenate(slots), np.concatenate(lps)])
        vals = np.ascontiguousarray(np.concatenate(cols))
        dev = self.device_tables.device
        pin = dev.type == "cuda"
        idx_t = torch.from_numpy(idx)
        vals_t = torch.from_numpy(vals)
        if pin:
            idx_t, vals_t = idx_t.pin_memory(), vals_t.pin_memory()
        idx_t = idx_t.to(dev, non_blocking=True)
        vals_t = vals_t.to(dev, non_blocking=True)
        self.device_tables[:, idx_t[0], :, idx_t[1]] = vals_t

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
