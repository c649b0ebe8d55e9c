"""Prefill/decode disaggregation inside the engine: exporting a prefilled request's pages under a
lease, and adopting another instance's pages for a request at admission.

Export (prefill instance): a request marked ``kv_export`` (its lease id) that finishes keeps its
pages: the lease takes one reference on every page its table holds (after trim: exactly what its
head plan still sees: global heads every page, local heads sink + window, retrieval heads sink +
window + their selected pages) and the request is freed as usual. A transport sends the pages and
marks the lease done, or it expires; ``collect_leases`` (engine thread) then drops the references.

Import (decode instance): a request carrying ``kv_import`` (a received handoff) is admitted like
any other (the scheduler counts the pages it brings), then ``adopt`` gives its pool sequence fresh
pages for exactly the pages the handoff holds, copies the bytes in, restores retrieval heads'
selected sets, and samples the first token from the prefill's logits: from here on the request is
in the state a colocated engine would be in after its prefill, and decodes.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..config import GLOBAL_WINDOW
from ..pd.lease import Lease
from ..pd.transfer import Expect
from ..pd.wire import HandoffHeader, dtype_name, held_to_ranges, plan_digest, positions_to_ranges, tokens_digest
from ..reuse.registry import get_method
from .output import StepOutput
from .sequence import Sequence


def head_classes(engine, plan: str) -> np.ndarray:
    """str [L * Hkv]: each head's class under ``plan``: global (window reaches everything),
    retrieval (a head config retrieval head with a selected set), else local."""
    window, _ = engine.pool.window_sink(plan)
    out = np.where(window >= GLOBAL_WINDOW, "global", "local").astype(object)
    if engine.head_config is not None and plan.endswith("+sel"):
        classes = np.array(engine.head_config.effective_classes(), dtype=object)
        out[(classes == "retrieval") & (out == "local")] = "retrieval"
    return out.reshape(-1)


def export(engine, seq: Sequence) -> None:
    """Put a finished exported request's pages under its lease (before ``Scheduler.free``)."""
    pool = engine.pool
    if seq.seq_id not in pool or seq.first_logits is None or seq.finish_reason not in ("stop", "length"):
        return
    n = pool.length(seq.seq_id)
    plan = pool.plan_of(seq.seq_id)
    table = pool.table(seq.seq_id)
    held = table >= 0
    pages = table[held]
    pool.retain(pages)
    counts, bounds = held_to_ranges(held, pool.page_size, n)
    sel = pool.selection(seq.seq_id)
    sel_counts, sel_bounds = positions_to_ranges(sel) if sel is not None else (None, None)
    mass = None
    if seq.page_mass is not None:
        mass = seq.page_mass[:, :, :held.shape[2]].float().cpu().numpy().astype("<f4").tobytes()
    header = HandoffHeader(
        lease=seq.kv_export, fingerprint=engine.fingerprint, plan=plan, plan_hash=plan_digest(*pool.window_sink(plan)),
        dtype=dtype_name(pool.dtype), page_size=pool.page_size, head_dim=pool.head_dim, num_layers=pool.num_layers,
        num_kv_heads=pool.num_kv_heads, num_tokens=n, tokens_hash=tokens_digest(seq.token_ids[:n]), counts=counts,
        bounds=bounds, logits=seq.first_logits.float().numpy().astype("<f4").tobytes(), logits_dtype="float32",
        sel_counts=sel_counts, sel_bounds=sel_bounds, page_mass=mass, exact_kv=seq.exact_kv,
        cached_tokens=seq.cached_tokens)
    li, hi, _ = np.nonzero(held)
    engine.leases.add(Lease(seq.kv_export, pages, header, pool.k_pages, pool.v_pages, head_classes(engine, plan),
                            li * pool.num_kv_heads + hi, time.monotonic() + engine.leases.ttl_s))


def collect_leases(engine) -> int:
    """Drop the pool references of leases pulled or expired; returns the pages given back."""
    done = engine.leases.collect()
    for lease in done:
        engine.pool.release(lease.pages)
    return sum(int(x.pages.size) for x in done)


def adopt(engine, seq: Sequence, outputs: list[StepOutput]) -> None:
    """Fill an admitted imported request's pages from its handoff and sample its first token."""
    got, seq.kv_import = seq.kv_import, None
    h = got.header
    pool = engine.pool
    try:
        pages = pool.adopt(seq.seq_id, got.held, h.num_tokens)
        idx = torch.from_numpy(pages.astype(np.int64)).to(pool.device)
        k, v = got.kv()
        with torch.inference_mode():
            pool.k_pages.index_copy_(0, idx, k.to(pool.device, non_blocking=True))
            pool.v_pages.index_copy_(0, idx, v.to(pool.device, non_blocking=True))
        sel = h.selection()
        if sel is not None:
            pool.select(seq.seq_id, sel)
        if h.page_mass is not None:
            mass = np.frombuffer(h.page_mass, dtype="<f4").reshape(h.num_layers, h.num_kv_heads, -1)
            seq.page_mass = torch.from_numpy(mass.copy()).to(engine.device)
    except Exception as e:  # noqa: BLE001  (the request fails alone)
        engine._fail(seq, e, outputs)
        return
    seq.num_computed = seq.prefill_start = h.num_tokens
    seq.cached_tokens, seq.exact_kv = h.cached_tokens, h.exact_kv
    engine._sample([seq], h.first_logits().to(engine.device)[None], outputs)


def expectation(engine, seq: Sequence) -> Expect:
    """What a handoff for ``seq`` must match here: this model, this pool's plans and layout, the
    plan of the request's method (or its selected twin), and its prompt."""
    pool = engine.pool
    base = get_method(engine.check_method(seq.method)).plan
    plans = {name: (plan_digest(*pool.window_sink(name)), *pool.window_sink(name)) for name in pool.plans}
    return Expect(engine.fingerprint, plans, (base, f"{base}+sel"), dtype_name(pool.dtype), pool.page_size,
                  pool.head_dim, pool.num_layers, pool.num_kv_heads, list(seq.token_ids))

