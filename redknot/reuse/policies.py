"""The recovery policies: what each layer of a reuse method's prefill recomputes.

A policy decides, per layer, which positions are computed (the rest keep cached, relocated K/V),
what each head sees, and which rows go through the FFN. ``registry.py`` builds one per request
from the method's spec; the engine's recovery forward (``engine/recovery_batch.py``) runs it.
"""

from __future__ import annotations

import torch

from ..config import SparseFFNConfig
from .recovery import Policy

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

    def __init__(self, positions, window, sink, is_chunk: torch.Tensor, ratio: float, check_layer: int = 1,
                 chunk_id: torch.Tensor | None = None, correction=None):
        super().__init__(positions, window, sink)
        self.is_chunk, self.ratio, self.check_layer = is_chunk, ratio, check_layer
        # KV correction (a ``reuse.correction.KVCorrection``): after the check layer the rows left
        # out move by their chunk's mean offset over the chunk's recomputed rows
        self.chunk_id, self.correction = chunk_id, correction

    def kv_correction(self, layer, cur):
        if self.correction is None or layer <= self.check_layer:
            return None
        return self.chunk_id, self.is_chunk[cur], self.correction

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


class QuestionScores(FixedSet):
    """The scoring pass of a question-guided recovery: only the question's rows run, over the
    placed (relocated, not recomputed) K/V, through every layer. At each layer from ``from_layer``
    on, the attention its ``observe`` last queries give every key, as a share of what they give the
    chunk tokens, adds to ``score`` [N]: those layers have the same say, whatever their sinks take."""

    def __init__(self, positions, window, sink, is_chunk: torch.Tensor, observe: int, from_layer: int = 0):
        super().__init__(positions, window, sink)
        self.is_chunk, self.n_obs, self.from_layer = is_chunk, observe, from_layer
        self.score: torch.Tensor | None = None

    def observe(self, layer):
        return self.n_obs if layer >= self.from_layer else 0

    def keep_rows(self, layer, cur, info):
        if layer < self.from_layer:
            return None
        mass = info["mass"].float()
        # a masked sum, not mass[is_chunk]: boolean indexing would wait on the device at every layer
        chunk_mass = torch.where(self.is_chunk.to(mass.device), mass, 0.0).sum()
        share = mass / chunk_mass.clamp_min(torch.finfo(torch.float32).tiny)
        # the first layer counted starts the sum: a pass run again (a preempted recovery) scores afresh
        self.score = share if layer == self.from_layer else self.score + share
        return None


class QueryRecompute(FixedSet):
    """Query-guided recomputation (ProphetKV, FusionRAG's query-guided selection, A³): the attention
    the question gives the chunk tokens ranks them, and the ``ratio`` of chunk rows ranked highest
    (each chunk's first ``start_tokens`` first of all) are recomputed with the question; the rest
    keep their cached, relocated K/V. Where the ranking comes from:

    - ``scorer`` None: every row runs up to ``score_layer``, where the question's last ``observe``
      queries rank them; the rows chosen go on through every later layer.
    - ``scorer`` a ``QuestionScores``: a first forward runs the question alone over the placed K/V
      and sums its attention over every layer (``scoring_pass``); the rows chosen then run from
      layer 0 through every layer.

    Either way the scoring work is executed, so its FLOPs are in the method's count.

    ``correction`` (a ``reuse.correction.KVCorrection``) turns on KV correction: at every
    later layer the cached K/V of the tokens left out move by their chunk's mean offset over its
    recomputed tokens (those past its first ``start_tokens``, whose cache-time context differs most)."""

    def __init__(self, positions, window, sink, is_chunk: torch.Tensor, chunk_id: torch.Tensor, ratio: float,
                 score_layer: int, observe: int, start_tokens: int, correction=None,
                 scorer: QuestionScores | None = None):
        super().__init__(positions, window, sink)
        self.is_chunk, self.chunk_id, self.ratio = is_chunk, chunk_id, ratio
        self.score_layer, self.n_obs, self.correction = (-1 if scorer else score_layer), observe, correction
        self.chunk_start = chunk_start_rows(chunk_id, start_tokens)
        self.scorer = scorer

    def scoring_pass(self):
        return self.scorer

    def initial(self):
        if self.scorer is None:
            return self.positions
        if self.scorer.score is None:
            raise ValueError("qrecompute: the scoring pass has not run")
        pos = self.positions
        score = self.scorer.score.to(pos.device)
        return pos[query_ranked_rows(score[pos], self.is_chunk[pos], self.chunk_start[pos], self.ratio)]

    def observe(self, layer):
        return self.n_obs if layer == self.score_layer else 0

    def keep_rows(self, layer, cur, info):
        if layer != self.score_layer:
            return None
        return query_ranked_rows(info["mass"][cur], self.is_chunk[cur], self.chunk_start[cur], self.ratio)

    def kv_correction(self, layer, cur):
        # layer 0's K/V are the token's own projections: cached and recomputed agree there
        if self.correction is None or layer <= max(self.score_layer, 0):
            return None
        return self.chunk_id, self.is_chunk[cur] & ~self.chunk_start[cur], self.correction


def query_ranked_rows(score: torch.Tensor, is_chunk: torch.Tensor, first: torch.Tensor, ratio: float) -> torch.Tensor:
    """Rows kept (sorted indices): every row outside chunks and round(ratio × chunk rows) chunk rows,
    those marked ``first`` before the rest, then by ``score`` (highest first; ties to the later row)."""
    chunk_rows = is_chunk.nonzero().flatten()
    n_keep = int(round(ratio * chunk_rows.numel()))
    s = torch.where(first[chunk_rows], torch.full((), float("inf"), device=score.device), score[chunk_rows].float())
    top = chunk_rows[rank_descending(s)[:n_keep]]
    return torch.cat([top, (~is_chunk).nonzero().flatten()]).sort().values


class RedKnot(FixedSet):
    def __init__(self, positions, window, sink, shallow_window, shallow_sink, is_chunk: torch.Tensor,
                 sparse: SparseFFNConfig, observe: int, keep_cached: bool, chunk_id: torch.Tensor | None = None,
                 correction=None, scorer: QuestionScores | None = None):
        super().__init__(positions, window, sink)
        if scorer is not None and sparse.importance != "attention":
            raise ValueError(f"a question pass ranks by attention: it needs the sparse FFN's importance "
                             f"'attention', not {sparse.importance!r}")
        # a question pass (``QuestionScores``) ranks the FFN rows in place of the attention the
        # question's last queries give at the sparse layer itself
        self.scorer = scorer
        if correction is not None and not keep_cached:
            raise ValueError("kv_correction needs the rows left out to keep their cached K/V (redknot, not "
                             "redknot_paper)")
        self.correction = correction  # KV correction after the first sparse layer (reuse.correction)
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

    def scoring_pass(self):
        return self.scorer

    def observe(self, layer):
        sparse = self.sparse.threshold(layer) is not None and self.sparse.importance == "attention"
        return self.n_obs if sparse and not self._selected and self.scorer is None else 0

    def row_score(self, info: dict) -> torch.Tensor | None:
        """What ranks the rows for the sparse FFN under attention importance, per position [N]: the
        question pass's score, else the mass the question's last queries gave at this layer."""
        return self.scorer.score if self.scorer is not None else info["mass"]

    def needs_deviation(self, layer):
        return (self.sparse.importance == "deviation" and self.sparse.threshold(layer) is not None
                and not self._selected)

    @property
    def _selected(self) -> bool:
        """redknot under keep_fraction after its one selection: the rows left are exactly those
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
        if imp == "attention":
            score = self.row_score(info)[cur]
        else:
            score = info.get("v_deviation" if imp == "deviation" else "cross")
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

    def kv_correction(self, layer, cur):
        """After the first sparse layer (where rows start to be left out): the left-out chunk rows
        move by their chunk's mean offset over its rows still computed, past its first
        ``chunk_start_tokens`` (kept by rule, and the rows whose cache-time context differs most)."""
        if self.correction is None or layer <= self.sparse.dense_until:
            return None
        return self.chunk_id, self.is_chunk[cur] & ~self.chunk_start[cur], self.correction


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
    the question. Scores are first put on a grid of 2**-20 of the row's largest (``tie_robust``), so
    that scores a device's rounding tells apart, and no more, tie too."""
    n = score.shape[-1]
    return (n - 1) - tie_robust(score).flip(-1).sort(dim=-1, descending=True, stable=True).indices


def tie_robust(score: torch.Tensor, bits: int = 20) -> torch.Tensor:
    """``score`` rounded to a grid of ``2**-bits`` times the largest finite magnitude along the last
    dimension; infinities pass through. A float32 softmax gives an attention share of 0.5 as
    0.49999997 on one CPU and 0.5 on another, and shares of 3e-7 and 2e-7 are rounding noise: on
    the grid they are equal, and the ranking's tie rule, not the hardware, decides between them."""
    if not score.is_floating_point() or score.numel() == 0:
        return score
    finite = torch.isfinite(score)
    scale = torch.where(finite, score.abs(), torch.zeros((), dtype=score.dtype, device=score.device))
    step = scale.amax(-1, keepdim=True) * 2.0 ** -bits
    step = torch.where(step > 0, step, torch.ones_like(step))
    return torch.where(finite, torch.round(score / step) * step, score)


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

