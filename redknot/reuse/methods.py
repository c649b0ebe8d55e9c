"""Reuse methods as policies over the recovery forward, and the engine that feeds them chunk KV.

dense          every token, every layer (the baseline, through the same forward)
prefix         exact KV of the longest cached prefix ending at a chunk boundary; the rest dense
full_reuse     prefix + relocated chunk KV as they are; only the suffix is computed
epic           full_reuse, plus the first `epic_tokens` tokens of each chunk recomputed
cacheblend     layers up to `cacheblend_check_layer` (1) recompute every chunk token; the
               `cacheblend_ratio` whose values there deviate most from their cached version
               continue, the rest keep the cache
redknot        one forward over chunks + suffix (the first chunk's cache is exact and stays): shallow
               layers (< dense_until) attend locally (every head, the suffix's included, within its
               sink + window) with a dense FFN; deeper layers give global
               heads the full context and local heads their window, and run the FFN only on the
               tokens that receive the most attention from the suffix's last tokens (tiered
               thresholds; or SparseFFNConfig.keep_fraction of them, ranked by its importance,
               e.g. "cross": attention to other chunks, "chunk": the same averaged per chunk);
               the rest keep their residual
redknot_kv     redknot, but a token left out of a layer's FFN stops there: later layers use its
               cached (relocated) KV, so projections and attention shrink with the FFN
redknot_exact  the redknot code path with every head global, dense FFN, every chunk recomputed:
               equals dense (the correctness gate)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ..cache.chunk_store import ChunkKV, ChunkStore, chunk_key
from ..config import DEFAULT_SINK, HeadConfig, SparseFFNConfig
from ..models.config import ModelConfig
from ..models.llama import LlamaForCausalLM
from .flops import FlopReport
from .prompt import ChunkedPrompt
from .recovery import Policy, Recovered, kv_buffer, recover

CHUNK_METHODS = ("full_reuse", "epic", "cacheblend", "redknot", "redknot_kv", "redknot_exact")
REUSE_METHODS = ("dense", "prefix") + CHUNK_METHODS
# Also runnable through the engine (benchmarks): no reuse, each head sees only its visible set.
ENGINE_METHODS = REUSE_METHODS + ("headsparse",)


# Knobs a request may set after "@" in its method (``cacheblend@0.3``): method -> (field, type).
BUDGET_KNOBS = {"cacheblend": ("cacheblend_ratio", float), "epic": ("epic_tokens", int),
                "redknot": ("keep_fraction", float), "redknot_kv": ("keep_fraction", float)}
_REUSE_KNOBS = ("cacheblend_ratio", "epic_tokens")


def parse_method(spec: str) -> tuple[str, dict]:
    """``"cacheblend@0.3"`` -> ``("cacheblend", {"cacheblend_ratio": 0.3})``, ``"epic@32"`` ->
    tokens recomputed per chunk, ``"redknot_kv@0.2"`` -> the sparse FFN's keep fraction (with
    ``+sN``: each chunk's first N tokens among the kept rows; without it none); a plain name ->
    (name, {}). Raises ValueError naming what is wrong."""
    name, at, value = spec.partition("@")
    if not at:
        return name, {}
    if name not in BUDGET_KNOBS:
        raise ValueError(f"method {spec!r}: only {', '.join(BUDGET_KNOBS)} take a budget after '@'")
    value, *extras = value.split("+")
    field_, kind = BUDGET_KNOBS[name]
    try:
        v = kind(value)
    except ValueError:
        raise ValueError(f"method {spec!r}: {value!r} is not a {kind.__name__} ({field_})") from None
    if v < 0 or (kind is float and (v != v or v > 1)) or (field_ == "keep_fraction" and v == 0):
        raise ValueError(f"method {spec!r}: {field_} out of range")
    knobs = {field_: v}
    if field_ == "keep_fraction":
        knobs["chunk_start_tokens"] = 0
        for extra in extras:
            if not extra.startswith("s") or not extra[1:].isdigit():
                raise ValueError(f"method {spec!r}: {extra!r} is not a chunk-start count ('+s16')")
            knobs["chunk_start_tokens"] = int(extra[1:])
    elif extras:
        raise ValueError(f"method {spec!r}: only redknot and redknot_kv take '+sN'")
    return name, knobs


@dataclass
class ReuseOptions:
    epic_tokens: int = 16
    cacheblend_ratio: float = 0.15
    # The layer whose value deviation ranks CacheBlend's rows (LMCache's blend_check_layers). Not 0:
    # layer 0's values depend on the token alone, so cached and recomputed ones agree to rounding there.
    cacheblend_check_layer: int = 1
    observation_tokens: int = 16  # suffix tail whose attention mass ranks tokens for the sparse FFN
    shallow_window: int | None = None  # local-recovery window of global heads; None: widest local window

    def __post_init__(self):
        if self.shallow_window is not None and self.shallow_window < 1:
            raise ValueError(f"ReuseOptions.shallow_window={self.shallow_window!r}: use a window >= 1 or None")
        if self.cacheblend_check_layer < 0:
            raise ValueError(f"ReuseOptions.cacheblend_check_layer={self.cacheblend_check_layer!r}: use a layer >= 0")


@dataclass
class PrefillResult:
    recovered: Recovered
    cached_tokens: int  # prompt tokens whose KV came from a cache at layer 0
    offline_flops: FlopReport = field(default_factory=FlopReport)  # chunks computed for this request
    offline_s: float = 0.0


class FixedSet(Policy):
    def __init__(self, positions: torch.Tensor, window: torch.Tensor, sink: torch.Tensor):
        self.positions, self.window, self.sink = positions, window, sink

    def initial(self):
        return self.positions

    def visibility(self, layer):
        return self.window[layer], self.sink[layer]


class CacheBlend(FixedSet):
    """Recompute every row up to the check layer; after it keep the `ratio` of chunk tokens whose
    values there deviate most from their cached version (and every other row).

    The deviation is read at a layer past the first: layer 0's values are a projection of the
    token's own embedding, equal to the cached ones up to rounding, so a ranking there orders
    rounding noise (and differs between devices). From layer 1 on a value carries what the
    token's layer-0 attention saw: the cross-chunk context the cache lacks."""

    def __init__(self, positions, window, sink, is_chunk: torch.Tensor, ratio: float, check_layer: int = 1):
        super().__init__(positions, window, sink)
        self.is_chunk, self.ratio, self.check_layer = is_chunk, ratio, check_layer

    def needs_deviation(self, layer):
        return layer == self.check_layer

    def keep_rows(self, layer, cur, info):
        if layer != self.check_layer:
            return None
        chunk_rows = self.is_chunk[cur].nonzero().flatten()
        n_keep = int(round(self.ratio * chunk_rows.numel()))
        top = chunk_rows[rank_descending(info["v_deviation"][chunk_rows])[:n_keep]]
        rest = (~self.is_chunk[cur]).nonzero().flatten()
        return torch.cat([top, rest]).sort().values


class RedKnot(FixedSet):
    def __init__(self, positions, window, sink, shallow_window, shallow_sink, is_chunk: torch.Tensor,
                 sparse: SparseFFNConfig, observe: int, keep_cached: bool, chunk_id: torch.Tensor | None = None):
        super().__init__(positions, window, sink)
        self.shallow = (shallow_window, shallow_sink)
        self.is_chunk, self.sparse, self.n_obs, self.keep_cached = is_chunk, sparse, observe, keep_cached
        self.chunk_id = chunk_id if chunk_id is not None else torch.where(is_chunk, 0, -1)  # per position
        self.chunk_start = chunk_start_rows(self.chunk_id, sparse.chunk_start_tokens)  # always through the FFN
        self._rows = None
        self._n_keep = None  # keep_fraction: the chunk-token count fixed at the first sparse layer

    def visibility(self, layer):
        if layer < self.sparse.dense_until:  # local recovery: every head within sink + window
            return self.shallow[0][layer], self.shallow[1][layer]
        return super().visibility(layer)

    def observe(self, layer):
        sparse = self.sparse.threshold(layer) is not None and self.sparse.importance == "attention"
        return self.n_obs if sparse and not self._selected else 0

    def needs_deviation(self, layer):
        return (self.sparse.importance == "deviation" and self.sparse.threshold(layer) is not None
                and not self._selected)

    @property
    def _selected(self) -> bool:
        """redknot_kv under keep_fraction after its one selection: the rows left are exactly those
        kept, so no later layer ranks (or observes) anything."""
        return self.keep_cached and self.sparse.keep_fraction is not None and self._n_keep is not None

    def cross_chunks(self, layer, cur):
        if self.sparse.threshold(layer) is None or self.sparse.importance not in ("cross", "chunk"):
            return None
        if self.sparse.keep_fraction == 1:
            return None  # every candidate is kept: nothing to rank
        if self._selected:
            return None
        return self.chunk_id

    def batchable(self) -> bool:
        """Whether ``rows_batch`` decides this policy's FFN rows (attention-mass ranking, one
        visibility for every query)."""
        return self.sparse.importance == "attention"

    def ffn_rows(self, layer, cur, info):
        thr = self.sparse.threshold(layer)
        if thr is None or (self.sparse.keep_fraction is not None and self._selected):
            self._rows = None
            return None
        imp = self.sparse.importance
        score = info["mass"][cur] if imp == "attention" else info.get("v_deviation" if imp == "deviation" else "cross")
        if imp == "chunk" and score is not None:
            score = chunk_ranked(score, self.chunk_id[cur])
        if score is None:  # keep_fraction 1: nothing to rank, every candidate is kept
            score = torch.zeros(cur.numel(), device=cur.device)
        lens = torch.tensor([cur.numel()], device=cur.device)
        keep = RedKnot.rows_batch([self], layer, lens, score[None], self.is_chunk[cur][None],
                                  self.chunk_start[cur][None])[0]
        self._rows = None if bool(keep.all()) else keep.nonzero().flatten()
        return self._rows

    @staticmethod
    def rows_batch(policies: list["RedKnot"], layer: int, lens: torch.Tensor, score: torch.Tensor,
                   is_chunk: torch.Tensor, chunk_start: torch.Tensor) -> torch.Tensor:
        """The FFN rows of several requests' policies (one sparse config) at a sparse layer,
        without a host sync: row r's computed rows are the first ``lens[r]`` of ``score``,
        ``is_chunk`` and ``chunk_start`` ([R, T], padded; the rows among their chunk's first
        ``chunk_start_tokens``, always kept). Returns the bool keep mask [R, T] (False on
        padding). Under keep_fraction each policy's count is fixed the first time it ranks."""
        sp = policies[0].sparse
        t = score.shape[-1]
        idx = torch.arange(t, device=score.device)
        valid = idx < lens[:, None]
        if sp.keep_fraction is None:
            keep = select_tokens_batched(score, is_chunk, lens, sp.threshold(layer), sp.recent_n, sp.min_keep)
            return keep | (chunk_start & valid)
        cand = is_chunk & valid & (idx < (lens - sp.recent_n)[:, None])  # chunk rows outside the last recent_n
        if any(p._n_keep is None for p in policies):
            n_keep = torch.ceil(sp.keep_fraction * cand.sum(-1).double()).long().clamp_min(sp.min_keep)
            for i, p in enumerate(policies):
                if p._n_keep is None:
                    p._n_keep = n_keep[i]
        n_keep = torch.stack([torch.as_tensor(p._n_keep, device=score.device) for p in policies])
        s = torch.where(cand, score.float(), torch.full((), float("-inf"), device=score.device))
        s = torch.where(cand & chunk_start, torch.full((), float("inf"), device=score.device), s)  # first places
        return valid & (~cand | (_rank_of(s) < n_keep[:, None]))

    def keep_rows(self, layer, cur, info):
        return self._rows if self.keep_cached else None


def chunk_start_rows(chunk_id: torch.Tensor, n: int) -> torch.Tensor:
    """bool per position: among the first ``n`` tokens of its chunk (``chunk_id`` per position,
    -1 outside chunks; a chunk is a run of one id)."""
    inside = chunk_id >= 0
    if n <= 0:
        return torch.zeros_like(inside)
    pos = torch.arange(chunk_id.numel(), device=chunk_id.device)
    first = torch.ones_like(inside)
    first[1:] = chunk_id[1:] != chunk_id[:-1]
    start = torch.where(first, pos, torch.zeros_like(pos)).cummax(0).values  # the run's first position
    return inside & (pos - start < n)


def chunk_ranked(cross: torch.Tensor, chunk_id: torch.Tensor) -> torch.Tensor:
    """Scores that rank rows chunk by chunk: a chunk with a higher mean cross-chunk mass outranks
    every row of a lower one; within a chunk rows keep their own order. A continuation whose only
    link to an earlier document is a pronoun leans on that document as a whole, while its answer
    token may give the other chunk little mass itself: so the share kept is decided per chunk."""
    cross = cross.float()
    ids = chunk_id.clamp_min(0)
    inside = chunk_id >= 0
    n = int(ids.max()) + 1
    total = torch.zeros(n, device=cross.device).index_add_(0, ids[inside], cross[inside])
    count = torch.zeros(n, device=cross.device).index_add_(0, ids[inside], torch.ones_like(cross[inside]))
    mean = total / count.clamp_min(1)
    order = torch.empty(n, dtype=torch.float32, device=cross.device)  # a chunk's rank, 0 = lowest mean
    order[rank_descending(mean).flip(0)] = torch.arange(n, dtype=torch.float32, device=cross.device)
    # cross is a mass in [0, 1]: a step of 2 between chunks keeps them apart whatever the rows' own scores
    return torch.where(inside, 2 * order[ids] + cross, cross)


def rank_descending(score: torch.Tensor) -> torch.Tensor:
    """Indices of a score along its last dimension, highest first; equal scores rank the later row
    first. topk and an unstable argsort leave ties in an order that differs between devices and
    kernels, and a keep threshold can fall among ties (a row that sees no other chunk scores exactly
    0): a fixed rule keeps the same rows everywhere, and the later of two equal rows is the nearer
    the question."""
    n = score.shape[-1]
    return (n - 1) - score.flip(-1).sort(dim=-1, descending=True, stable=True).indices


def _rank_of(score: torch.Tensor) -> torch.Tensor:
    """Each entry's place in ``rank_descending`` order (0: highest), along the last dimension."""
    order = rank_descending(score)
    places = torch.arange(score.shape[-1], device=score.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def select_tokens(score: torch.Tensor, candidate: torch.Tensor, drop_share: float, recent_n: int,
                  min_keep: int) -> torch.Tensor:
    """Rows kept: every non-candidate, the last recent_n rows, and the fewest candidates (highest
    score first) that cover 1 - drop_share of the candidates' score; at least min_keep rows."""
    lens = torch.tensor([score.numel()], device=score.device)
    return select_tokens_batched(score[None], candidate[None], lens, drop_share, recent_n, min_keep)[0].nonzero().flatten()


def select_tokens_batched(score: torch.Tensor, candidate: torch.Tensor, lens: torch.Tensor, drop_share: float,
                          recent_n: int, min_keep: int) -> torch.Tensor:
    """``select_tokens`` for R rows at once, without a host sync: row r's entries are the first
    ``lens[r]`` of score/candidate [R, T]. Returns the bool keep mask [R, T] (False on padding)."""
    t = score.shape[-1]
    idx = torch.arange(t, device=score.device)
    valid = idx < lens[:, None]
    keep = valid & (~candidate | (idx >= (lens - recent_n)[:, None]))
    rows = candidate & valid & ~keep
    s = torch.where(rows, score.float().clamp_min(0), torch.zeros((), device=score.device))
    place = _rank_of(torch.where(rows, s, torch.full((), -1.0, device=score.device)))  # rows first
    total = s.sum(-1, dtype=torch.float64)
    # the share the best candidates cover, in float64 so that the cut does not move with the sum's order
    share = torch.zeros_like(s, dtype=torch.float64).scatter_(-1, place, s.double()).cumsum(-1) / total[:, None]
    n_take = torch.where(total > 0, (share < 1 - drop_share).sum(-1) + 1, torch.zeros_like(total, dtype=torch.long))
    n_take = torch.minimum(rows.sum(-1), torch.maximum(n_take, min_keep - keep.sum(-1)))
    return keep | (rows & (place < n_take[:, None]))


class ReuseEngine:
    """Turns a ChunkedPrompt into a prefill for any method, caching prefix and chunk KV by content."""

    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, fingerprint: str, head_config: HeadConfig | None,
                 sparse: SparseFFNConfig, store: ChunkStore, prefix_store: ChunkStore, device: torch.device,
                 options: ReuseOptions | None = None):
        self.model, self.cfg, self.device = model, cfg, device
        self.fingerprint = fingerprint  # keys carry this model's identity, whatever store they go to
        self._namespace = fingerprint  # and, for the prefill running, its cache namespace
        self.head_config, self.sparse = head_config, sparse
        self.store, self.prefix_store = store, prefix_store
        self.options = options or ReuseOptions()
        self.kernel = "auto"  # the recovery forward's attention path (recovery.recover)
        glob = HeadConfig.all_global(cfg.num_hidden_layers, cfg.num_key_value_heads)
        self.global_vis = _tensors(glob.visibility(cfg.sliding_windows))

    # ---- chunk KV -----------------------------------------------------------------------------
    def _key(self, prefix, ids) -> str:
        return chunk_key(self._namespace, prefix, ids)

    def _entry(self, store: ChunkStore, key: str, prefix: tuple, ids: tuple, start: int,
               offline: list) -> ChunkKV:
        entry = store.get(key)
        if entry is not None:
            return entry
        t0 = time.perf_counter()
        base = self._entry(self.store, self._key((), prefix), (), prefix, 0, offline) if prefix else None
        tokens = torch.tensor(prefix + ids, device=self.device)
        n = tokens.numel()
        positions = torch.arange(start, n, device=self.device)
        if base is not None:
            ck, cv, cached = self._empty_cache(n)
            for l in range(self.cfg.num_hidden_layers):
                ck[l][:start], cv[l][:start] = base.k[l], base.v[l]
            cached[:start] = True
            rec = recover(self.model, tokens, FixedSet(positions, *self.global_vis), ck, cv, cached, self.kernel)
        else:
            rec = recover(self.model, tokens, FixedSet(positions, *self.global_vis), kernel=self.kernel)
        entry = ChunkKV(tuple(ids), start, torch.stack([k[start:] for k in rec.k]),
                        torch.stack([v[start:] for v in rec.v]), compute_s=time.perf_counter() - t0)
        offline.append((rec.flops, entry.compute_s))
        store.put(key, entry)
        return entry

    def _empty_cache(self, n: int):
        c = self.cfg
        dtype = next(self.model.parameters()).dtype

        def buf():
            return kv_buffer(n, c.num_key_value_heads, c.head_dim, dtype, self.device)

        ck = [buf() for _ in range(c.num_hidden_layers)]
        cv = [buf() for _ in range(c.num_hidden_layers)]
        return ck, cv, torch.zeros(n, dtype=torch.bool, device=self.device)

    def _place(self, ck, cv, entry: ChunkKV, at: int) -> None:
        """Copy a cached chunk into the request's cache at offset `at`, keys relocated in fp32."""
        n = entry.num_tokens
        rope = self.model.model.rotary_emb
        k = entry.k.to(self.device)
        if at != entry.start:
            L, _, h, d = k.shape
            k = rope.relocate(k.reshape(L * n, h, d), at - entry.start).view(L, n, h, d)
        for l in range(self.cfg.num_hidden_layers):
            ck[l][at:at + n] = k[l]
            cv[l][at:at + n] = entry.v[l].to(self.device)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, prompt: ChunkedPrompt, method: str, namespace: str | None = None) -> PrefillResult:
        """``namespace``: the cache key namespace (default: the model fingerprint; a salted one
        keeps one tenant's chunks apart from another's)."""
        self._namespace = namespace or self.fingerprint
        try:
            return self._prefill(prompt, method)
        finally:
            self._namespace = self.fingerprint

    def _prefill(self, prompt: ChunkedPrompt, method: str) -> PrefillResult:
        if method not in ENGINE_METHODS:
            raise ValueError(f"unknown reuse method {method!r} (available: {', '.join(ENGINE_METHODS)})")
        tokens = torch.tensor(prompt.token_ids, device=self.device)
        n = tokens.numel()
        all_pos = torch.arange(n, device=self.device)
        if method == "dense":
            return PrefillResult(recover(self.model, tokens, FixedSet(all_pos, *self.global_vis), kernel=self.kernel), 0)
        if method == "prefix":
            return self._prefix(prompt, tokens)
        if method == "headsparse":
            if self.head_config is None:
                raise ValueError("method='headsparse' needs a head_config")
            vis = _tensors(self.head_config.visibility(self.cfg.sliding_windows))
            return PrefillResult(recover(self.model, tokens, FixedSet(all_pos, *vis), kernel=self.kernel), 0)
        offline: list = []
        ck, cv, cached = self._empty_cache(n)
        p = len(prompt.prefix)
        if p:
            self._place(ck, cv, self._entry(self.store, self._key((), prompt.prefix), (), prompt.prefix, 0,
                                            offline), 0)
            cached[:p] = True
        for ids, at in zip(prompt.chunks, prompt.chunk_starts):
            entry = self._entry(self.store, self._key(prompt.prefix, ids), prompt.prefix, ids, p, offline)
            self._place(ck, cv, entry, at)
        policy, cached = self.policy(prompt, method)
        rec = recover(self.model, tokens, policy, ck, cv, cached, self.kernel)
        off = FlopReport()
        for f, _ in offline:
            off = off.merge(f)
        return PrefillResult(rec, int(cached.sum()) if method != "redknot_exact" else p, off,
                             sum(s for _, s in offline))

    def policy(self, prompt: ChunkedPrompt, method: str, budget: dict | None = None) -> tuple[Policy, torch.Tensor]:
        """The chunk method's recovery policy over ``prompt`` and the positions whose K/V it
        takes from the cache (bool [N]: the prompt prefix and every chunk, relocated).
        ``budget``: a request's own knobs (``parse_method``), over the engine's options."""
        n = len(prompt)
        cached = torch.zeros(n, dtype=torch.bool, device=self.device)
        cached[:len(prompt.prefix)] = True
        is_chunk = torch.zeros(n, dtype=torch.bool, device=self.device)
        chunk_id = torch.full((n,), -1, dtype=torch.long, device=self.device)
        for i, (ids, at) in enumerate(zip(prompt.chunks, prompt.chunk_starts)):
            chunk_id[at:at + len(ids)] = i
            is_chunk[at:at + len(ids)] = True
        cached |= is_chunk
        options, sparse = self.options, self.sparse
        if budget:  # one request's knobs over the engine's options
            options = replace(options, **{k: v for k, v in budget.items() if k in _REUSE_KNOBS})
            sparse = replace(sparse, **{k: v for k, v in budget.items() if k not in _REUSE_KNOBS})
        return self._policy(method, prompt, is_chunk, chunk_id, options, sparse), cached

    def _policy(self, method: str, prompt: ChunkedPrompt, is_chunk: torch.Tensor, chunk_id: torch.Tensor,
                options: ReuseOptions | None = None, sparse: SparseFFNConfig | None = None) -> Policy:
        dev, n = self.device, len(prompt)
        suffix = torch.arange(prompt.suffix_start, n, device=dev)
        body = torch.arange(len(prompt.prefix), n, device=dev)  # chunks + suffix
        o = options or self.options
        if method == "full_reuse":
            return FixedSet(suffix, *self.global_vis)
        if method == "epic":
            heads = [torch.arange(at, at + min(o.epic_tokens, len(c)), device=dev)
                     for c, at in zip(prompt.chunks, prompt.chunk_starts)]
            return FixedSet(torch.cat(heads + [suffix]), *self.global_vis)
        if method == "cacheblend":
            return CacheBlend(body, *self.global_vis, is_chunk, o.cacheblend_ratio,
                              min(o.cacheblend_check_layer, self.cfg.num_hidden_layers - 1))
        if method == "redknot_exact":
            return RedKnot(body, *self.global_vis, *self.global_vis, is_chunk,
                           SparseFFNConfig(dense_until=self.cfg.num_hidden_layers,
                                           deep_layer_start=self.cfg.num_hidden_layers), 0, False)
        if self.head_config is None:
            raise ValueError(f"method={method!r} needs a head_config")
        window, sink = _tensors(self.head_config.visibility(self.cfg.sliding_windows))
        shallow_w, shallow_s = self._shallow(window, sink)
        # The first chunk was encoded right after the prefix, where it sits now: its cached K/V are
        # what dense prefill computes, so recomputing it (locally, in the shallow layers) only costs
        # FLOPs and moves it away from exact. Recovery starts at the second chunk.
        first = prompt.chunk_starts[1] if len(prompt.chunks) > 1 else prompt.suffix_start
        body = torch.arange(first, n, device=dev)
        return RedKnot(body, window, sink, shallow_w, shallow_s, is_chunk, sparse or self.sparse,
                       min(o.observation_tokens, len(prompt.suffix)), keep_cached=method == "redknot_kv",
                       chunk_id=chunk_id)

    def _shallow(self, window, sink):
        """Local recovery: global heads get the widest local window (or `shallow_window`) and a sink."""
        local = window[window < window.max()]
        w = self.options.shallow_window or (int(local.max()) if local.numel() else 1024)
        is_global = window > w
        return torch.where(is_global, w, window), torch.where(is_global, DEFAULT_SINK, sink)

    def _prefix(self, prompt: ChunkedPrompt, tokens: torch.Tensor) -> PrefillResult:
        """Exact prefix caching at chunk boundaries (what vLLM/SGLang prefix caching gives)."""
        ids = prompt.token_ids
        n = len(ids)
        bounds = [b for b in [len(prompt.prefix)] + [s + len(c) for c, s in zip(prompt.chunks, prompt.chunk_starts)]
                  if 0 < b < n]
        hit, entry = 0, None
        for b in reversed(bounds):
            entry = self.prefix_store.get(self._key((), tuple(ids[:b])))
            if entry is not None:
                hit = b
                break
        ck, cv, cached = self._empty_cache(n)
        if entry is not None:
            for l in range(self.cfg.num_hidden_layers):
                ck[l][:hit], cv[l][:hit] = entry.k[l].to(self.device), entry.v[l].to(self.device)
            cached[:hit] = True
        rec = recover(self.model, tokens, FixedSet(torch.arange(hit, n, device=self.device), *self.global_vis),
                      ck, cv, cached, self.kernel)
        for b in bounds:
            if b > hit:
                key = self._key((), tuple(ids[:b]))
                if not self.prefix_store.contains(key):
                    self.prefix_store.put(key, ChunkKV(tuple(ids[:b]), 0, torch.stack([k[:b] for k in rec.k]),
                                                       torch.stack([v[:b] for v in rec.v])))
        return PrefillResult(rec, hit)


def _tensors(vis) -> tuple[torch.Tensor, torch.Tensor]:
    window, sink = vis
    return torch.as_tensor(window, dtype=torch.int64), torch.as_tensor(sink, dtype=torch.int64)
