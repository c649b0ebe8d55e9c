"""Selected sets in the engine: retrieval heads and per-head decode budgets (H2O).

A head plan ("dense" or "headsparse") gets a *selected* twin ("dense+sel", "headsparse+sel")
when some of its heads keep a selected set: retrieval heads (with ``retrieval_heads``) and heads
of a class that has a ``decode_kv_budget``. A request prefills under its plan, where those heads
are still global; the forward that computes its last pending token also records the queries of
its last rows (the observation window), and right after it (``HeadSelection.end``)

* every selected head's attention mass over its stored keys is computed from those queries,
  batched over the heads of a layer (``redknot.cache.selection``);
* a retrieval head selects the fewest distant tokens covering ``retrieval_top_p`` of the mass,
  and keeps the prompt's window tokens selected as well (SnapKV keeps its observation window),
  so with top-p 1 it sees the whole prompt for good; tokens generated in decode it sees while
  they are in its window;
  a budgeted head keeps its distant pages of largest mass within the budget (page-granular:
  positions are implied by where a token sits, so a partly evicted page frees no bytes and
  compacting it would move tokens to other positions);
* the pool keeps sink, window and selected pages and frees the rest (``PagePool.select``), and
  the request moves to the selected twin plan: its decode batches run with the heads' real
  windows and the selected sets (``sel_pos``), read by slot from a persistent device table, so
  captured decode graphs stay valid.

Decode budgets (H2O): every ``page_size``-th decode step of a budgeted request records the step's
queries (a budgeted plan's captured decode graphs write every layer's queries into a persistent
buffer, so the step still replays its graph; it is only not launched ahead of the host). Their
mass over what each budgeted head sees is added to the head's per-page accumulated mass, and the
head again keeps its heaviest distant pages within budget. The pages that leave the window before
the next check are kept until then (they are candidates), so between checks a head holds at most
one page more than its budget. Accumulation is therefore sampled once per page of decode, not
every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cache import selection as sel_ops
from ..config import DEFAULT_SINK, HEAD_CLASSES, HeadConfig
from .. import visibility

SCORERS = ("snapkv", "h2o")


@dataclass
class SelectionOptions:
    """Which heads keep selected sets, and how they are chosen.

    ``retrieval_heads``: retrieval heads keep sink + window + the tokens covering the head
    config's ``retrieval_top_p`` (otherwise they are served as global heads).
    ``decode_kv_budget``: per head class, the KV a head keeps in decode: tokens (>= 1) or a
    fraction of the sequence's length (< 1); a plain number applies to global and retrieval
    heads. ``decode_kv_window``: the recent window a budgeted head keeps inside its budget.
    ``obs``: observation window (last prompt queries) of the ``snapkv`` scorer; ``h2o`` uses every
    query of the forward that completes the prompt. ``max_selected``: most positions in one
    head's set (the device table's width)."""

    retrieval_heads: bool = False
    decode_kv_budget: dict | None = None
    decode_kv_window: int = 128
    obs: int = 32
    scorer: str = "snapkv"
    max_selected: int = 4096

    def __post_init__(self):
        self.decode_kv_budget = parse_budget(self.decode_kv_budget)
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer={self.scorer!r}: use one of {', '.join(SCORERS)}")
        for name in ("decode_kv_window", "obs", "max_selected"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")

    @property
    def active(self) -> bool:
        return self.retrieval_heads or bool(self.decode_kv_budget)


# Method names that run a base plan with selected sets (benchmarks and evaluations name rows by
# them): name -> (base plan, what is selected). h2o: the decode KV budget on every head of the
# all-global plan; headsparse_h2o: on the plan's global and retrieval heads; retrieval: the
# plan's retrieval heads live (a head config with retrieval entries).
SELECTED_METHODS = {"h2o": ("dense", "budget"), "headsparse_h2o": ("headsparse", "budget"),
                    "retrieval": ("headsparse", "retrieval")}


def selection_for(method: str, decode_kv_budget=0.1, decode_kv_window: int = 128) -> tuple[str, SelectionOptions | None]:
    """The base plan a ``SELECTED_METHODS`` row (or a plain method: no selection) runs, and its
    selection options; ``decode_kv_budget`` is the budget rows' budget (tokens or a fraction)."""
    base, kind = SELECTED_METHODS.get(method, (method, None))
    if kind is None:
        return base, None
    if kind == "retrieval":
        return base, SelectionOptions(retrieval_heads=True, decode_kv_window=decode_kv_window)
    budget = parse_budget(decode_kv_budget)
    if method == "h2o":  # the all-global plan has global heads only
        budget = {"global": next(iter(budget.values()))}
    return base, SelectionOptions(decode_kv_budget=budget, decode_kv_window=decode_kv_window)


def parse_budget(spec) -> dict | None:
    """``0.1`` / ``"512"`` / ``"global=0.1,retrieval=256"`` / a dict -> {class: tokens or fraction}.
    A plain number applies to global and retrieval heads (local heads are bounded by their window)."""
    if spec is None or spec == "" or spec == {}:
        return None
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        spec = {"global": spec, "retrieval": spec}
    elif isinstance(spec, str):
        if "=" not in spec:
            return parse_budget(_number(spec, "decode_kv_budget"))
        out = {}
        for item in spec.split(","):
            cls, _, val = item.partition("=")
            out[cls.strip()] = _number(val, f"decode_kv_budget {cls.strip()}")
        spec = out
    if not isinstance(spec, dict):
        raise ValueError(f"decode_kv_budget={spec!r}: a number, 'class=value,...' or a dict")
    for cls, v in spec.items():
        if cls not in HEAD_CLASSES or cls == "local":
            raise ValueError(f"decode_kv_budget: class {cls!r} must be one of global, retrieval, dense "
                             f"(local heads are bounded by their window)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (v >= 1 and v != int(v)):
            raise ValueError(f"decode_kv_budget {cls}={v!r}: tokens (an integer >= 1) or a fraction in (0, 1)")
    return dict(spec)


def _number(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{what}={text!r} is not a number") from None
    return int(v) if v >= 1 and v == int(v) else v


class _Derived:
    """One selected twin plan: per (layer, KV head) mode, window, sink, budget."""

    def __init__(self, name: str, base: str, mode: np.ndarray, window: np.ndarray, sink: np.ndarray,
                 top_p: float, budget: np.ndarray):
        self.name, self.base = name, base
        self.mode = mode  # int [L, Hkv]: 0 none, 1 retrieval (top-p), 2 budget (H2O)
        self.window, self.sink = window, sink
        self.top_p = top_p
        self.budget = budget  # float [L, Hkv]: tokens (>= 1) or fraction (< 1); 0 where none
        self.layers = [l for l in range(mode.shape[0]) if (mode[l] > 0).any()]
        self.budgeted = bool((mode == 2).any())  # some head runs budget checks in decode


class HeadSelection:
    """The engine's selected-set policy (one per engine; see the module docstring)."""

    def __init__(self, config, head_config, options: SelectionOptions, base_plans: dict, device: torch.device,
                 sink_logits: torch.Tensor | None = None):
        """``base_plans``: name -> (window, sink) [L, Hkv] of the plans the pool serves (the model
        adapter's visible state); each gets a selected twin where the options select any head.
        ``sink_logits`` [L, Hq]: the model's learned attention sinks (gpt-oss), in the masses' softmax."""
        self.config, self.options, self.device = config, options, torch.device(device)
        self.sink_logits = None if sink_logits is None else sink_logits.detach().float().to(self.device)
        self.derived: dict[str, _Derived] = {}  # base plan -> its twin
        self.pool = self.runner = None  # attached by the engine (again after a pool resize)
        cfg = config
        L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
        bases = {"dense": HeadConfig.all_global(L, H)}
        if head_config is not None:
            bases["headsparse"] = head_config
        for base, hc in bases.items():
            if base not in base_plans:
                continue
            w0, s0 = (np.asarray(x) for x in base_plans[base])
            classes = np.array(hc.effective_classes())
            mode = np.zeros((L, H), np.int64)
            budget = np.zeros((L, H))
            for cls, b in (options.decode_kv_budget or {}).items():
                budget[classes == cls] = b
            mode[budget > 0] = 2
            if options.retrieval_heads:
                mode[(classes == "retrieval") & (mode == 0)] = 1
            if not mode.any():
                continue
            wr, sr = hc.visibility(model_windows=cfg.sliding_windows, selection=True)
            window = np.where(mode == 1, wr, w0)
            sink = np.where(mode == 1, sr, s0)
            own_sink = np.array(hc.sinks)
            window = np.where(mode == 2, np.minimum(options.decode_kv_window, w0), window)
            sink = np.where(mode == 2, np.where(own_sink > 0, own_sink, DEFAULT_SINK), sink)
            name = f"{base}+sel"
            self.derived[base] = _Derived(name, base, mode, window.astype(np.int64), sink.astype(np.int64),
                                          float(hc.retrieval_top_p), budget)
        self._by_name = {d.name: d for d in self.derived.values()}
        self._pending: list = []
        self.checks = 0  # budget checks run (one per sequence and check position)
        # Keys one batch of a step's checks gathers at most (bytes). On a GPU a batch saves the
        # per-request launches; on a CPU the stacked intermediates fall out of cache (measured:
        # 8 checks at 8K took 2x as long stacked), so there a batch is about one request.
        self.check_chunk_bytes = (1 << 30) if self.device.type == "cuda" else (16 << 20)

    @classmethod
    def for_engine(cls, engine, options: SelectionOptions) -> "HeadSelection":
        """A selection over an engine's model, head config and plans (it keeps no reference to it)."""
        stored, cfg = engine.adapter.state_layout().num_kv_heads, engine.config
        if stored != cfg.num_key_value_heads:  # MLA: one latent head per layer for every query head
            raise ValueError(f"selected sets (retrieval heads, decode KV budgets) are kept per KV head; "
                             f"{cfg.model_type} stores {stored} per layer for its {cfg.num_key_value_heads} heads")
        sinks = [engine.adapter.layer_sink_logits(l) for l in range(engine.config.num_hidden_layers)]
        return cls(engine.config, engine.head_config, options, engine.adapter.visible_state(engine.head_config),
                   engine.device, None if sinks[0] is None else torch.stack(sinks))

    @property
    def enabled(self) -> bool:
        return bool(self.derived)

    def attach(self, pool, runner) -> None:
        """Work on this pool and model runner (again after a pool resize): the selected twins become
        plans of both, the pool gets its selection table."""
        self.pool, self.runner = pool, runner
        if not self.derived:
            return
        for d in self.derived.values():
            pool.add_plan(d.name, d.window, d.sink)
            runner.plans[d.name] = (torch.as_tensor(d.window, dtype=torch.int32).to(pool.device),
                                    torch.as_tensor(d.sink, dtype=torch.int32).to(pool.device))
        pool.attach_selection(self.options.max_selected)  # a new table: graphs reading the old one go
        runner.drop_graphs(set(self._by_name))
        runner.selective_plans = set(self._by_name)
        runner.recording_plans = {d.name for d in self.derived.values() if d.budgeted}

    def base_plan(self, plan: str) -> str:
        """The plan a request prefills under again (after a preemption)."""
        d = self._by_name.get(plan)
        return d.base if d is not None else plan

    def prompt_rows(self, plan: str) -> int:
        """Prompt rows at the end that the forward completing a prompt under ``plan`` must
        compute itself: the observation window its selection reads queries from (0 for a plan
        without selected heads). The engine keeps that many rows out of prefix-cache hits and
        out of earlier prefill chunks, so a selection does not depend on what was cached or on
        where a chunk boundary fell."""
        return self.options.obs if plan in self.derived else 0

    # ------------------------------------------------------------------ around a forward

    def needed_by_decode(self, plan: str, seqs: list) -> bool:
        """Whether a decode forward of ``seqs`` under ``plan`` at their next positions
        (``num_computed``) must run through ``begin``/``end``: a plan with a selected twin (its
        requests select when their prompt completes) or a budget check at one of them. Other
        decode steps may be launched ahead of the host (async decode)."""
        if plan in self.derived:
            return True
        d = self._by_name.get(plan)
        return d is not None and d.budgeted and any(self._checks_at(s.num_computed) for s in seqs)

    def _checks_at(self, position: int) -> bool:
        """A budgeted head's mass is sampled by the decode query at this position."""
        return (position + 1) % self.pool.page_size == 0

    def begin(self, plan: str, items: list) -> torch.Tensor | None:
        """Before a forward: note which requests complete their prompt (or hit a budget check) in
        it. Returns the packed rows whose queries the forward must record (None: none)."""
        self._pending = []
        if plan in self.derived:
            d, kind = self.derived[plan], "select"
        elif plan in self._by_name and self._by_name[plan].budgeted:
            d, kind = self._by_name[plan], "check"
        else:
            return None
        rows, off = [], 0
        for s, n in items:
            m = 0
            if kind == "select" and s.num_computed + n == len(s.token_ids):
                m = n if self.options.scorer == "h2o" else min(self.options.obs, n)
            elif kind == "check" and n == 1 and self._checks_at(s.num_computed):
                m = 1
            if m:
                self._pending.append((s, kind, d, len(rows), m, s.num_computed + n))
                rows.extend(range(off + n - m, off + n))
            off += n
        return torch.tensor(rows, device=self.device) if rows else None

    def end(self, captured: list | None) -> None:
        """After the forward (pages trimmed, prefixes cached): compute the sets from the queries it
        recorded (``captured[layer]``, the rows ``begin`` asked for) and free pages."""
        pending, self._pending = self._pending, []
        checks: dict[tuple[str, int], list] = {}
        for s, kind, d, r0, m, n in pending:
            if s.finished or s.seq_id not in self.pool or not captured or any(q is None for q in captured):
                continue
            rows = [q[r0:r0 + m] for q in captured]
            if kind == "check":  # the step's checks at one length run together
                checks.setdefault((d.name, n), []).append((s, rows))
            else:
                self._update(s, d, rows, n)
        for (name, n), items in checks.items():
            self._check(self._by_name[name], items, n)

    def select_from(self, s, q_rows: list, n: int) -> None:
        """Select a running request's sets now from given queries (per layer [m, Hq, D], the rows
        at positions n-m..n-1), as if its prompt of n tokens had just completed (benchmarks)."""
        d = self.derived.get(s.plan)
        if d is None:
            raise ValueError(f"plan {s.plan!r} has no selected heads")
        self._update(s, d, q_rows, n)

    # ------------------------------------------------------------------ the sets

    @torch.inference_mode()
    def _check(self, d: _Derived, items: list, n: int) -> None:
        """Budget checks of decoding requests at one length n, every layer's budgeted heads of
        every request at once (in chunks of ``check_chunk_bytes`` of keys): each request's query
        (``q_rows[l]`` [1, Hq, D], at position n-1; ``items`` = [(seq, q_rows)]) adds its mass
        over what each head sees, gathered from the head's stored pages only (~ its budget), to
        the head's page mass, and the head keeps its heaviest distant pages within budget.
        Retrieval heads keep their sets. Equal to the per-layer reference check per request (tests/oracles/budget_check.py), the
        per-layer form over every position of the context."""
        pool = self.pool
        ls, hs = np.nonzero(d.mode == 2)
        page_bytes = pool.page_size * pool.k_pages.shape[-1] * pool.k_pages.element_size()
        chunk, held = [], 0
        for s, rows in items:  # a request's keys: its budgeted heads x the most pages one holds
            table = pool.table(s.seq_id)  # [L, H, P]
            need = len(ls) * max(1, int((table[ls, hs] >= 0).sum(1).max(initial=0))) * page_bytes
            if chunk and held + need > self.check_chunk_bytes:
                self._check_chunk(d, chunk, n, ls, hs)
                chunk, held = [], 0
            chunk.append((s, rows, table))
            held += need
        if chunk:
            self._check_chunk(d, chunk, n, ls, hs)

    def _check_chunk(self, d: _Derived, items: list, n: int, ls: np.ndarray, hs: np.ndarray) -> None:
        """``_check`` for one chunk of [(seq, q_rows, its block table)]. A budgeted head's set is
        every position of its kept pages, so the host handles pages only: the positions are made
        on the device and written to the pool's device table from there (``PagePool.select_pages``)."""
        pool = self.pool
        ps, dev = pool.page_size, self.device
        cfg = self.config
        L, H = d.mode.shape
        g = cfg.num_attention_heads // H
        R, C = len(ls), len(items)
        self.checks += C
        tables = [t for _, _, t in items]  # [L, H, P_i]
        P = max(t.shape[2] for t in tables)
        tbl = np.full((C * R, P), -1, np.int64)  # the budgeted heads of every request, stacked
        kept = np.zeros((C * R, P), np.int64)  # the pages each head keeps now (its set)
        for i, ((s, _, t), k) in enumerate(zip(items, (pool.kept_pages(s.seq_id) for s, _, _ in items))):
            tbl[i * R:(i + 1) * R, :t.shape[2]] = t[ls, hs]
            if k is not None:
                w = min(P, k.shape[2])
                kept[i * R:(i + 1) * R, :w] = k[ls, hs, :w]
        stored = tbl >= 0
        k_max = max(1, int(stored.sum(1).max()))
        lp = np.argsort(~stored, axis=1, kind="stable")[:, :k_max]  # each head's stored pages first
        valid = np.take_along_axis(stored, lp, 1)
        phys = np.where(valid, np.take_along_axis(tbl, lp, 1), 0)
        chosen = np.take_along_axis(kept, lp, 1)
        host = torch.from_numpy(np.concatenate([lp, phys, chosen], 1)).to(dev)  # one copy to the device
        lp_t, phys_t, chosen_t = host[:, :k_max], host[:, k_max:2 * k_max], host[:, 2 * k_max:] > 0
        keys = pool.k_pages[phys_t].flatten(1, 2)  # [C*R, k_max * ps, D]
        pos = (lp_t[:, :, None] * ps + torch.arange(ps, device=dev)).flatten(1)
        window = torch.as_tensor(np.tile(d.window[ls, hs], C), device=dev)[:, None]
        sink = torch.as_tensor(np.tile(d.sink[ls, hs], C), device=dev)[:, None]
        p = n - 1  # the checks' query
        vis = (torch.from_numpy(valid).to(dev).repeat_interleave(ps, 1) & (pos <= p)
               & (visibility.visible(p, pos, window, sink) | chosen_t.repeat_interleave(ps, 1)))
        ls_t, hs_t = torch.from_numpy(ls).to(dev), torch.from_numpy(hs).to(dev)
        q = torch.cat([torch.stack([rows[l][0] for l in range(L)]).view(L, H, g, -1)[ls_t, hs_t]
                       for _, rows, _ in items])  # [C*R, g, D]
        # positions are in ``vis``; keys are compact, so the causal bound inside is always met
        sinks = None if self.sink_logits is None else self.sink_logits.view(L, H, g)[ls_t, hs_t].repeat(C, 1)
        mass = sel_ops.attention_mass(q, keys, torch.full((g,), keys.shape[1], device=dev), cfg.attention_scale,
                                      vis[:, None, :].expand(-1, g, -1), sinks)
        # each request's page mass so far (set when it selected at the end of its prompt)
        accs = [_grown(s.page_mass, P) for s, _, _ in items]
        rows = torch.cat([acc[ls_t, hs_t, :P] for acc in accs])
        rows.scatter_add_(1, lp_t, mass.view(C * R, k_max, ps).sum(-1))  # padding rows added 0 (not visible)
        keep = self._budget_pages(rows, torch.from_numpy(tbl).to(dev), np.tile(d.window[ls, hs], C),
                                  np.tile(d.sink[ls, hs], C), np.tile(d.budget[ls, hs], C), n)
        keep_h = keep.cpu().numpy()
        width = int(keep_h.sum(1).max(initial=0)) * ps
        if width > self.options.max_selected:
            raise ValueError(f"a decode budget of {width} selected tokens exceeds max_selected="
                             f"{self.options.max_selected}")
        pos_sel, lens = sel_ops.pages_to_positions(keep, ps, width=max(width, 1))
        for i, ((s, _, _), acc) in enumerate(zip(items, accs)):
            acc[ls_t, hs_t, :P] = rows[i * R:(i + 1) * R]
            s.page_mass = acc
            s.plan = d.name
        pool.select_pages([s.seq_id for s, _, _ in items], ls, hs, keep_h.reshape(C, R, P), pos_sel, lens,
                          plan=d.name)

    @torch.inference_mode()
    def _update(self, s, d: _Derived, q_rows: list, n: int) -> None:
        """The sets at the end of a prompt of n tokens from its last queries ``q_rows`` (per layer
        [m, Hq, D], positions n-m..n-1), layer by layer over every position of the context."""
        table = self.pool.table(s.seq_id)  # [L, H, P]
        P = table.shape[2]
        sets: dict[tuple[int, int], np.ndarray] = {}
        acc = torch.zeros(*d.mode.shape, P, dtype=torch.float32, device=self.device)
        for l in d.layers:
            heads, hs, tbl, mass = self.layer_mass(d, l, table, q_rows[l], n)
            acc[l, hs, :P] += sel_ops.page_mass(mass, self.pool.page_size)[:, :P]
            retr = d.mode[l, heads] == 1
            if retr.any():
                self._retrieval_sets(d, l, heads[retr], mass[torch.from_numpy(np.nonzero(retr)[0]).to(self.device)],
                                     n, sets)
            self.budget_sets(d, l, heads, hs, tbl, acc, n, sets)
        self._write_sets(s, d, sets, acc)

    def layer_mass(self, d: _Derived, layer: int, table: np.ndarray, q: torch.Tensor, n: int, visible=None):
        """(heads, heads on the device, their tables [R, P], the attention mass [R, N] the queries ``q``
        [m, Hq, D] at positions n-m..n-1 give every stored key) of a layer's selected heads;
        ``visible(q_pos)`` -> bool [R, g * m, N] narrows what each query sees."""
        pool, cfg = self.pool, self.config
        H = d.mode.shape[1]
        g = cfg.num_attention_heads // H
        heads = np.nonzero(d.mode[layer])[0]
        m = q.shape[0]
        tbl = torch.from_numpy(table[layer, heads].astype(np.int64)).to(self.device)  # [R, P]
        keys = pool.k_pages[tbl.clamp_min(0)].flatten(1, 2)[:, :n]  # [R, N, D]
        stored = (tbl >= 0).repeat_interleave(pool.page_size, 1)[:, :n]
        hs = torch.from_numpy(heads).to(self.device)
        qq = q.view(m, H, g, -1)[:, hs].permute(1, 2, 0, 3).reshape(len(heads), g * m, -1)
        q_pos = torch.arange(n - m, n, device=self.device).repeat(g)
        vis = stored[:, None, :].expand(-1, g * m, -1)
        if visible is not None:
            vis = vis & visible(q_pos)
        sinks = None  # each row's sink logit: rows are (head, query head of its group, query)
        if self.sink_logits is not None:
            sinks = self.sink_logits[layer].view(H, g)[hs].repeat_interleave(m, dim=1)
        return heads, hs, tbl, sel_ops.attention_mass(qq, keys, q_pos, cfg.attention_scale, vis, sinks)

    def budget_sets(self, d: _Derived, layer: int, heads, hs, tbl, acc: torch.Tensor, n: int, sets: dict) -> None:
        """Budgeted heads' sets: the pages their accumulated mass ranks highest, within the budget."""
        bud = d.mode[layer, heads] == 2
        if not bud.any():
            return
        P = tbl.shape[1]
        idx = np.nonzero(bud)[0]
        keep = self._budget_pages(acc[layer, hs[idx], :P], tbl[idx], d.window[layer, heads[idx]],
                                  d.sink[layer, heads[idx]], d.budget[layer, heads[idx]], n)
        pos, lens = sel_ops.pages_to_positions(keep, self.pool.page_size)
        pos, lens = pos.cpu().numpy(), lens.cpu().numpy()
        for i, r in enumerate(idx):
            sets[(layer, int(heads[r]))] = pos[i, :lens[i]]

    def _retrieval_sets(self, d: _Derived, layer: int, heads: np.ndarray, mass: torch.Tensor, n: int,
                        sets: dict) -> None:
        """Retrieval heads' sets at the end of a prompt: the tokens covering ``top_p`` of their mass
        ([R, N]), with the prompt's window tokens (SnapKV keeps its observation window: what the
        head sees when the prompt ends does not vanish as the window slides on)."""
        pos, lens = sel_ops.select_top_p(mass, n, d.window[layer, heads], d.sink[layer, heads], d.top_p,
                                         self.options.max_selected)
        pos, lens = pos.cpu().numpy(), lens.cpu().numpy()
        for i, h in enumerate(int(x) for x in heads):
            recent = np.arange(max(int(d.sink[layer, h]), n - int(d.window[layer, h]) + 1), n)
            sets[(layer, h)] = np.union1d(pos[i, :lens[i]], recent)[-self.options.max_selected:]

    def _write_sets(self, s, d: _Derived, sets: dict, acc: torch.Tensor) -> None:
        """The request's selected sets ((layer, head) -> positions) into the pool, under the twin plan."""
        L, H = d.mode.shape
        width = max([len(v) for v in sets.values()] + [1])
        if width > self.options.max_selected:
            raise ValueError(f"a decode budget of {width} selected tokens exceeds max_selected="
                             f"{self.options.max_selected}")
        arr = np.full((L, H, width), -1, np.int64)
        for (l, h), v in sets.items():
            arr[l, h, :len(v)] = v
        self.pool.select(s.seq_id, arr, plan=d.name)
        s.plan = d.name
        s.page_mass = acc if d.budgeted else None

    def _budget_pages(self, acc: torch.Tensor, tbl: torch.Tensor, window: np.ndarray, sink: np.ndarray,
                      budget: np.ndarray, n: int) -> torch.Tensor:
        """bool [R, P] distant pages R budgeted heads (their window, sink, budget [R]) keep: their
        heaviest within the budget, plus the pages that leave the window before the next check
        (still candidates then)."""
        ps = self.pool.page_size
        dev = acc.device
        R, P = acc.shape
        window = torch.as_tensor(window, device=dev)
        sink = torch.as_tensor(sink, device=dev)
        budget = torch.as_tensor(budget, device=dev, dtype=torch.float64)
        tokens = torch.where(budget < 1, budget * n, budget).floor().long()
        stored = tbl >= 0
        kept_now = visibility.kept_page_mask(n, window, sink, ps, pages=P)
        nxt = (n // ps + 1) * ps  # the next check's length
        far = ~kept_now & stored
        leaving = kept_now & ~visibility.kept_page_mask(nxt, window, sink, ps, pages=P) & stored
        # the budget's pages beyond what the head keeps anyway (its sink and window pages)
        held = torch.maximum(visibility.kept_pages(n, window, sink, ps), -(-sink // ps))
        heavy = tokens // ps - held
        return sel_ops.select_pages(acc, far, heavy.clamp_min(0)) | leaving


def _grown(acc: torch.Tensor, pages: int) -> torch.Tensor:
    """A page mass [L, Hkv, cap] with room for ``pages`` pages (geometric growth: a check each
    page of decode does not copy the whole mass each time)."""
    if acc.shape[2] >= pages:
        return acc
    return torch.cat([acc, acc.new_zeros(*acc.shape[:2], max(pages, 2 * acc.shape[2]) - acc.shape[2])], 2)
