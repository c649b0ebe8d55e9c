"""Document KV: chunk keys, computing missing chunks, relocating and placing cached ones.

A prompt that names documents is ``[prefix][chunk 1]…[chunk n][question]``. Each chunk's KV is
computed once at its canonical position (right after the prefix, under the all-global plan) and
kept in the chunk cache; a request copies every chunk it names into its own pages with keys rotated
to where the chunk sits. What the method then does with them (prefill the question, recompute each
chunk's first tokens, or recover) is the method's spec (``reuse.registry``).

On a hybrid model the chunk prefill also keeps each chunk's effect on the linear layers' state
(``cache/linear_chunks.py``), and placing composes those into the request's state slot.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache import PoolExhausted
from ..cache.chunk_cache import ChunkCache, ChunkPages
from ..cache.chunk_kv import chunk_key
from ..cache.linear_chunks import ChunkCapture, LinearChunkStore, compose
from ..reuse.flops import LinearReuse
from ..reuse.options import ReuseOptions
from ..reuse.registry import PolicyInputs, get_method, with_budget
from .scheduler import DocumentNeeds
from .sequence import Sequence

# Pool sequences set aside for prefilling missing chunks (beside max_num_seqs requests).
CHUNK_SLOTS = 32
# On a hybrid model fewer: each slot also holds a linear state (74 MB on Qwen3-Next-80B).
LINEAR_CHUNK_SLOTS = 4
# Device bytes the linear-layer entries of cached chunks may take on a hybrid model (each is about
# twice a sequence's recurrent state: 150 MB on Qwen3-Next-80B); least recently used go first. The
# memory profile sets them aside before sizing the page pool.
LINEAR_CHUNK_BYTES = 2 << 30
# Tokens of cached pieces placed by one read, rotation and store (bounds the temporaries: K and V
# of this many tokens in every layer).
COPY_GROUP_TOKENS = 4096


def dummy_token(config) -> int:
    """The token chunks are cached behind under a dummy prefix: the model's BOS (else id 0)."""
    bos = getattr(config, "bos_token_id", None)
    return 0 if bos is None else int(bos)


def pages_of(entries: dict) -> np.ndarray:
    """Every page id of a set of chunk entries (one entry per reference)."""
    return np.concatenate([e.pages.ravel() for e in entries.values()] + [np.zeros(0, np.int32)])


class DocumentKV:
    def __init__(self, adapter, config, fingerprint: str, head_config, sparse, options: ReuseOptions | None,
                 device: torch.device, max_batched_tokens: int):
        self.adapter, self.config, self.fingerprint, self.device = adapter, config, fingerprint, device
        self.head_config, self.sparse = head_config, sparse
        self.options = options or ReuseOptions()
        self.max_batched_tokens = max_batched_tokens
        self._chunk_seq_ids = iter(range(-1, -(1 << 62), -1))  # pool ids of chunk prefills
        layout = adapter.state_layout()
        self.linear_spec = layout.linear  # a hybrid's linear layers (None: no linear state)
        self.linear = LinearChunkStore(LINEAR_CHUNK_BYTES) if layout.linear is not None else None
        # pool sequences its chunk prefills may take at once (0: the model takes no document K/V)
        self.chunk_slots = (CHUNK_SLOTS if layout.linear is None else LINEAR_CHUNK_SLOTS) if adapter.document_reuse else 0
        self.attach(None, None, None, None, lambda pages, keep=(): 0)

    def attach(self, pool, runner, chunk_cache: ChunkCache | None, prefix_cache, reclaim) -> None:
        """The pool, runner and caches it works with (again after the pool is rebuilt);
        ``reclaim(pages, keep)`` evicts cached pages when a chunk prefill runs short."""
        self.pool, self.runner, self.chunk_cache, self.prefix_cache = pool, runner, chunk_cache, prefix_cache
        self.reclaim = reclaim
        self.heads = 0 if pool is None else int(pool.window.size)

    def next_pool_id(self) -> int:
        return next(self._chunk_seq_ids)

    # ------------------------------------------------------------------ keys

    def specs(self, seq: Sequence) -> list[tuple[str, tuple, int]]:
        """(key, canonical tokens, start) of the prompt prefix (computed alone) and of each chunk
        (computed after the prefix, at its canonical position); hashed once per request."""
        if seq.reuse.specs is not None:
            return seq.reuse.specs
        cp = seq.chunked_prompt
        prefix = tuple(cp.prefix)
        ns = self.fingerprint if seq.cache_salt is None else f"{self.fingerprint}\x1fsalt:{seq.cache_salt}"
        specs = [(chunk_key(ns, (), prefix), prefix, 0)] if prefix else []
        # chunks cached behind dummy tokens (ReuseOptions.dummy_prefix_tokens): their K/V are computed
        # after prefix + dummies, and only the chunk's own pages are kept (the dummies are dropped)
        dummies = with_budget(self.options, self.sparse, seq.budget)[0].dummy_prefix_tokens
        if dummies and self.linear is not None:  # the linear layers' chunk states would carry the dummies
            raise ValueError("dummy_prefix_tokens: not supported on hybrid (linear-attention) models")
        lead = prefix + (dummy_token(self.config),) * dummies
        specs += [(chunk_key(ns, lead, ids), lead + tuple(ids), len(lead)) for ids in cp.chunks]
        seq.reuse.specs = specs
        return specs

    def needs(self, seq: Sequence) -> DocumentNeeds:
        """Which of the request's chunks are cached (and their pages), and the pages the prefills of
        the missing ones hold at most (every head of each, prefix included). Looks, never computes."""
        hits, hit_pages, missing, seen = set(), 0, 0, set()
        for key, tokens, _ in self.specs(seq):
            if key in seen:
                continue
            seen.add(key)
            if seq.reuse is not None and key in seq.reuse.loaded:
                continue  # loaded for it alone: its pages are held already
            entry = self._cached(key, self.chunk_cache.peek)
            if entry is None:
                missing += self.heads * -(-len(tokens) // self.pool.page_size)
            else:
                hits.add(key)
                hit_pages += entry.pages.size
        return DocumentNeeds(frozenset(hits), hit_pages, missing)

    def tier_wants(self, seq: Sequence, partial: bool) -> list[tuple[str, np.ndarray | None]]:
        """(key, heads) of the request's chunks missing from the pool, for a tier load. ``heads``:
        with ``partial``, the flat (layer, KV head) indices its plan lets see any of the chunk
        where the request places it (None: every head), else None."""
        if self.linear is not None:  # a hybrid's chunk needs its linear-layer state too: computed, not loaded
            return []
        spec, cp = get_method(seq.method), seq.chunked_prompt
        partial = partial and not spec.recovers and not spec.recompute_chunk_heads  # those read every chunk row
        window, sink = self.pool.window_sink(seq.plan)
        positions = [0] * bool(cp.prefix) + list(cp.chunk_starts)
        wants, seen = [], set()
        for (key, tokens, start), pos in zip(self.specs(seq), positions):
            if key in seen or key in self.chunk_cache:
                continue
            seen.add(key)
            heads = None
            if partial:
                # a key at j is seen by some query at p >= the question's start q0 iff j < sink or q0 - j < window
                last = pos + len(tokens) - start - 1
                need = np.flatnonzero(((pos < sink) | (last > cp.suffix_start - window)).ravel())
                heads = None if need.size == window.size else need if need.size else np.zeros(1, np.int64)
            wants.append((key, heads))
        return wants

    # ------------------------------------------------------------------ compute

    def ensure(self, seq: Sequence, reserve: int) -> tuple[dict, int]:
        """Put every chunk the request names into the chunk cache, prefilling the missing ones in
        batches; the entries' pages are pinned (one reference each) until ``release``. ``reserve``
        pages must stay free for the request itself. Returns (key -> entry, tokens computed).
        Raises PoolExhausted, keeping what it cached, when pages run short."""
        entries, missing, loaded = {}, {}, seq.reuse.loaded
        for key, tokens, start in self.specs(seq):
            if key in entries or key in missing:
                continue
            entry = loaded.get(key) or self._cached(key, self.chunk_cache.lookup)
            if entry is None:
                missing[key] = (tokens, start)
            else:
                entries[key] = entry
        self.pool.retain(pages_of(entries))
        self.pool.release(pages_of(loaded))  # loaded for it alone: now held by ``entries`` only
        seq.reuse.loaded = {}
        if self.linear is not None:  # held by the request until placed, whatever the store drops meanwhile
            seq.reuse.linear_pieces = {key: self.linear.get(key) for key in entries}
        try:
            computed = self._prefill(list(missing.items()), reserve, entries, seq.cache_salt, seq.reuse.linear_pieces)
        except BaseException:
            self.pool.release(pages_of(entries))
            raise
        seq.reuse.fresh_chunk_tokens = sum(len(t) - s for t, s in missing.values())
        return entries, computed

    def _cached(self, key: str, find):
        """The chunk's cached entry, or None where it is missing (on a hybrid, also where its
        linear-layer entry is: the chunk is prefilled again)."""
        entry = find(key)
        return None if entry is None or (self.linear is not None and key not in self.linear) else entry

    def release(self, entries: dict) -> None:
        self.pool.release(pages_of(entries))

    def drop_loaded(self, seq: Sequence) -> None:
        """Give back what a tier load left for a request that will not place it (aborted)."""
        if seq.reuse is not None and seq.reuse.loaded:
            self.pool.release(pages_of(seq.reuse.loaded))
            seq.reuse.loaded = {}

    def _prefill(self, missing: list, reserve: int, entries: dict, salt: str | None, pieces: dict | None) -> int:
        """Prefill chunks at their canonical positions as short-lived dense pool sequences (from
        any cached prefix), ``chunk_slots`` and one token budget at a time; the chunk cache keeps
        their pages. Adds each pinned entry to ``entries`` (on a hybrid its linear-layer entry to
        ``pieces``); returns tokens computed."""
        computed = 0
        while missing:
            group, tokens = [], 0
            while missing and len(group) < self.chunk_slots and (not group or tokens + len(missing[0][1][0])
                                                            <= self.max_batched_tokens):
                group.append(missing.pop(0))
                tokens += len(group[-1][1][0])
            ids = []
            try:
                cached = [self._start_chunk(toks, start, reserve, entries, salt, ids) for _, (toks, start) in group]
                capture = self._capture(group, cached)
                self.runner.forward("dense", ids, [g[1][0][m:] for g, m in zip(group, cached)], cached,
                                    extras=None if capture is None else {"linear_capture": capture})
                computed += sum(len(g[1][0]) - m for g, m in zip(group, cached))
                for sid, (key, (toks, start)) in zip(ids, group):
                    self._keep_chunk(sid, key, toks, start, entries, salt)
                if capture is not None:
                    for (key, _), chunk in zip(group, capture.chunks()):
                        self.linear.put(key, chunk)
                        pieces[key] = chunk
            finally:
                for sid in ids:
                    self.pool.free_sequence(sid)
        return computed

    def _capture(self, group: list, cached: list[int]) -> ChunkCapture | None:
        """A hybrid's linear-layer capture over the chunks' own rows of a chunk-prefill forward."""
        if self.linear is None:
            return None
        spans, row = [], 0
        for (_, (toks, start)), m in zip(group, cached):
            spans.append((row + start - m, len(toks) - start))
            row += len(toks) - m
        return ChunkCapture(spans, self.adapter.state_layout().linear_layers, self.linear_spec.conv_kernel)

    def _start_chunk(self, toks, start: int, reserve: int, entries: dict, salt, ids: list) -> int:
        """A pool sequence for one chunk prefill, from any cached prefix of it; returns the tokens
        that prefix covers (on a hybrid at most the chunk's start: its own rows are computed, and
        the cached prefix's linear state is resumed)."""
        sid = self.next_pool_id()
        self.pool.add_sequence(sid, "dense")
        ids.append(sid)
        m = 0
        limit = len(toks) - 1 if self.linear is None else start
        if self.prefix_cache is not None and limit > 0:
            m, table = self.prefix_cache.match("dense", toks, limit, salt)
            if m:
                self.pool.share(sid, table, m)
                resume = getattr(self.prefix_cache, "resume", None)  # a hybrid's: the linear state there
                if resume is not None:
                    resume("dense", toks, m, salt, self.pool.slot(sid))
        need = self.pool.pages_needed(len(toks), m).peak + reserve
        if need > self.pool.num_free_pages:
            self.reclaim(need - self.pool.num_free_pages, entries)
        if need > self.pool.num_free_pages:
            raise PoolExhausted(f"a chunk prefill needs {need} pages, {self.pool.num_free_pages} are free")
        self.pool.ensure(sid, len(toks))
        return m

    def _keep_chunk(self, sid: int, key: str, toks, start: int, entries: dict, salt) -> None:
        ps = self.pool.page_size
        table = self.pool.table(sid)
        if self.prefix_cache is not None:
            self.prefix_cache.insert("dense", toks, table, salt)
        pages = table[:, :, start // ps:-(-len(toks) // ps)]
        self.chunk_cache.insert(key, toks[start:], start, pages, start % ps)
        # pinned for this request (also when the cache is capped below its size)
        entries[key] = self.chunk_cache.peek(key) or ChunkPages(tuple(toks[start:]), start, pages.copy(), start % ps)
        self.pool.retain(entries[key].pages)

    # ------------------------------------------------------------------ placement

    def place(self, seq: Sequence, entries: dict) -> None:
        """Copy the prompt prefix's and every chunk's cached KV into the request's own pages, keys
        rotated from the chunk's canonical position to where it sits (one store per piece, all
        layers at once); no forward runs here. A placed-chunk method then prefills from the question
        (``epic``'s first prefill forward also recomputes each chunk's first tokens in place); a
        recovery method holds pages for its whole prompt and gets its recovery policy, run by the
        next forward."""
        spec, cp, r = get_method(seq.method), seq.chunked_prompt, seq.reuse
        end = len(seq.token_ids) if spec.recovers else cp.suffix_start
        self.pool.ensure(seq.seq_id, end)
        self._copy_in(seq, entries)
        r.done = True
        seq.exact_kv = False  # reused chunk KV: never offered to the prefix cache
        options, sparse = with_budget(self.options, self.sparse, seq.budget)
        if spec.recovers:
            inputs = PolicyInputs(cp, self.config, self.head_config, sparse, options, self.device)
            r.recovery = spec.build_policy(inputs)
            cached = len(cp.prefix) if spec.cached_from == "prefix" else cp.suffix_start
            seq.cached_tokens = max(0, cached - r.fresh_chunk_tokens)
            return
        r.recomputed, r.spans = [], []
        if self.linear is not None:
            self._place_linear(seq, options.linear_decay_threshold)
        if spec.recompute_chunk_heads:  # computed by the request's first prefill forward, beside its question
            r.spans = [(s, min(options.epic_tokens, len(c))) for c, s in zip(cp.chunks, cp.chunk_starts)]
            r.recomputed = [p for s, n in r.spans for p in range(s, s + n)]
        seq.num_computed = end
        seq.cached_tokens = end - r.fresh_chunk_tokens

    def _place_linear(self, seq: Sequence, threshold: float) -> None:
        """Compose the prefix's and chunks' linear-layer entries into the request's state slot (the
        question's prefill continues from there) and keep what it did for the FLOPs. Nothing to
        place: the question starts at position 0, from a zero state."""
        if not self.specs(seq):
            return
        placed = self.compose_linear(seq, threshold)
        self.pool.linear_state.put(self.pool.slot(seq.seq_id), placed.conv, placed.recurrent)
        seq.reuse.linear = LinearReuse(placed.composed, placed.dropped, placed.exact)
        seq.reuse.linear_pieces = None

    def compose_linear(self, seq: Sequence, threshold: float):
        """The linear layers' state after the request's prefix and chunks, placed in prompt order
        (``cache/linear_chunks.compose``), from the entries ``ensure`` gave the request."""
        pieces = [seq.reuse.linear_pieces[key] for key, _, _ in self.specs(seq)]
        with torch.inference_mode():
            return compose(pieces, threshold, self.linear_spec.conv_kernel)

    def _copy_in(self, seq: Sequence, entries: dict) -> None:
        """Copy the pieces' cached K/V into the request's pages in groups of up to
        ``COPY_GROUP_TOKENS`` tokens (a longer piece alone): per group one read of its pages, one
        rotation (each token by its piece's move) and one store, so a hundred short documents cost
        about what one long one does."""
        cp = seq.chunked_prompt
        self.pool.sync_device_tables()
        slot = torch.tensor([self.pool.slot(seq.seq_id)], device=self.device)
        tables = self.pool.device_tables.index_select(1, slot)[:, 0]
        positions = [0] * bool(cp.prefix) + list(cp.chunk_starts)
        group, size = [], 0
        with torch.inference_mode():
            for (key, _, start), pos in zip(self.specs(seq), positions):
                entry = entries[key]
                if group and size + entry.num_tokens > COPY_GROUP_TOKENS:
                    self._store_group(group, tables)
                    group, size = [], 0
                group.append((entry, pos - start, pos))
                size += entry.num_tokens
            if group:
                self._store_group(group, tables)

    def _store_group(self, group: list[tuple[ChunkPages, int, int]], tables: torch.Tensor) -> None:
        """Store (entry, move, position) pieces into the pages of ``tables`` [L, Hkv, pages]."""
        L = self.pool.num_layers  # layers with K/V pages (a hybrid's full-attention layers)
        k, v = self.chunk_cache.gather_many([e for e, _, _ in group])
        n = k.shape[1]
        # positions and moves on the host (no device sync), one copy each to the device
        counts = np.array([e.num_tokens for e, _, _ in group])
        moves = np.array([m for _, m, _ in group])
        starts = np.array([p for _, _, p in group])
        if moves.any():
            delta = int(moves[0]) if (moves == moves[0]).all() else torch.from_numpy(
                np.repeat(moves, counts)).to(self.device)
            k = self.adapter.relocate_layers(k, delta)
        first = np.cumsum(counts) - counts  # each piece's first row in the group
        q_pos = torch.from_numpy(np.tile(np.arange(n) + np.repeat(starts - first, counts), L)).to(self.device)
        cu = torch.arange(0, (L + 1) * n, n, dtype=torch.int32, device=self.device)
        lens = torch.full((L,), int(starts.max()) + n, dtype=torch.int32, device=self.device)
        self.runner.attn.store(k.reshape(L * n, *k.shape[2:]), v.reshape(L * n, *v.shape[2:]),
                               tables, cu, lens, q_pos=q_pos)
