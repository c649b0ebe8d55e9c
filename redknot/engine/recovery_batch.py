"""The reuse recovery as a per-layer row policy inside the model's own batched forward.

A recovery method (cacheblend, qrecompute, redknot, redknot_paper, redknot_exact) computes, at each layer, only
some positions of each prompt; the others keep the relocated chunk K/V already copied into the
request's pages. ``RecoveryRows`` drives one packed forward over several such requests: each
request's ``Policy`` (``redknot.reuse.methods``) decides its rows per layer exactly as in the
reference recovery forward (``redknot.reuse.recovery.recover``), and this class turns those
per-request decisions into the batch's packed rows, query positions and lengths. The attention
backend calls it around each layer's store and attention (for what the policies observe: value
deviations, the attention mass of the question's last queries, cross-chunk mass); the model's
decoder layers call it for the FFN rows and the rows that continue.

K/V a policy needs beyond the rows computed (every key of a layer, to rank rows by the mass the
question gives them) is gathered from the request's pages: the pool is the only copy.
"""

from __future__ import annotations

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..models.config import ModelConfig
from ..reuse.correction import correct_layer
from ..reuse.flops import FlopReport
from ..reuse.policies import RedKnot
from ..reuse.recovery import Policy, cross_chunk_mass, observation_mass, observation_mass_batched
from ..visibility import visible_pairs_batched, visible_pairs_per_kv_head


class _Request:
    __slots__ = ("policy", "cur", "n", "cached", "info", "flops", "split_at", "layers", "row_share")

    def __init__(self, policy: Policy, n: int, cached: torch.Tensor, device):
        self.policy, self.n, self.cached = policy, n, cached
        self.cur = policy.initial().to(device)
        self.info: dict = {}
        self.flops = FlopReport()
        self.split_at = 0
        self.layers = []  # per layer: (rows, visible pairs per KV head as a device tensor, FFN rows)
        self.row_share = 1.0  # the projection work computed, as a share of a dense prefill's (flops())


class RecoveryRows:
    """Row bookkeeping of one recovery batch (requests of one method, so every layer has one
    visibility for all of them)."""

    def __init__(self, cfg: ModelConfig, policies: list[Policy], lengths: list[int], cached: list[torch.Tensor],
                 device: torch.device, tp=None, scored: "RecoveryRows | None" = None):
        self.cfg, self.device = cfg, device
        self.scored = scored  # the batch's scoring pass, run before (its FLOPs and row work are the requests' too)
        self.tp = tp  # the tensor-parallel group whose ranks hold the other heads (scores sum over them), or None
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scale = cfg.attention_scale
        self.requests = []
        for policy, n, c in zip(policies, lengths, cached):
            r = _Request(policy, n, c.to(device), device)
            covered = r.cached.clone()
            covered[r.cur] = True
            if not bool(covered.all()):
                raise ValueError("recovery policy leaves positions neither cached nor computed")
            self.requests.append(r)
        L = cfg.num_hidden_layers
        vis = [policies[0].visibility(layer) for layer in range(L)]
        for p in policies[1:]:
            for layer in range(L):
                w, s = p.visibility(layer)
                if not (torch.equal(w.cpu(), vis[layer][0].cpu()) and torch.equal(s.cpu(), vis[layer][1].cpu())):
                    raise ValueError("a recovery batch mixes policies with different visibility")
        self.window = torch.stack([w for w, _ in vis]).to(device=device, dtype=torch.int32)  # [L, Hkv]
        self.sink = torch.stack([s for _, s in vis]).to(device=device, dtype=torch.int32)
        self.batch: ForwardBatch | None = None  # the forward's metadata, set by the runner
        # a recovery split over steps (models' run_recovery_layers): the row-layers the current
        # step allows (None: no limit), those spent, and (hidden rows, positions, next layer) when paused
        self.budget: int | None = None
        self.spent = 0
        self.paused = None
        self.dropped_ok: list[torch.Tensor] = []  # per dropping layer: were the dropped rows cached (checked at the end)
        # Requests whose rows RedKnot.rows_batch decides together: each layer's selection runs on
        # padded [R, T] tensors (one nonzero and one count copy per layer, whatever R is), not
        # request by request.
        self.batched = (all(isinstance(p, RedKnot) and p.batchable() for p in policies)
                        and all(p.sparse == policies[0].sparse and p.keep_cached == policies[0].keep_cached
                                for p in policies))
        self._picked = None  # the batched path's last FFN selection: (keep mask [R, T], counts, packed rows)
        if self.batched:
            pad = torch.nn.utils.rnn.pad_sequence
            self._is_chunk = pad([p.is_chunk.to(device) for p in policies], batch_first=True)  # [R, N]
            self._chunk_start = pad([p.chunk_start.to(device) for p in policies], batch_first=True)
            self._cached = pad([r.cached for r in self.requests], batch_first=True)
            self._pad_rows()

    def remaining(self) -> int:
        """Row-layers left at most: the rows it paused with through every layer still to run."""
        if self.paused is None:
            return sum(r.n for r in self.requests) * self.cfg.num_hidden_layers
        x, _, start = self.paused
        return x.shape[0] * (self.cfg.num_hidden_layers - start)

    def may_run(self, n: int) -> bool:
        """May ``n`` rows go through one more layer within the step's budget of row-layers."""
        return self.budget is None or self.spent + n <= self.budget

    # ---------------------------------------------------------------- the batch's rows

    def positions(self) -> torch.Tensor:
        """Packed positions of the rows computed at the current layer."""
        return torch.cat([r.cur for r in self.requests])

    def q_lens(self) -> list[int]:
        return [r.cur.numel() for r in self.requests]

    def _sync_batch(self) -> None:
        """Rows changed: lengths, offsets and positions of the forward batch follow."""
        q_lens = self.q_lens()
        self.batch.q_lens = q_lens
        self.batch.max_q_len = max(q_lens)
        self.batch.cu_seqlens_q = torch.tensor([0] + q_lens, device=self.device).cumsum(0).to(torch.int32)
        self.batch.positions = self.positions()

    def _offsets(self) -> list[int]:
        out, o = [], 0
        for r in self.requests:
            out.append(o)
            o += r.cur.numel()
        return out

    def _pad_rows(self, cur: torch.Tensor | None = None) -> None:
        """The batched path's padded view of every request's rows: positions [R, T] (``cur`` when
        given; any valid position past a request's rows), their counts on the device, and where
        each packed row sits in it."""
        lens = self.q_lens()
        if cur is None:
            cur = torch.nn.utils.rnn.pad_sequence([r.cur for r in self.requests], batch_first=True)
        self._cur = cur
        t = self._cur.shape[1]
        flat = np.concatenate([i * t + np.arange(n) for i, n in enumerate(lens)] + [np.zeros(0, np.int64)])
        both = torch.from_numpy(np.concatenate([np.asarray(lens, np.int64), flat])).to(self.device)
        self._lens, self._flat = both[:len(lens)], both[len(lens):]

    # ---------------------------------------------------------------- called by the attention backend

    def before_store(self, layer: int, v: torch.Tensor, block_tables: torch.Tensor, v_pages: torch.Tensor,
                     k: torch.Tensor | None = None, k_pages: torch.Tensor | None = None) -> None:
        """Value deviation of each recomputed row from its cached version (CacheBlend's score),
        for the policies that read it at this layer; the cached version is still in the pages.
        KV correction (``Policy.kv_correction``, needs ``k`` and ``k_pages``): the cached K/V of
        the chunk tokens left out move by their chunk's offset, measured here."""
        for b, (r, o) in enumerate(zip(self.requests, self._offsets())):
            r.info = {}
            corr = r.policy.kv_correction(layer, r.cur)
            if corr is not None:
                if k is None:
                    raise ValueError("kv_correction needs the keys of the layer (not on this attention path)")
                _correct_pages(r, corr, k[o:o + r.cur.numel()], v[o:o + r.cur.numel()], block_tables[b],
                               k_pages, v_pages)
            if not r.policy.needs_deviation(layer):
                continue
            old = _gather(v_pages, block_tables[b], r.cur)
            rows = v[o:o + r.cur.numel()]
            was = r.cached[r.cur]
            r.info["v_deviation"] = torch.where(was, _head_norm(self.tp, rows.float() - old.float()),
                                                torch.zeros((), device=self.device))

    def split(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """Row groups with their own visibility where a policy splits this layer's queries (the
        suffix on its head plan while chunk rows recover locally): [(rows, window, sink)], the
        rows as packed indices; None when every row sees this layer's visibility."""
        splits = [r.policy.query_split(layer) for r in self.requests]
        if all(s is None for s in splits):
            for r in self.requests:
                r.split_at = 0
            return None
        early, late, vis2 = [], [], None
        for r, o, s in zip(self.requests, self._offsets(), splits):
            t = r.cur.numel()
            at = t if s is None else int(torch.searchsorted(r.cur, torch.as_tensor(s[0], device=self.device)))
            r.split_at = at
            early.append(torch.arange(o, o + at, device=self.device))
            late.append(torch.arange(o + at, o + t, device=self.device))
            if s is not None:
                vis2 = (s[1], s[2])
        w2, s2 = (x.to(device=self.device, dtype=torch.int32) for x in vis2)
        return [(torch.cat(early), self.window[layer], self.sink[layer]), (torch.cat(late), w2, s2)]

    def after_attention(self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, k_pages: torch.Tensor,
                        sink_logits: torch.Tensor | None = None) -> None:
        """What the policies observe of this layer's attention: the mass the last queries give
        each key (ranking rows for the sparse FFN) and the mass rows give other chunks
        (``sink_logits``: the layer's learned sink logits, in every softmax, or None)."""
        if self.batched:
            return self._observe_batched(layer, q, block_tables, k_pages, sink_logits)
        for b, (r, o) in enumerate(zip(self.requests, self._offsets())):
            n_obs = r.policy.observe(layer)
            split = r.policy.query_split(layer)
            chunk_id = r.policy.cross_chunks(layer, r.cur)
            r.info["mass"] = None
            if not n_obs and chunk_id is None:
                continue
            t = r.cur.numel()
            keys = _gather(k_pages, block_tables[b], torch.arange(r.n, device=self.device))
            qb = q[o:o + t]
            window, sink = self.window[layer].long(), self.sink[layer].long()
            if n_obs:
                w, s = (window, sink) if split is None else (split[1].to(self.device), split[2].to(self.device))
                n_obs = n_obs if split is None else min(n_obs, t - r.split_at)
                if n_obs:
                    r.info["mass"] = _head_sum(self.tp, observation_mass(qb[-n_obs:], r.cur[-n_obs:], keys, w, s,
                                                                self.scale, sink_logits))
                    r.flops.add_scoring(self.cfg, n_obs, r.n)
            if chunk_id is not None:
                r.info["cross"] = _cross_mass(self.tp, qb, r.cur, keys, window, sink, self.scale, chunk_id.to(self.device),
                                              sink_logits)

    def _observe_batched(self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, k_pages: torch.Tensor,
                         sink_logits: torch.Tensor | None) -> None:
        """The observation mass of every request at once, in groups whose padding to the longest
        prompt at most doubles the keys gathered."""
        n_obs = [r.policy.observe(layer) for r in self.requests]
        for r in self.requests:
            r.info["mass"] = None
        todo = [i for i, k in enumerate(n_obs) if k]
        if not todo:
            return
        lens, offs = self.q_lens(), self._offsets()
        groups, group = [], []
        for i in todo:
            trial = group + [i]
            if group and len(trial) * max(self.requests[j].n for j in trial) > 2 * sum(self.requests[j].n for j in trial):
                groups.append(group)
                trial = [i]
            group = trial
        groups.append(group)
        window, sink = self.window[layer].long(), self.sink[layer].long()
        for group in groups:
            o = max(n_obs[i] for i in group)
            # each request's last n_obs packed rows, padded with its last row at weight 0
            rows = np.array([[offs[i] + lens[i] - n_obs[i] + min(k, n_obs[i] - 1) for k in range(o)] for i in group])
            weight = np.array([[k < n_obs[i] for k in range(o)] for i in group], dtype=np.int64)
            n_keys = np.array([self.requests[i].n for i in group])
            host = np.concatenate([rows.ravel(), weight.ravel(), n_keys, np.asarray(group)]).astype(np.int64)
            dev = torch.from_numpy(host).to(self.device)
            m = len(group)
            rows_t, weight_t = dev[:m * o].view(m, o), dev[m * o:2 * m * o].view(m, o)
            n_t, group_t = dev[2 * m * o:2 * m * o + m], dev[2 * m * o + m:]
            keys = _gather_batched(k_pages, block_tables.index_select(0, group_t), int(n_keys.max()))
            mass = _head_sum(self.tp, observation_mass_batched(q[rows_t], self.batch.positions[rows_t], keys, n_t,
                                                      weight_t.float(), window, sink, self.scale, sink_logits))
            for k, i in enumerate(group):
                self.requests[i].info["mass"] = mass[k, :self.requests[i].n]
                self.requests[i].flops.add_scoring(self.cfg, n_obs[i], self.requests[i].n)

    # ---------------------------------------------------------------- called by the decoder layers

    def ffn_rows(self, layer: int) -> torch.Tensor | None:
        """Packed rows whose FFN runs at this layer (None: all); counts the layer's FLOPs."""
        if self.batched:
            return self._ffn_rows_batched(layer)
        picked, every = [], True
        for r, o in zip(self.requests, self._offsets()):
            t = r.cur.numel()
            rows = r.policy.ffn_rows(layer, r.cur, r.info)
            split = r.policy.query_split(layer)
            # FLOPs: pairs stay on the device until the forward ends (flops()), one sync in all
            if split is None:
                pairs = visible_pairs_per_kv_head(r.cur, self.window[layer], self.sink[layer])
            else:
                at = r.split_at
                pairs = (visible_pairs_per_kv_head(r.cur[:at], self.window[layer], self.sink[layer])
                         + visible_pairs_per_kv_head(r.cur[at:], split[1], split[2]))
            r.layers.append((t, pairs, t if rows is None else rows.numel()))
            every &= rows is None
            picked.append(torch.arange(o, o + t, device=self.device) if rows is None else rows.to(self.device) + o)
        return None if every else torch.cat(picked)

    def _ffn_rows_batched(self, layer: int) -> torch.Tensor | None:
        lens = self.q_lens()
        pairs = visible_pairs_batched(self._cur, self._lens, self.window[layer], self.sink[layer])  # [R]
        policies = [r.policy for r in self.requests]
        self._picked = None
        if policies[0].sparse.threshold(layer) is None or all(p._selected for p in policies):
            for i, r in enumerate(self.requests):
                r.layers.append((lens[i], pairs[i], lens[i]))
            return None
        mass = torch.nn.utils.rnn.pad_sequence([r.policy.row_score(r.info).to(self.device) for r in self.requests],
                                               batch_first=True)
        score = mass.gather(1, self._cur)
        keep = RedKnot.rows_batch(policies, layer, self._lens, score, self._is_chunk.gather(1, self._cur),
                                  self._chunk_start.gather(1, self._cur))
        rows = keep.view(-1)[self._flat].nonzero().flatten()  # the layer's two syncs: its rows
        counts = keep.sum(-1).tolist()  # and their count per request
        for i, r in enumerate(self.requests):
            r.layers.append((lens[i], pairs[i], counts[i]))
        if counts == lens:
            return None
        self._picked = (keep, counts, rows)
        return rows

    def _keep_rows_batched(self) -> torch.Tensor | None:
        picked, self._picked = self._picked, None
        if picked is None or not self.requests[0].policy.keep_cached:
            return None
        keep, counts, rows = picked
        valid = torch.arange(self._cur.shape[1], device=self.device) < self._lens[:, None]
        self.dropped_ok.append((self._cached.gather(1, self._cur) | keep | ~valid).all())
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[:, :max(counts)]  # kept rows first, in order
        cur = self._cur.gather(1, order)
        for i, r in enumerate(self.requests):
            r.cur = cur[i, :counts[i]]
        self._pad_rows(cur)  # past a request's rows: some of its dropped positions, never read
        self._sync_batch()
        return rows

    def keep_rows(self, layer: int) -> torch.Tensor | None:
        """Packed rows computed from the next layer on (None: all); the context follows."""
        if self.batched:
            return self._keep_rows_batched()
        kept, every = [], True
        for r, o in zip(self.requests, self._offsets()):
            t = r.cur.numel()
            keep = r.policy.keep_rows(layer, r.cur, r.info)
            if keep is None:
                kept.append(torch.arange(o, o + t, device=self.device))
                continue
            every = False
            dropped = torch.ones(t, dtype=torch.bool, device=self.device)
            dropped[keep] = False
            self.dropped_ok.append(r.cached[r.cur[dropped]].all())
            r.cur = r.cur[keep]
            kept.append(keep.to(self.device) + o)
        if every:
            return None
        self._sync_batch()
        return torch.cat(kept)

    def last_rows(self) -> torch.Tensor:
        """Packed index of each request's last row after the last layer (its last position)."""
        if self.dropped_ok and not bool(torch.stack(self.dropped_ok).all()):
            raise ValueError("the recovery policy dropped positions that have no cached K/V")
        ends, o = [], 0
        last = torch.stack([r.cur[-1] if r.cur.numel() else r.cur.new_full((), -1) for r in self.requests])
        for r, p in zip(self.requests, last.tolist()):
            o += r.cur.numel()
            if r.cur.numel() == 0 or p != r.n - 1:
                raise ValueError("recovery policy must compute the last position through every layer")
            ends.append(o - 1)
        return torch.tensor(ends, device=self.device)

    def flops(self) -> list[FlopReport]:
        """Each request's FLOPs (one device-to-host copy of every layer's pair count); also sets
        each request's ``row_share``: its rows through the attention projections and the FFN,
        weighted by their weights, as a share of every row through every layer (what admission
        charges the next recoveries of the method)."""
        counts = [p for r in self.requests for _, p, _ in r.layers]
        counts = torch.stack(counts).tolist() if counts else []
        c = self.cfg
        attn = c.attention_flops()[0] // 2
        # multiply-adds per row of each layer's FFN: (skipped by a sparse FFN, run on every row)
        ffn = [tuple(f // 2 for f in c.ffn_flops_per_row(l)) for l in range(c.num_hidden_layers)]
        scored, self.scored = self.scored, None  # counted once
        before = scored.flops() if scored is not None else None
        i = 0
        for k, r in enumerate(self.requests):
            for t, _, n_ffn in r.layers:
                r.flops.add_layer(self.cfg, t, counts[i] * self.group, n_ffn)
                i += 1
            work = sum(t * attn + n_ffn * ffn[l][0] + t * ffn[l][1] for l, (t, _, n_ffn) in enumerate(r.layers))
            full = sum(attn + ffn[l][0] + ffn[l][1] for l in range(len(r.layers)))
            r.row_share = work / max(r.n * full, 1)
            r.layers = []
            r.flops.add_lm_head(self.cfg)
            if scored is not None:  # the scoring pass's work is this request's too
                r.row_share += scored.requests[k].row_share
                r.flops = before[k].merge(r.flops)
        return [r.flops for r in self.requests]


def _correct_pages(r: _Request, corr, k, v, table, k_pages, v_pages) -> None:
    """``reuse.correction`` on one request's pages: its recomputed rows ``k``/``v`` against the
    cached ones still in the pages, the left-out chunk tokens' pages rewritten."""
    chunk_id, probe, correction = corr
    chunk_id = chunk_id.to(r.cur.device)
    rest = r.cached & (chunk_id >= 0)
    rest[r.cur] = False
    rest = rest.nonzero().flatten()
    if rest.numel() == 0 or not bool(probe.any()):
        return
    old_k, old_v = _gather(k_pages, table, r.cur), _gather(v_pages, table, r.cur)
    new_k, new_v = correct_layer(k, v, old_k, old_v, r.cur, probe.to(r.cur.device), rest, chunk_id,
                                 lambda p: (_gather(k_pages, table, p), _gather(v_pages, table, p)), correction)
    _scatter(k_pages, table, rest, new_k)
    _scatter(v_pages, table, rest, new_v)


# Under tensor parallelism a rank holds some KV heads: a score over every head is its sum over the
# ranks (each rank's share all-reduced), so every rank ranks rows alike, as on one device.

def _head_sum(group, x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over this rank's heads, summed over the ranks' heads."""
    return x if group is None else group.all_reduce(x.contiguous())


def _head_norm(group, d: torch.Tensor) -> torch.Tensor:
    """The norm over heads and dims of deviations d [R, H, D], over every rank's heads."""
    if group is None:
        return d.norm(dim=(-1, -2))
    return group.all_reduce(d.pow(2).sum(dim=(-1, -2))).sqrt()


def _cross_mass(group, q, q_pos, keys, window, sink, scale, chunk_id, sink_logits=None) -> torch.Tensor:
    """``cross_chunk_mass`` over every rank's heads: the mean over the heads that see the whole
    context (over all heads where none does), as sum / count over the ranks."""
    if group is None:
        return cross_chunk_mass(q, q_pos, keys, window, sink, scale, chunk_id, sink_logits)
    full = int((window >= keys.shape[0]).sum())
    any_full = int(group.all_reduce(torch.tensor([full], device=q.device))[0]) > 0
    group_size = q.shape[1] // keys.shape[1]
    heads = full if any_full else keys.shape[1]
    mean = (cross_chunk_mass(q, q_pos, keys, window, sink, scale, chunk_id, sink_logits) if heads
            else torch.zeros(q.shape[0], dtype=torch.float32, device=q.device))
    total = group.all_reduce(torch.cat([mean * (heads * group_size), mean.new_tensor([heads * group_size])]))
    return total[:-1] / total[-1]


def _scatter(pages: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x`` [len(pos), Hkv, D] into one layer's pages at positions ``pos`` (``_gather``'s
    inverse); positions a head keeps no page for are skipped."""
    ps = pages.shape[1]
    phys = table[:, pos // ps].long()  # [Hkv, n]
    slot = (pos % ps)[None, :].expand_as(phys)
    ok = phys >= 0
    pages[phys[ok], slot[ok]] = x.transpose(0, 1)[ok].to(pages.dtype)


def _gather_batched(pages: torch.Tensor, tables: torch.Tensor, n: int) -> torch.Tensor:
    """[R, n, Hkv, D]: positions 0..n-1 of R requests' pages of one layer (``tables`` [R, Hkv,
    max_pages]); positions a head keeps no page for (or past a table) read as zeros."""
    ps = pages.shape[1]
    pos = torch.arange(n, device=tables.device)
    phys = tables[:, :, pos // ps].long()  # [R, Hkv, n]
    x = pages[phys.clamp_min(0), (pos % ps)[None, None, :]]  # [R, Hkv, n, D]
    x = torch.where((phys >= 0)[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.transpose(1, 2)


def _gather(pages: torch.Tensor, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[len(pos), Hkv, D] of one layer's pages (``table`` [Hkv, max_pages]) at positions ``pos``;
    positions a head keeps no page for read as zeros."""
    ps = pages.shape[1]
    phys = table[:, pos // ps].long()  # [Hkv, n]
    x = pages[phys.clamp_min(0), (pos % ps)[None, :]]  # [Hkv, n, D]
    x = torch.where((phys >= 0)[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.transpose(0, 1)
