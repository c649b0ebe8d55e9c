"""H2O heavy-hitter decode shapes of `redknot bench kernel --h2o`.

One decode step (q_len 1) of B=8 sequences, Mistral-7B layer shape (Hq=32, Hkv=8, D=128, bf16,
page 64), at 8K/16K/32K of context, every KV head under a 10% heavy-hitter budget: sink 4, a
recent window, and the rest of the budget as whole heavy-hitter pages (page-granular eviction,
as the engine's decode budgets keep them), at random distant pages chosen per (sequence, head).

Methods:
  segpaged_h2o   redknot.kernels.segpaged_attention over the pool as a budgeted head leaves it:
                 only sink, window and heavy pages exist; the heavy tokens are ``sel_pos``.
  segpaged_fused the same call with ``KernelConfig(decode_fused_merge=True)``: the last split of
                 each (sequence, KV head) merges the partials, one launch instead of two
                 (Triton kernel only; skipped when the reference or a ``--kernel`` runs).
  fa_dense       FA-2 dense decode over the whole context (the same API bench kernel uses).
  dense_selected the same kept tokens stored densely (contiguous [B * kept, Hkv, D]) through
                 the same FA-2 call: what the selection costs without paging.

Correctness: segpaged_h2o, segpaged_fused and dense_selected vs a float64 softmax over the kept
tokens. Reported: ms, speedups over fa_dense (and of the fused merge over segpaged_h2o), KV bytes
held vs dense (and the fraction saved).

Run:  redknot bench kernel --h2o [--out kernel_h2o.json]
      redknot bench kernel --h2o --quick --device cpu     (CPU smoke: tiny shapes)
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from ..visibility import dead_pages_end, visible
from . import kernel as kb

BUDGET = 0.10
H2O_WINDOW = 256
H2O_SINK = 4


@dataclass(frozen=True)
class H2OShape:
    name: str
    batch: int
    ctx: int
    budget: float = BUDGET
    window: int = H2O_WINDOW


SHAPES = {s.name: s for s in [H2OShape("h2o-8k", 8, 8192), H2OShape("h2o-16k", 8, 16384),
                               H2OShape("h2o-32k", 8, 32768)]}
QUICK_SHAPES = {s.name: s for s in [H2OShape("h2o-quick", 2, 1500, 0.3, 64)]}
METHODS = ("fa_dense", "dense_selected", "segpaged_h2o", "segpaged_fused")
SEGPAGED_METHODS = ("segpaged_h2o", "segpaged_fused")


def make_h2o_case(shape: H2OShape, device: torch.device, seed: int) -> dict:
    """Dense K/V, the kept positions per (sequence, head) and the pool holding only those pages."""
    B, L, ps = shape.batch, shape.ctx, kb.PAGE_SIZE
    H, D = kb.HKV, kb.HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, kb.HQ, D, generator=gen, device=device, dtype=kb.DTYPE)
    k = torch.randn(B, L, H, D, generator=gen, device=device, dtype=kb.DTYPE)
    v = torch.randn(B, L, H, D, generator=gen, device=device, dtype=kb.DTYPE)
    n_lp = -(-L // ps)
    sink_pages = -(-H2O_SINK // ps)
    dead_end = int(dead_pages_end(L - 1, shape.window, ps))  # pages below hold no window token of the query at L-1
    window_pages = n_lp - dead_end
    heavy = max(0, int(shape.budget * L) // ps - sink_pages - window_pages)
    cpu = torch.Generator().manual_seed(seed + 1)
    candidates = torch.arange(sink_pages, dead_end)
    keep = torch.zeros(B, H, n_lp, dtype=torch.bool)
    keep[:, :, :sink_pages] = True
    keep[:, :, dead_end:] = True
    heavy_pages = torch.stack([torch.stack([candidates[torch.randperm(candidates.numel(), generator=cpu)[:heavy]].sort().values
                                            for _ in range(H)]) for _ in range(B)])  # [B, H, heavy]
    keep.scatter_(2, heavy_pages, True)
    num_pages = int(keep.sum())
    phys = torch.randperm(num_pages, generator=cpu)
    bt = torch.full((B, H, n_lp), -1, dtype=torch.int32)
    bt[keep] = phys.to(torch.int32)
    pad = n_lp * ps - L

    def to_pages(x):
        xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
        xv = xp.view(B, n_lp, ps, H, D).permute(0, 3, 1, 2, 4)
        pages = torch.empty(num_pages, ps, D, device=device, dtype=x.dtype)
        pages[phys.to(device)] = xv[keep.to(device)]
        return pages

    sel = (heavy_pages[..., None] * ps + torch.arange(ps)).flatten(2).to(torch.int32)  # [B, H, heavy * ps]
    # the kept positions per (b, h), in order: sink, heavy, window (each head the same count)
    j = torch.arange(L)
    vis = visible(L - 1, j, shape.window, H2O_SINK)[None, None].expand(B, H, L).clone()
    vis.scatter_(2, sel.long().clamp_max(L - 1), True)
    kept = vis.sum(-1)
    if not (kept == kept[0, 0]).all():
        raise RuntimeError("every head keeps the same number of tokens in this shape")
    n_keep = int(kept[0, 0])
    idx = vis.nonzero()[:, 2].view(B, H, n_keep).to(device)  # [B, H, n_keep]
    ks = k.permute(0, 2, 1, 3).gather(2, idx[..., None].expand(-1, -1, -1, D))  # [B, H, n_keep, D]
    vs = v.permute(0, 2, 1, 3).gather(2, idx[..., None].expand(-1, -1, -1, D))
    return {"shape": shape, "q": q, "k": k, "v": v, "k_pages": to_pages(k), "v_pages": to_pages(v),
            "block_table": bt.to(device), "sel_pos": sel.to(device).contiguous(),
            "sel_lens": torch.full((B, H), sel.shape[2], dtype=torch.int32, device=device),
            "k_sel": ks, "v_sel": vs, "n_keep": n_keep, "num_pages": num_pages, "heavy_pages": heavy,
            "cu_q": torch.arange(B + 1, dtype=torch.int32, device=device),
            "seq_lens": torch.full((B,), L, dtype=torch.int32, device=device),
            "window": torch.full((H,), shape.window, dtype=torch.int32, device=device),
            "sink": torch.full((H,), H2O_SINK, dtype=torch.int32, device=device),
            "scale": 1.0 / math.sqrt(D)}


def _fa_or_sdpa(env, q, k, v, n_k: int, B: int):
    """Non-causal decode attention of q [B, Hq, D] over k/v [B * n_k, Hkv, D] (rows of one
    sequence contiguous): FA-2 through the probed API, else SDPA (flash backend on CUDA)."""
    cfg = env.fa.get("causal")
    cu_k = torch.arange(B + 1, dtype=torch.int32, device=q.device) * n_k
    if cfg:
        kk, vv = kb.fa_kv(cfg, k, v, kb.GROUP)
        return kb.make_fa(cfg, q, kk, vv, torch.arange(B + 1, dtype=torch.int32, device=q.device), cu_k, 1, n_k,
                          1.0 / math.sqrt(q.shape[-1]), causal=False), f"{cfg['api']} (full, q_len 1)"
    q4 = q[:, :, None]
    k4 = k.view(B, n_k, *k.shape[1:]).transpose(1, 2).contiguous()
    v4 = v.view(B, n_k, *v.shape[1:]).transpose(1, 2).contiguous()

    def fn():
        with kb._sdpa_ctx(q.device, q.device.type == "cuda"):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)[:, :, 0]
    return fn, "sdpa (flash backend, enable_gqa)" if q.device.type == "cuda" else "sdpa (default backend)"


def run_h2o_shape(shape: H2OShape, env, seed: int) -> dict:
    c = make_h2o_case(shape, env.device, seed)
    B, L, H, D = shape.batch, shape.ctx, kb.HKV, kb.HEAD_DIM
    row = 2 * D * torch.finfo(kb.DTYPE).bits // 8
    entry = {"name": shape.name, "kind": "h2o-decode", "batch": B, "ctx": L, "budget": shape.budget,
             "window": shape.window, "sink": H2O_SINK, "heavy_pages": c["heavy_pages"], "kept_tokens": c["n_keep"],
             "methods": {}, "correctness": {}, "speedup": {},
             "kv_bytes": {"dense": B * L * H * row, "segpaged_h2o": c["num_pages"] * kb.PAGE_SIZE * row,
                          "dense_selected": B * c["n_keep"] * H * row}}
    kv = entry["kv_bytes"]
    kv["saved_vs_dense"] = 1 - kv["segpaged_h2o"] / kv["dense"]
    env.timer.graph = True
    outs = {}
    for m in METHODS:
        if m not in env.methods:
            entry["methods"][m] = {"skipped": "not selected"}
            continue
        print(f"[kernel-bench] {shape.name}: {m} ...", flush=True)
        try:
            if m == "fa_dense":
                fn, name = _fa_or_sdpa(env, c["q"], c["k"].reshape(B * L, H, D), c["v"].reshape(B * L, H, D), L, B)
            elif m == "dense_selected":
                ks = c["k_sel"].transpose(1, 2).reshape(B * c["n_keep"], H, D).contiguous()
                vs = c["v_sel"].transpose(1, 2).reshape(B * c["n_keep"], H, D).contiguous()
                fn, name = _fa_or_sdpa(env, c["q"], ks, vs, c["n_keep"], B)
            else:
                if env.kernels is None:
                    raise ImportError(env.kernel_error)
                attn = env.kernels[0]
                args = (c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["cu_q"], c["seq_lens"],
                        c["window"], c["sink"], c["scale"], 1)
                kw = {"sel_pos": c["sel_pos"], "sel_lens": c["sel_lens"]}
                name = env.kernels[2] + " (sel_pos)"
                if m == "segpaged_fused":
                    kw["config"] = _fused_merge_config(attn)
                    if kw["config"] is None:
                        entry["methods"][m] = {"skipped": "the fused merge is a launch choice of the Triton kernel"}
                        continue
                    name += ", fused merge"
                fn = lambda: attn(*args, **kw)  # noqa: E731
            outs[m] = fn()
            entry["methods"][m] = {"method": name, **env.timer(fn)}
        except Exception as e:
            entry["methods"][m] = {"error": kb._err(e)}
        kb._free_memory(env.device)
    # float64 softmax over the kept tokens
    g = kb.GROUP
    qd = c["q"].double().view(B, H, g, D)
    s = torch.einsum("bhgd,bhnd->bhgn", qd, c["k_sel"].double()) * c["scale"]
    ref = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), c["v_sel"].double()).reshape(B, kb.HQ, D)
    for m in (*SEGPAGED_METHODS, "dense_selected"):
        if m in outs:
            entry["correctness"][f"{m}_vs_ref"] = kb.compare(outs[m].reshape(B, kb.HQ, D), ref)
    ms = {m: entry["methods"].get(m, {}).get("ms") for m in METHODS}
    for m in (*SEGPAGED_METHODS, "dense_selected"):
        if ms["fa_dense"] and ms[m]:
            entry["speedup"][f"{m}_over_fa_dense"] = ms["fa_dense"] / ms[m]
    for m in SEGPAGED_METHODS:
        if ms[m] and ms["dense_selected"]:
            entry["speedup"][f"{m}_over_dense_selected"] = ms["dense_selected"] / ms[m]
    if ms["segpaged_h2o"] and ms["segpaged_fused"]:
        entry["speedup"]["segpaged_fused_over_segpaged_h2o"] = ms["segpaged_h2o"] / ms["segpaged_fused"]
    return entry


def _fused_merge_config(attn):
    """KernelConfig(decode_fused_merge=True) when attn is the Triton kernel, else None (the torch
    reference and user kernels take no launch choices)."""
    from ..kernels import segpaged

    return segpaged.KernelConfig(decode_fused_merge=True) if attn is segpaged.segpaged_attention else None


TABLE_HEAD = (f"{'shape':<10}{'kept':>7}{'segpaged_h2o':>14}{'fused':>8}{'fa_dense':>10}{'dense_sel':>11}"
              f"{'x FA-2':>9}{'x dense_sel':>12}{'x fused':>9}{'KV saved':>10}{'cos ref':>10}")


def table_row(e: dict) -> str:
    ms = e.get("methods", {})
    sp = e.get("speedup", {})
    cos = e.get("correctness", {}).get("segpaged_h2o_vs_ref", {}).get("cos")
    f = lambda k, w: f"{(f'{sp[k]:.2f}x' if k in sp else '-'):>{w}}"  # noqa: E731
    return (f"{e['name']:<10}{e.get('kept_tokens', 0):>7}{kb._cell(ms.get('segpaged_h2o', {})):>14}"
            f"{kb._cell(ms.get('segpaged_fused', {})):>8}"
            f"{kb._cell(ms.get('fa_dense', {})):>10}{kb._cell(ms.get('dense_selected', {})):>11}"
            + f("segpaged_h2o_over_fa_dense", 9) + f("segpaged_h2o_over_dense_selected", 12)
            + f("segpaged_fused_over_segpaged_h2o", 9)
            + f"{e['kv_bytes']['saved_vs_dense'] * 100:>9.1f}%"
            + f"{(f'{cos:.6f}' if isinstance(cos, float) else '-'):>10}")


def run(args) -> dict:
    """The H2O shapes as one command: prints a table, writes JSON (``--out``)."""
    t0 = time.perf_counter()
    g = lambda name, default: getattr(args, name, default)  # noqa: E731
    device = torch.device(g("device", None) or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = bool(g("quick", False))
    if device.type != "cuda" and not quick:
        raise SystemExit("the H2O shapes (8K-32K) need a CUDA GPU; use --quick on CPU")
    table = QUICK_SHAPES if quick else SHAPES
    names = g("shapes", "all")
    shapes = [table[n] for n in kb._select("all" if names in (None, "all") else names, table, "shape")]
    methods = kb._select(g("methods", "all"), METHODS, "method")
    out_path = g("out", None) or os.path.join(os.environ.get("OUT", "."), "kernel_h2o.json")
    try:
        kernels, kernel_error = kb._resolve_kernels(device, g("kernel", "auto")), None
    except Exception as e:
        kernels, kernel_error = None, kb._err(e)
    try:
        fa = kb.probe_fa(device) if device.type == "cuda" else {"causal": None}
    except Exception as e:
        fa = {"causal": None, "error": kb._err(e)}
    env = kb.Env(device=device, timer=kb.Timer(device, g("repeats", 50), g("target_ms", 1000.0)), fa=fa,
                 kernels=kernels, kernel_error=kernel_error, methods=tuple(methods), deadline=float("inf"))
    result = {"benchmark": "redknot.bench.kernel --h2o", "argv": list(sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", **kb._versions(),
              "config": {"hq": kb.HQ, "hkv": kb.HKV, "head_dim": kb.HEAD_DIM, "page_size": kb.PAGE_SIZE,
                         "dtype": str(kb.DTYPE).replace("torch.", ""), "sink": H2O_SINK,
                         "eviction": "page-granular heavy hitters at random distant pages, per (sequence, head)"},
              "segpaged_impl": kernels[2] if kernels else kernel_error, "fa_probe": fa, "out": out_path, "shapes": []}
    for shape in shapes:
        print(f"[kernel-bench] shape {shape.name} ...", flush=True)
        try:
            result["shapes"].append(run_h2o_shape(shape, env, g("seed", 0)))
        except Exception as e:
            result["shapes"].append({"name": shape.name, "error": kb._err(e), "methods": {}})
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    budgets = ", ".join(sorted({f"{s.budget:.0%}" for s in shapes}))
    lines = ["", f"H2O decode kernel bench on {result['device']} | torch {result['torch']} | median ms | "
             f"heavy-hitter budget {budgets}", TABLE_HEAD, "-" * len(TABLE_HEAD)]
    for e in result["shapes"]:
        lines.append(table_row(e) if "kv_bytes" in e else f"{e['name']:<10} ERROR {e.get('error', '')[:200]}")
    lines.append(f"(x = ms of the baseline / ms of segpaged_h2o; x fused = ms of segpaged_h2o / ms of "
                 f"segpaged_fused; KV saved = pages held vs dense) json: {out_path}")
    print("\n".join(lines), flush=True)
    return result
