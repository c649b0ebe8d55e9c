"""Attention-kernel benchmark: SegPagedAttention vs FA-2, FlexAttention and SDPA.

One attention layer, bf16, Hq=32, Hkv=8, D=128, page size 64, 2 of 8 KV heads global
(W = GLOBAL_WINDOW), the other 6 local with sink 4 and window W (docs/segpaged.md;
docs/results/kernel.md has the numbers).

Shapes: prefill of one sequence (q_len = context) at 8K/W=512, 32K/W=4096, 128K/W=4096, and
decode (q_len 1) of B=8 sequences at 32K and 128K, W=4096.

Methods (each in its own function, each failure recorded in the JSON, never fatal):
  segpaged    redknot.kernels.segpaged_attention over shuffled physical pages; for decode the
              local heads hold only their sink + window pages (on CPU: the torch reference).
  fa_dense    FA-2 dense causal through torch.nn.attention.varlen.varlen_attn (fallbacks: the
              aten flash op, then SDPA with the flash backend); decode: the same, non-causal
              (q_len 1 sees every key). A startup probe checks the API against the rule.
  fa_buckets  FA-2 per head class: global heads causal + local heads sliding window (no sink);
              two calls, times summed.
  flex        torch.compile(flex_attention) with a per-head mask_mod implementing the exact rule;
              block mask built once outside the timing; compile time reported separately.
  sdpa_mask   SDPA with a materialised bool mask [1, Hq, Lq, Lk] (skipped when it does not fit).
  segpaged_tma
              prefill only, CUDA only: segpaged with interior key tiles read through tensor
              descriptors (TMA on Hopper), 64-key tiles (one page).
  fa3         FlashAttention-3 dense causal (flash_attn_interface) where a build exists on the
              machine; otherwise recorded as skipped, saying none does.

Times are medians of CUDA events with L2 flushed before each call. Correctness: segpaged (and
flex, sdpa_mask) vs a float64 evaluation of the rule on --rows sampled query rows.

Run:  redknot bench kernel [--shapes prefill-8k,decode-32k] [--out kernel.json]
      redknot bench kernel --quick --device cpu      (CPU smoke: tiny shapes)
      python -m redknot.bench.kernel --h2o                     (H2O decode shapes: kernel_h2o.py)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..visibility import GLOBAL_WINDOW, keys_seen, kept_page_mask, kept_pages, visible

HQ, HKV, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 64
GROUP = HQ // HKV
GLOBAL_KV_HEADS = (0, 4)  # 2 of 8 KV heads global
SINK = 4                  # local heads' sink
DTYPE = torch.bfloat16
METHODS = ("fa_dense", "fa3", "fa_buckets", "sdpa_mask", "flex", "segpaged", "segpaged_tma")  # run order
BASELINES = ("fa_dense", "fa3", "fa_buckets", "flex", "sdpa_mask")
# (BLOCK_M, BLOCK_N, warps, stages): 64-key tiles stay inside a page; the fastest of 6 descriptor
# configurations on an H100 (docs/results/kernel_tma.md)
TMA_PREFILL = (64, 64, 4, 3)


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "prefill" | "decode"
    batch: int
    ctx: int   # context length = seq_lens after this step
    window: int

    @property
    def q_len(self) -> int:
        return self.ctx if self.kind == "prefill" else 1


SHAPES = {s.name: s for s in [
    Shape("prefill-8k", "prefill", 1, 8192, 512),
    Shape("prefill-32k", "prefill", 1, 32768, 4096),
    Shape("prefill-128k", "prefill", 1, 131072, 4096),
    Shape("decode-32k", "decode", 8, 32768, 4096),
    Shape("decode-128k", "decode", 8, 131072, 4096),
]}
# Tiny shapes: odd lengths so the last page is partial.
QUICK_SHAPES = {s.name: s for s in [
    Shape("prefill-quick", "prefill", 1, 200, 48),
    Shape("decode-quick", "decode", 2, 300, 64),
]}


# --------------------------------------------------------------------------- small helpers

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    return msg if len(msg) <= 600 else msg[:600] + " ..."


def _num(x):
    """JSON-safe float (NaN/inf become strings)."""
    x = float(x)
    return x if math.isfinite(x) else str(x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cuda_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def _resolve_kernels(device: torch.device, kernel: str):
    """(attention fn, store fn or None, name): the Triton kernels on CUDA, the torch reference on
    CPU, or the attention function a user names as ``MODULE:FUNCTION`` (``--kernel``; its module's
    ``segpaged_store`` if it has one)."""
    if kernel and kernel != "auto":
        mod_name, _, attr = kernel.partition(":")
        mod = importlib.import_module(mod_name)
        attr = attr or "segpaged_attention"
        return getattr(mod, attr), getattr(mod, "segpaged_store", None), f"{mod_name}:{attr}"
    if device.type == "cuda":
        from ..kernels import segpaged
        return segpaged.segpaged_attention, segpaged.segpaged_store, "redknot.kernels.segpaged:segpaged_attention"
    from ..kernels import reference
    return (reference.segpaged_attention_ref, reference.segpaged_store_ref,
            "redknot.kernels.reference:segpaged_attention_ref")


# --------------------------------------------------------------------------- inputs

@dataclass
class Case:
    shape: Shape
    q: torch.Tensor            # [T, Hq, D] packed queries (T = B * q_len)
    k: torch.Tensor            # [B, L, Hkv, D] dense keys
    v: torch.Tensor
    pos: torch.Tensor          # int64 [T] absolute position of each query (CPU)
    seq: torch.Tensor          # int64 [T] sequence of each query (CPU)
    cu_q: torch.Tensor         # int32 [B+1]
    seq_lens: torch.Tensor     # int32 [B]
    windows: list[int]         # per KV head
    sinks: list[int]
    window: torch.Tensor       # int32 [Hkv] on device
    sink: torch.Tensor
    k_pages: torch.Tensor      # [num_pages, page_size, D]
    v_pages: torch.Tensor
    block_table: torch.Tensor  # int32 [B, Hkv, max_pages], -1 = not stored
    num_pages: int
    scale: float = field(default=1.0 / math.sqrt(HEAD_DIM))


def _head_plan(shape: Shape, global_window: int):
    windows = [global_window if h in GLOBAL_KV_HEADS else shape.window for h in range(HKV)]
    sinks = [0 if h in GLOBAL_KV_HEADS else SINK for h in range(HKV)]
    return windows, sinks


def _kept_pages(shape: Shape, windows, sinks) -> torch.Tensor:
    """bool [Hkv, n_logical_pages]: pages each head holds.

    Prefill: every page (the queries of this step need them all). Decode: what the pool keeps
    for the query at p = L-1 (a local head's sink pages and the pages its window reaches)."""
    n_lp = _cdiv(shape.ctx, PAGE_SIZE)
    if shape.kind != "decode":
        return torch.ones(HKV, n_lp, dtype=torch.bool)
    return torch.from_numpy(kept_page_mask(shape.ctx - 1, windows, sinks, PAGE_SIZE))


def _pages_after_trim(shape: Shape, windows, sinks) -> int:
    """Pages a sequence keeps once trimmed for its next query at p = ctx (the pool's trim)."""
    return int(kept_pages(shape.ctx, windows, sinks, PAGE_SIZE).sum()) * shape.batch


def make_case(shape: Shape, device: torch.device, seed: int, global_window: int) -> Case:
    B, L, ql = shape.batch, shape.ctx, shape.q_len
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B * ql, HQ, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    k = torch.randn(B, L, HKV, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    v = torch.randn(B, L, HKV, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    windows, sinks = _head_plan(shape, global_window)

    # Page table: kept (b, h, lp) entries get a shuffled physical page each.
    keep = _kept_pages(shape, windows, sinks)[None].expand(B, -1, -1).contiguous()
    n_lp = keep.shape[-1]
    num_pages = int(keep.sum())
    cpu_gen = torch.Generator().manual_seed(seed + 1)
    phys = torch.randperm(num_pages, generator=cpu_gen)
    bt = torch.full((B, HKV, n_lp), -1, dtype=torch.int32)
    bt[keep] = phys.to(torch.int32)
    keep_d, phys_d = keep.to(device), phys.to(device)

    def to_pages(x):  # [B, L, Hkv, D] -> [num_pages, page_size, D]
        pad = n_lp * PAGE_SIZE - L
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        xv = x.view(B, n_lp, PAGE_SIZE, HKV, HEAD_DIM).permute(0, 3, 1, 2, 4)
        pages = torch.empty(num_pages, PAGE_SIZE, HEAD_DIM, device=device, dtype=x.dtype)
        pages[phys_d] = xv[keep_d]
        return pages

    if shape.kind == "prefill":
        pos = torch.arange(L)
        seq = torch.zeros(L, dtype=torch.long)
    else:
        pos = torch.full((B,), L - 1)
        seq = torch.arange(B)
    return Case(
        shape=shape, q=q, k=k, v=v, pos=pos, seq=seq,
        cu_q=(torch.arange(B + 1, dtype=torch.int32) * ql).to(device),
        seq_lens=torch.full((B,), L, dtype=torch.int32, device=device),
        windows=windows, sinks=sinks,
        window=torch.tensor(windows, dtype=torch.int32, device=device),
        sink=torch.tensor(sinks, dtype=torch.int32, device=device),
        k_pages=to_pages(k), v_pages=to_pages(v), block_table=bt.to(device), num_pages=num_pages)


def visible_counts(pos: torch.Tensor, windows, sinks) -> torch.Tensor:
    """int64 [T, Hkv]: keys each query sees per KV head (exactly, from the rule)."""
    return keys_seen(pos.long()[:, None], torch.tensor(windows), torch.tensor(sinks))


def work_model(case: Case) -> dict:
    sh = case.shape
    counts = visible_counts(case.pos, case.windows, case.sinks)
    pairs = int(counts.sum()) * GROUP               # (query, key) pairs over query heads
    elem = torch.finfo(DTYPE).bits // 8
    kv_row = 2 * HEAD_DIM * elem                    # K + V bytes of one token of one KV head
    dense_bytes = sh.batch * sh.ctx * HKV * kv_row
    seg_bytes = case.num_pages * PAGE_SIZE * kv_row
    out = {
        "visible_pairs": pairs,
        "visible_flop": 4 * HEAD_DIM * pairs,
        "dense_causal_pairs": int((case.pos + 1).sum()) * HQ,
        "kv_bytes": {
            "dense": dense_bytes,
            "segpaged": seg_bytes,
            "segpaged_pages": case.num_pages,
            "page_bytes": PAGE_SIZE * kv_row,
            "dense_over_segpaged": dense_bytes / max(seg_bytes, 1),
        },
    }
    if sh.kind == "decode":  # one query per sequence: what it sees is what must be read
        out["visible_kv_bytes"] = int(counts.sum()) * kv_row
    else:
        after = _pages_after_trim(sh, case.windows, case.sinks)
        out["kv_bytes"]["segpaged_after_trim"] = after * PAGE_SIZE * kv_row
    return out


# --------------------------------------------------------------------------- timing

class Timer:
    """Median of CUDA-event timings (L2 flushed before each call, as triton's do_bench does).

    Calls are repeated up to `repeats` times but at least 3 and about `target_ms` in total, so
    a 400 ms kernel is not run 30 times. On CPU: wall clock, at most 3 calls."""

    def __init__(self, device: torch.device, repeats: int, target_ms: float):
        self.device, self.repeats, self.target_ms = device, max(1, repeats), target_ms
        self.flush = (torch.empty(256 << 20, dtype=torch.int8, device=device)
                      if device.type == "cuda" else None)
        # Decode kernels run for ~0.1 ms: time CUDA-graph replays so host launch overhead (as a
        # serving engine's captured decode step avoids it) does not swamp the device time.
        self.graph = False

    def _captured(self, fn):
        """fn replayed from a CUDA graph, or None if it cannot be captured."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize(self.device)
            return g.replay
        except Exception:
            torch.cuda.synchronize(self.device)
            return None

    def __call__(self, fn) -> dict:
        graphed = None
        if self.graph and self.device.type == "cuda":
            graphed = self._captured(fn)
            if graphed is not None:
                return {**self._time(graphed), "cuda_graph": True}
        return {**self._time(fn), "cuda_graph": False} if self.device.type == "cuda" else self._time(fn)

    def _time(self, fn) -> dict:
        if self.device.type != "cuda":
            ts = []
            for _ in range(max(1, min(self.repeats, 3))):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return {"ms": statistics.median(ts), "min_ms": min(ts), "n": len(ts)}
        ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        s, e = ev(), ev()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        est = max(s.elapsed_time(e), 1e-3)
        n = int(min(self.repeats, max(3, self.target_ms // est)))
        for _ in range(int(min(n, max(1, 50 // est)))):  # ~50 ms of warm-up
            fn()
        starts, ends = [ev() for _ in range(n)], [ev() for _ in range(n)]
        for i in range(n):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        ts = [a.elapsed_time(b) for a, b in zip(starts, ends)]
        return {"ms": statistics.median(ts), "min_ms": min(ts), "n": n}


# --------------------------------------------------------------------------- exact reference

def rule_attention(q, k, v, q_pos, windows, sinks, scale) -> torch.Tensor:
    """Exact attention of one sequence under the visibility rule, for the given query rows only.

    float64 throughout (cheap for a few hundred rows, and immune to TF32 settings).
    q [n, Hq, D]; k, v [L, Hkv, D]; q_pos int64 [n] (device) -> float64 [n, Hq, D]."""
    n, L = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    j = torch.arange(L, device=q.device)
    out = torch.empty(n, q.shape[1], q.shape[2], dtype=torch.float64, device=q.device)
    chunk = max(1, (256 << 20) // (g * L * 8))  # <= 256 MiB of scores at a time
    for h in range(k.shape[1]):
        kf, vf = k[:, h].double(), v[:, h].double()
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            p = q_pos[r0:r1, None]
            vis = visible(p, j[None], windows[h], sinks[h])
            qs = q[r0:r1, h * g:(h + 1) * g].double()
            s = (qs.reshape(-1, qs.shape[-1]) @ kf.T).view(r1 - r0, g, L) * scale
            s.masked_fill_(~vis[:, None, :], float("-inf"))
            out[r0:r1, h * g:(h + 1) * g] = torch.softmax(s, dim=-1) @ vf
    return out


def sample_rows(case: Case, n: int, seed: int) -> torch.Tensor:
    """Query rows to check: all if few, else n rows incl. first/last and window/sink/page edges."""
    T = case.q.shape[0]
    if T <= n:
        return torch.arange(T)
    W, S = case.shape.window, SINK
    special = torch.tensor([0, 1, S - 1, S, S + 1, PAGE_SIZE - 1, PAGE_SIZE, W - 1, W, W + 1,
                            W + S, W + PAGE_SIZE, T // 2, T - 2, T - 1])
    special = special[(special >= 0) & (special < T)].unique()
    rand = torch.randperm(T, generator=torch.Generator().manual_seed(seed))[:n - special.numel()]
    return torch.cat([special, rand]).unique()


def reference_rows(case: Case, rows: torch.Tensor) -> torch.Tensor:
    """float64 [len(rows), Hq, D] exact masked attention for the sampled query rows."""
    dev = case.q.device
    out = torch.empty(rows.numel(), HQ, HEAD_DIM, dtype=torch.float64, device=dev)
    seq = case.seq[rows]
    for b in seq.unique().tolist():
        idx = (seq == b).nonzero().flatten()
        r = rows[idx]
        out[idx.to(dev)] = rule_attention(case.q[r.to(dev)], case.k[b], case.v[b],
                                          case.pos[r].to(dev), case.windows, case.sinks,
                                          case.scale)
    return out


def compare(a: torch.Tensor, b: torch.Tensor, chunk: int = 4096) -> dict:
    """cos over everything, min cos of one (row, head), max abs error; fp64, in row chunks."""
    dot = na = nb = 0.0
    min_cos, max_err, bad = float("inf"), 0.0, 0
    for r0 in range(0, a.shape[0], chunk):
        x, y = a[r0:r0 + chunk].double(), b[r0:r0 + chunk].double()
        bad += int((~torch.isfinite(x)).sum())
        dot += float((x * y).sum())
        na += float((x * x).sum())
        nb += float((y * y).sum())
        min_cos = min(min_cos, float(F.cosine_similarity(x, y, dim=-1).min()))
        max_err = max(max_err, float((x - y).abs().max()))
    cos = dot / max(math.sqrt(na * nb), 1e-300)
    return {"cos": _num(cos), "min_row_head_cos": _num(min_cos), "max_abs_err": _num(max_err),
            "nonfinite": bad, "rows": int(a.shape[0])}


# --------------------------------------------------------------------------- FA-2 (flash)

def _varlen_fn():
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


def make_fa(cfg: dict, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float,
            causal: bool, window_left: int = -1):
    """A zero-argument FA-2 varlen call through the API the probe chose (cfg['api']).

    Arguments are resolved here, once, so the timed call carries no inspection overhead.
    FA's window (left, 0) covers keys p-left..p, so the rule's `p - j < W` is left = W-1; the
    probe confirms that convention (cfg['window_offset'] corrects it if a build differs)."""
    if window_left >= 0:
        window_left += cfg.get("window_offset", 0)
    if cfg["api"] == "varlen_attn":
        fn = _varlen_fn()
        params = inspect.signature(fn).parameters
        kw = {}
        if "scale" in params:
            kw["scale"] = scale
        elif abs(scale - 1.0 / math.sqrt(q.shape[-1])) > 1e-12:
            raise RuntimeError("varlen_attn has no scale argument")
        if cfg["gqa"] == "enable_gqa":
            kw["enable_gqa"] = True
        if "window_size" in params:
            kw["window_size"] = ((window_left, 0) if window_left >= 0
                                 else ((-1, 0) if causal else (-1, -1)))
        elif window_left >= 0:
            raise NotImplementedError("this varlen_attn has no window_size")
        else:
            kw["is_causal"] = causal
        return lambda: fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    # The aten op that varlen_attn wraps (torch >= 2.5 has the window arguments).
    op = torch.ops.aten._flash_attention_forward
    kw = {"scale": scale}
    if window_left >= 0:
        kw.update(window_size_left=window_left, window_size_right=0)
    is_causal = causal and window_left < 0
    return lambda: op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False, **kw)[0]


def fa_kv(cfg: dict, k, v, group: int):
    """KV as the chosen API wants it (expanded per query head only if it lacks GQA)."""
    if cfg["gqa"] == "expand":
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return k, v


def probe_fa(device: torch.device) -> dict:
    """Pick a working FA-2 varlen API (+ GQA mode + window convention) on tiny inputs, checked
    against the exact rule reference, so the timed calls compute what they claim.

    Preference: varlen_attn with native GQA (enable_gqa or plain), then the aten flash op it
    wraps, and only then KV expanded per query head (which reads Hq/Hkv times more KV)."""
    info: dict = {"causal": None, "window": None, "tried": []}
    if device.type != "cuda":
        info["error"] = "flash attention needs CUDA"
        return info
    try:
        info["varlen_signature"] = str(inspect.signature(_varlen_fn()))
        apis = ["varlen_attn"]
    except Exception as e:
        info["varlen_error"] = _err(e)
        apis = []
    apis.append("aten_flash")
    gen = torch.Generator(device=device).manual_seed(123)
    hq, hkv, d, lens, w = 4, 2, HEAD_DIM, [150, 90], 40
    scale = 1.0 / math.sqrt(d)
    T = sum(lens)
    q = torch.randn(T, hq, d, generator=gen, device=device, dtype=DTYPE)
    k = torch.randn(T, hkv, d, generator=gen, device=device, dtype=DTYPE)
    v = torch.randn(T, hkv, d, generator=gen, device=device, dtype=DTYPE)
    cu = torch.tensor([0, lens[0], T], dtype=torch.int32, device=device)
    cu_dec = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    q_dec = torch.stack([q[lens[0] - 1], q[T - 1]])  # last token of each sequence

    def ref(window, decode):
        outs = []
        for b, (s0, n) in enumerate(zip([0, lens[0]], lens)):
            qs = q_dec[b:b + 1] if decode else q[s0:s0 + n]
            pos = torch.arange(n - qs.shape[0], n, device=device)
            outs.append(rule_attention(qs, k[s0:s0 + n], v[s0:s0 + n], pos,
                                       [window] * hkv, [0] * hkv, scale))
        return torch.cat(outs)

    def ok(cfg, window_left, rule_window, decode):
        kk, vv = fa_kv(cfg, k, v, hq // hkv)
        qq, cq, mq = (q_dec, cu_dec, 1) if decode else (q, cu, max(lens))
        o = make_fa(cfg, qq, kk, vv, cq, cu, mq, max(lens), scale, causal=not decode,
                    window_left=window_left)()
        c = compare(o, ref(rule_window, decode))["cos"]
        info["tried"].append({**cfg, "window_left": window_left, "decode": decode, "cos": c})
        return isinstance(c, float) and c > 0.9999

    cands = []
    if "varlen_attn" in apis and "enable_gqa" in info.get("varlen_signature", ""):
        cands.append({"api": "varlen_attn", "gqa": "enable_gqa"})
    cands += [{"api": a, "gqa": "native"} for a in apis]
    cands += [{"api": a, "gqa": "expand"} for a in apis]
    for cfg in cands:  # dense: causal prefill, and decode (non-causal: q_len 1 sees all)
        try:
            if ok(cfg, -1, 2**30, False) and ok(cfg, -1, 2**30, True):
                info["causal"] = cfg
                break
        except Exception as e:
            info["tried"].append({**cfg, "error": _err(e)})
    for cfg in cands:  # sliding window, prefill and decode; window_left = W-1 (+offset)
        for off in (0, 1, -1):
            c = {**cfg, "window_offset": off}
            try:
                if ok(c, w - 1, w, False) and ok(c, w - 1, w, True):
                    info["window"] = c
                    break
            except Exception as e:
                info["tried"].append({**c, "error": _err(e)})
                break  # an exception will not depend on the offset
        if info["window"]:
            break
    return info


# --------------------------------------------------------------------------- methods
# Each returns (result dict, output [T, Hq, D] or None). Exceptions are caught by the caller.

@dataclass
class Env:
    device: torch.device
    timer: Timer
    fa: dict
    kernels: tuple | None
    kernel_error: str | None
    methods: tuple
    deadline: float
    flex_failed: dict = field(default_factory=dict)  # kind -> error (skip the rest of that kind)
    cuda_dead: str | None = None


def _bhsd(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B*S, H, D] or [B, S, H, D] -> contiguous [B, H, S, D]."""
    return x.reshape(batch, -1, x.shape[-2], x.shape[-1]).transpose(1, 2).contiguous()


def _sdpa_ctx(device, flash_only: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device.type == "cuda" and flash_only:
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    import contextlib
    return contextlib.nullcontext()


def _window_mask(q_pos, L, window, device):
    """bool [Lq, L]: causal sliding window without sink (the FA bucket semantics)."""
    j = torch.arange(L, device=device)[None]
    p = q_pos.to(device)[:, None]
    return visible(p, j, window, 0)


def bench_fa_dense(case: Case, env: Env):
    sh, dev = case.shape, env.device
    B, L, ql = sh.batch, sh.ctx, sh.q_len
    prefill = sh.kind == "prefill"
    cfg = env.fa.get("causal")
    if cfg:
        k, v = fa_kv(cfg, case.k.view(B * L, HKV, HEAD_DIM), case.v.view(B * L, HKV, HEAD_DIM),
                     GROUP)
        cu_k = (torch.arange(B + 1, dtype=torch.int32) * L).to(dev)
        fn = make_fa(cfg, case.q, k, v, case.cu_q, cu_k, ql, L, case.scale, causal=prefill)
        method = f"{cfg['api']} ({'causal' if prefill else 'full, q_len 1'}, gqa={cfg['gqa']})"
    else:
        q4, k4, v4 = _bhsd(case.q, B), case.k.transpose(1, 2).contiguous(), \
            case.v.transpose(1, 2).contiguous()
        flash = dev.type == "cuda"

        def fn():
            with _sdpa_ctx(dev, flash):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=prefill,
                                                      scale=case.scale, enable_gqa=True)
        method = f"sdpa ({'flash backend' if flash else 'default backend'}, " \
                 f"is_causal={prefill}, enable_gqa)"
    return {"method": method, **env.timer(fn)}, None


def bench_fa_buckets(case: Case, env: Env):
    sh, dev = case.shape, env.device
    B, L, ql = sh.batch, sh.ctx, sh.q_len
    prefill = sh.kind == "prefill"
    gkv = list(GLOBAL_KV_HEADS)
    lkv = [h for h in range(HKV) if h not in GLOBAL_KV_HEADS]
    gq = [hq for hq in range(HQ) if hq // GROUP in GLOBAL_KV_HEADS]
    lq = [hq for hq in range(HQ) if hq // GROUP not in GLOBAL_KV_HEADS]
    wins = {case.windows[h] for h in lkv}
    if len(wins) != 1:
        raise ValueError(f"bucket baseline needs one local window, got {sorted(wins)}")
    W = wins.pop()
    # Per-class tensors laid out once, outside the timing (as a bucketed cache would hold them).
    qg, ql_ = case.q[:, gq].contiguous(), case.q[:, lq].contiguous()
    kg = case.k[:, :, gkv].reshape(B * L, len(gkv), HEAD_DIM).contiguous()
    vg = case.v[:, :, gkv].reshape(B * L, len(gkv), HEAD_DIM).contiguous()
    kl = case.k[:, :, lkv].reshape(B * L, len(lkv), HEAD_DIM).contiguous()
    vl = case.v[:, :, lkv].reshape(B * L, len(lkv), HEAD_DIM).contiguous()
    cc, cw = env.fa.get("causal"), env.fa.get("window")
    if dev.type == "cuda":
        if not (cc and cw):
            raise RuntimeError(f"no working FA-2 causal/window call (probe: causal={cc}, "
                               f"window={cw})")
        cu_k = (torch.arange(B + 1, dtype=torch.int32) * L).to(dev)
        kg, vg = fa_kv(cc, kg, vg, GROUP)
        kl, vl = fa_kv(cw, kl, vl, GROUP)
        f_glob = make_fa(cc, qg, kg, vg, case.cu_q, cu_k, ql, L, case.scale, causal=prefill)
        f_loc = make_fa(cw, ql_, kl, vl, case.cu_q, cu_k, ql, L, case.scale, causal=True,
                        window_left=W - 1)
        method = (f"global: {cc['api']} {'causal' if prefill else 'full'} (gqa={cc['gqa']}); "
                  f"local: {cw['api']} window_size=({W - 1 + cw.get('window_offset', 0)}, 0) "
                  f"(gqa={cw['gqa']})")
    else:  # CPU smoke path: SDPA, the window as a bool mask
        qg4, ql4 = _bhsd(qg, B), _bhsd(ql_, B)
        kg4, vg4 = _bhsd(kg, B), _bhsd(vg, B)
        kl4, vl4 = _bhsd(kl, B), _bhsd(vl, B)
        mask = _window_mask(case.pos[:ql], L, W, dev)
        f_glob = lambda: F.scaled_dot_product_attention(  # noqa: E731
            qg4, kg4, vg4, is_causal=prefill, scale=case.scale, enable_gqa=True)
        f_loc = lambda: F.scaled_dot_product_attention(  # noqa: E731
            ql4, kl4, vl4, attn_mask=mask, scale=case.scale, enable_gqa=True)
        method = "cpu: sdpa global causal + sdpa local with window bool mask"
    tg, tl = env.timer(f_glob), env.timer(f_loc)
    return {"method": method, "ms": tg["ms"] + tl["ms"], "ms_global": tg["ms"],
            "ms_local": tl["ms"], "n": min(tg["n"], tl["n"])}, None


def bench_sdpa_mask(case: Case, env: Env):
    sh, dev = case.shape, env.device
    B, L, ql = sh.batch, sh.ctx, sh.q_len
    elem = torch.finfo(DTYPE).bits // 8
    # bool mask + its additive float copy (SDPA converts) + KV expanded to Hq heads.
    est = HQ * ql * L * (1 + elem) + 2 * B * HQ * L * HEAD_DIM * elem
    budget = (torch.cuda.mem_get_info(dev)[0] * 0.6 if dev.type == "cuda" else 4 << 30)
    if est > budget:
        return {"skipped": f"does not fit (needs ~{est / 2**30:.1f} GiB, budget "
                           f"{budget / 2**30:.1f} GiB)"}, None
    pos = case.pos[:ql].to(dev)[:, None]                       # same positions for every b
    j = torch.arange(L, device=dev)[None]
    mask = torch.stack([visible(pos, j, case.windows[h], case.sinks[h])
                        for h in range(HKV)])                  # [Hkv, Lq, L]
    mask = mask.repeat_interleave(GROUP, dim=0)[None].contiguous()  # [1, Hq, Lq, L]
    q4 = _bhsd(case.q, B)
    k4 = case.k.transpose(1, 2).repeat_interleave(GROUP, dim=1).contiguous()
    v4 = case.v.transpose(1, 2).repeat_interleave(GROUP, dim=1).contiguous()
    fn = lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask,  # noqa: E731
                                                scale=case.scale)
    out = fn().transpose(1, 2).reshape(B * ql, HQ, HEAD_DIM)
    res = env.timer(fn)
    return {"method": "sdpa, bool attn_mask [1,Hq,Lq,Lk], KV expanded to Hq heads", **res}, out


_FLEX = None


def _flex_compiled():
    global _FLEX
    if _FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def bench_flex(case: Case, env: Env):
    from torch.nn.attention.flex_attention import create_block_mask
    sh, dev = case.shape, env.device
    B, L, ql = sh.batch, sh.ctx, sh.q_len
    win, sink, q_off = case.window, case.sink, L - ql

    def mask_mod(b, h, q_idx, kv_idx):
        kvh = h // GROUP
        p = q_idx + q_off
        return visible(p, kv_idx, win[kvh], sink[kvh])

    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, None, HQ, ql, L, device=dev, _compile=dev.type == "cuda")
    _sync(dev)
    block_mask_s = time.perf_counter() - t0
    q4, k4, v4 = _bhsd(case.q, B), case.k.transpose(1, 2).contiguous(), \
        case.v.transpose(1, 2).contiguous()
    flex = _flex_compiled()
    fn = lambda: flex(q4, k4, v4, block_mask=bm, scale=case.scale, enable_gqa=True)  # noqa: E731
    t0 = time.perf_counter()
    out = fn()
    _sync(dev)
    compile_s = time.perf_counter() - t0
    res = env.timer(fn)
    out = out.transpose(1, 2).reshape(B * ql, HQ, HEAD_DIM)
    return {"method": "torch.compile(flex_attention), per-head mask_mod, enable_gqa",
            "block_mask_s": block_mask_s, "compile_s": compile_s, **res}, out


def bench_segpaged(case: Case, env: Env):
    if env.kernels is None:
        raise ImportError(env.kernel_error)
    attn, _, name = env.kernels
    args = (case.q, case.k_pages, case.v_pages, case.block_table, case.cu_q, case.seq_lens,
            case.window, case.sink, case.scale, case.shape.q_len)
    fn = lambda: attn(*args)  # noqa: E731
    t0 = time.perf_counter()
    out = fn()
    _sync(env.device)
    first_s = time.perf_counter() - t0
    return {"method": name, "first_call_s": first_s, **env.timer(fn)}, out


def check_store(case: Case, env: Env) -> dict:
    """Prefill only: segpaged_store of all tokens into fresh pools must equal our page layout."""
    if env.kernels is None or env.kernels[1] is None:
        return {"skipped": "no segpaged_store"}
    store = env.kernels[1]
    B, L = case.shape.batch, case.shape.ctx
    kp, vp = torch.zeros_like(case.k_pages), torch.zeros_like(case.v_pages)
    k, v = case.k.view(B * L, HKV, HEAD_DIM), case.v.view(B * L, HKV, HEAD_DIM)
    fn = lambda: store(k, v, kp, vp, case.block_table, case.cu_q, case.seq_lens)  # noqa: E731
    fn()
    _sync(env.device)
    exact = bool(torch.equal(kp, case.k_pages) and torch.equal(vp, case.v_pages))
    return {"exact_match": exact, **env.timer(fn)}


def bench_segpaged_tma(case: Case, env: Env):
    if env.device.type != "cuda":
        raise RuntimeError("the tensor-descriptor path is timed on CUDA only")
    if case.shape.kind != "prefill":
        raise RuntimeError("prefill only (decode does not take the tensor-descriptor path)")
    from ..kernels import segpaged
    cfg = segpaged.KernelConfig(prefill=TMA_PREFILL, tma=True)
    args = (case.q, case.k_pages, case.v_pages, case.block_table, case.cu_q, case.seq_lens,
            case.window, case.sink, case.scale, case.shape.q_len)
    fn = lambda: segpaged.segpaged_attention(*args, config=cfg)  # noqa: E731
    t0 = time.perf_counter()
    out = fn()
    _sync(env.device)
    return {"method": f"redknot.kernels.segpaged KernelConfig(prefill={TMA_PREFILL}, tma=True)",
            "first_call_s": time.perf_counter() - t0, **env.timer(fn)}, out


def bench_fa3(case: Case, env: Env):
    """FA-3 dense causal over the contiguous K/V (what dense attention costs at FA-3 speed)."""
    try:
        import flash_attn_interface
    except ImportError as e:
        raise ImportError(f"no FlashAttention-3 build on this machine ({e})") from e
    if case.shape.kind != "prefill":
        raise RuntimeError("prefill only")
    B, L = case.shape.batch, case.shape.ctx
    q = case.q.view(B, L, HQ, HEAD_DIM)
    fn = lambda: flash_attn_interface.flash_attn_func(q, case.k, case.v, softmax_scale=case.scale,  # noqa: E731
                                                      causal=True)
    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    return {"method": "flash_attn_interface.flash_attn_func (FA-3), dense causal",
            **env.timer(fn)}, out.reshape(B * L, HQ, HEAD_DIM)


BENCH = {"fa_dense": bench_fa_dense, "fa_buckets": bench_fa_buckets,
         "sdpa_mask": bench_sdpa_mask, "flex": bench_flex, "segpaged": bench_segpaged,
         "segpaged_tma": bench_segpaged_tma,
         "fa3": bench_fa3}


# --------------------------------------------------------------------------- one shape

def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_shape(shape: Shape, env: Env, rows_n: int, seed: int) -> dict:
    dev = env.device
    entry: dict = {"name": shape.name, "kind": shape.kind, "batch": shape.batch,
                   "ctx": shape.ctx, "q_len": shape.q_len, "window": shape.window,
                   "sink": SINK, "methods": {}, "correctness": {}, "speedup": {}}
    env.timer.graph = shape.kind == "decode"
    entry["timing"] = "cuda-graph replay" if env.timer.graph and dev.type == "cuda" else "eager"
    t_shape = time.perf_counter()
    if env.cuda_dead:
        entry["skipped"] = f"CUDA context lost ({env.cuda_dead[:120]})"
        return entry
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        case = make_case(shape, dev, seed, GLOBAL_WINDOW)
        entry.update(work_model(case))
    except Exception as e:
        entry["error"] = f"setup: {_err(e)}"
        if dev.type == "cuda" and not _cuda_alive(dev):
            env.cuda_dead = entry["error"]
        return entry

    outs = {}
    for m in METHODS:
        if m not in env.methods:
            entry["methods"][m] = {"skipped": "not selected"}
            continue
        if env.cuda_dead:
            entry["methods"][m] = {"skipped": f"CUDA context lost ({env.cuda_dead[:120]})"}
            continue
        if time.perf_counter() > env.deadline:
            entry["methods"][m] = {"skipped": "time budget exhausted"}
            continue
        if m == "flex" and shape.kind in env.flex_failed:
            entry["methods"][m] = {"skipped": f"flex failed earlier: {env.flex_failed[shape.kind]}"}
            continue
        print(f"[kernel-bench] {shape.name}: {m} ...", flush=True)
        try:
            res, out = BENCH[m](case, env)
            if out is not None:
                outs[m] = out  # kept for the correctness check below
        except Exception as e:
            res = {"error": _err(e)}
            if os.environ.get("REDKNOT_BENCH_TRACEBACK"):
                traceback.print_exc()
            if m == "flex" and not _is_oom(e):
                env.flex_failed[shape.kind] = _err(e)[:200]
            if not _cuda_alive(dev):
                env.cuda_dead = f"{m}: {_err(e)}"
        entry["methods"][m] = res
        _free_memory(dev)

    if shape.kind == "prefill" and "segpaged" in env.methods and not env.cuda_dead:
        try:
            entry["store"] = check_store(case, env)
        except Exception as e:
            entry["store"] = {"error": _err(e)}
        _free_memory(dev)

    # Correctness on sampled rows vs the exact (float64) rule.
    if outs and not env.cuda_dead:
        try:
            rows = sample_rows(case, rows_n, seed)
            ref = reference_rows(case, rows)
            rows_d = rows.to(dev)
            for m, out in outs.items():
                entry["correctness"][f"{m}_vs_ref"] = compare(out[rows_d], ref)
            if "segpaged" in outs and "flex" in outs:
                entry["correctness"]["segpaged_vs_flex"] = compare(outs["segpaged"], outs["flex"])
                entry["correctness"]["segpaged_vs_flex"]["rows"] = "all"
        except Exception as e:
            entry["correctness"]["error"] = _err(e)

    # Rates and speedups.
    seg = entry["methods"].get("segpaged", {}).get("ms")
    kvb = entry.get("kv_bytes", {})
    for m, res in entry["methods"].items():
        ms = res.get("ms")
        if not ms:
            continue
        s = ms * 1e-3
        res["tflops_visible"] = entry["visible_flop"] / s / 1e12
        if shape.kind == "decode":
            res["tbps_visible"] = entry["visible_kv_bytes"] / s / 1e12
            if m == "segpaged":
                res["tbps_pages_read"] = kvb["segpaged"] / s / 1e12
            if m == "fa_dense":
                res["tbps_dense_read"] = kvb["dense"] / s / 1e12
        if seg and m != "segpaged":
            entry["speedup"][m] = ms / seg
    flex_ms = entry["methods"].get("flex", {}).get("ms")
    tma_ms = entry["methods"].get("segpaged_tma", {}).get("ms")
    if tma_ms and flex_ms:
        entry["speedup"]["flex_over_segpaged_tma"] = flex_ms / tma_ms
    if dev.type == "cuda":
        entry["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    entry["wall_s"] = time.perf_counter() - t_shape
    del case, outs
    _free_memory(dev)
    return entry


# --------------------------------------------------------------------------- report

def _cell(res: dict) -> str:
    if "ms" in res:
        ms = res["ms"]
        return f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"
    if "error" in res:
        return "ERR"
    if "skipped" in res:
        return "nofit" if "does not fit" in res["skipped"] else "skip"
    return "-"


TABLE_COLS = ("segpaged", "fa_dense", "fa_buckets", "flex", "sdpa_mask", "fa3", "segpaged_tma")
TABLE_LABELS = {"segpaged_tma": "seg tma"}
TABLE_HEAD = (f"{'shape':<13}" + "".join(f"{TABLE_LABELS.get(c, c):>11}" for c in TABLE_COLS)
              + f"{'x dense':>9}{'x bucket':>9}{'x flex':>8}{'seg rate':>13}"
              + f"{'cos ref':>10}{'cos flex':>10}{'KV dense/seg':>13}")


def table_row(e: dict) -> str:
    ms = e.get("methods", {})
    row = f"{e['name']:<13}" + "".join(f"{_cell(ms.get(c, {})):>11}" for c in TABLE_COLS)
    sp = e.get("speedup", {})
    row += "".join(f"{(f'{sp[k]:.2f}x' if k in sp else '-'):>{w}}"
                   for k, w in (("fa_dense", 9), ("fa_buckets", 9), ("flex", 8)))
    seg = ms.get("segpaged", {})
    rate = "-"
    if "ms" in seg:
        rate = (f"{seg['tbps_visible']:.2f} TB/s" if e["kind"] == "decode"
                else f"{seg['tflops_visible']:.0f} TF/s")
    cr = e.get("correctness", {})

    def fmt(c):
        return f"{c:.6f}" if isinstance(c, float) else ("-" if c is None else str(c))
    kvr = e.get("kv_bytes", {}).get("dense_over_segpaged")
    return (row + f"{rate:>13}{fmt(cr.get('segpaged_vs_ref', {}).get('cos')):>10}"
            f"{fmt(cr.get('segpaged_vs_flex', {}).get('cos')):>10}"
            f"{(f'{kvr:.2f}x' if kvr else '-'):>13}")


def _problems(e: dict) -> list[str]:
    out = [f"{e['name']}: {e[k]}" for k in ("error", "skipped") if k in e]
    for m, r in e.get("methods", {}).items():
        if "error" in r:
            out.append(f"{e['name']}/{m}: {r['error'][:200]}")
        elif r.get("skipped", "not selected") != "not selected":
            out.append(f"{e['name']}/{m} skipped: {r['skipped'][:200]}")
    if "error" in e.get("correctness", {}):
        out.append(f"{e['name']}/correctness: {e['correctness']['error'][:200]}")
    store = e.get("store", {})
    if "error" in store:
        out.append(f"{e['name']}/store: {store['error'][:200]}")
    elif store.get("exact_match") is False:
        out.append(f"{e['name']}/store: segpaged_store pages differ from the bench's layout")
    return out


def print_table(result: dict) -> None:
    lines = ["", f"kernel bench on {result.get('device')} | torch {result.get('torch')} | "
             f"triton {result.get('triton')} | segpaged = {result.get('segpaged_impl')} | "
             f"median ms", TABLE_HEAD, "-" * len(TABLE_HEAD)]
    problems = []
    for e in result["shapes"]:
        lines.append(table_row(e))
        problems += _problems(e)
    if problems:
        lines.append("errors / skipped:")
        lines += [f"  {x}" for x in problems]
    lines.append("(x = baseline ms / segpaged ms in this run; rate = visible work; "
                 f"cos target >= 0.99998) json: {result.get('out')}")
    print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------- entry points

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="all",
                   help=f"comma list of {', '.join(SHAPES)} (or with --quick: "
                        f"{', '.join(QUICK_SHAPES)}); default all")
    p.add_argument("--methods", default="all",
                   help=f"comma list of {', '.join(METHODS)}; default all (on CPU flex is left "
                        f"out unless named)")
    p.add_argument("--out", default=None,
                   help="JSON file; default $OUT/kernel.json if OUT is set, else kernel.json")
    p.add_argument("--repeats", type=int, default=50,
                   help="max timed calls per method (>= 3 on CUDA, fewer for slow calls; "
                        "default 50; CPU: at most 3)")
    p.add_argument("--target-ms", type=float, default=1000.0,
                   help="about this much timed work per method (default 1000)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--rows", type=int, default=512,
                   help="query rows checked vs the float64 rule (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=360.0,
                   help="start no new method after this many seconds (default 360)")
    p.add_argument("--h2o", action="store_true",
                   help="the H2O heavy-hitter decode shapes instead (8K/16K/32K, B=8, 10%% budget): segpaged with "
                        "sel_pos (and with its fused decode merge) vs FA-2 dense vs the same selection stored densely (redknot.bench.kernel_h2o)")
    p.add_argument("--kernel", default="auto",
                   help="MODULE:FUNCTION of the segpaged attention to time (default: "
                        "redknot.kernels on CUDA, the torch reference on CPU)")


def _versions() -> dict:
    try:
        from importlib.metadata import version
        triton_v = version("triton")
    except Exception:
        triton_v = None
    return {"torch": torch.__version__, "triton": triton_v, "python": platform.python_version(),
            "cuda": torch.version.cuda}


def _select(arg: str, known, what: str) -> list:
    if not arg or arg == "all":
        return list(known)
    names = [s.strip() for s in arg.split(",") if s.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {list(known)}")
    return names


def run(args) -> dict:
    t_run = time.perf_counter()
    g = lambda name, default: getattr(args, name, default)  # noqa: E731
    dev_name = g("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    quick = bool(g("quick", False))
    if device.type != "cuda" and not quick:
        raise SystemExit("the full shapes (8K-128K) need a CUDA GPU; use --quick on CPU")
    table = QUICK_SHAPES if quick else SHAPES
    shapes = [table[n] for n in _select(g("shapes", "all"), table, "shape")]
    methods_arg = g("methods", "all")
    methods = _select(methods_arg, METHODS, "method")
    if device.type != "cuda" and (not methods_arg or methods_arg == "all"):
        # no compile in the CPU smoke test; FA-3 and TMA need a GPU
        methods = [m for m in methods if m not in ("flex", "fa3", "segpaged_tma")]
    out_path = g("out", None) or os.path.join(os.environ.get("OUT", "."), "kernel.json")

    result = {
        "benchmark": "redknot.bench.kernel",
        "argv": list(sys.argv),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool,
                                                                       type(None)))},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()})",
        **_versions(),
        "config": {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
                   "dtype": str(DTYPE).replace("torch.", ""),
                   "global_kv_heads": list(GLOBAL_KV_HEADS), "sink_local": SINK,
                   "global_window": GLOBAL_WINDOW, "sm_scale": 1.0 / math.sqrt(HEAD_DIM),
                   "methods": methods, "rows_checked": g("rows", 512),
                   "timer": (f"median of CUDA events, L2 flushed before each call, 3.."
                             f"{g('repeats', 50)} calls (~{g('target_ms', 1000.0)} ms) per method"
                             if device.type == "cuda" else "median wall clock, <= 3 calls")},
        "out": out_path,
        "shapes": [],
    }
    try:
        kernels, kernel_error = _resolve_kernels(device, g("kernel", "auto")), None
        result["segpaged_impl"] = kernels[2]
    except Exception as e:
        kernels, kernel_error = None, _err(e)
        result["segpaged_impl_error"] = kernel_error
    fa = {}
    if {"fa_dense", "fa_buckets"} & set(methods):
        try:
            fa = probe_fa(device)
        except Exception as e:
            fa = {"causal": None, "window": None, "error": _err(e)}
        print(f"[kernel-bench] FA-2 probe: causal={fa.get('causal')} window={fa.get('window')}"
              f"{' error=' + fa['error'] if fa.get('error') else ''}", flush=True)
    result["fa_probe"] = fa
    env = Env(device=device, timer=Timer(device, g("repeats", 50), g("target_ms", 1000.0)),
              fa=fa, kernels=kernels, kernel_error=kernel_error, methods=tuple(methods),
              deadline=t_run + g("time_budget_s", 360.0))

    def write():
        result["wall_s"] = time.perf_counter() - t_run
        d = os.path.dirname(os.path.abspath(out_path))
        os.makedirs(d, exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    for shape in shapes:
        if time.perf_counter() > env.deadline:
            result["shapes"].append({"name": shape.name, "kind": shape.kind,
                                     "skipped": "time budget exhausted", "methods": {}})
            continue
        print(f"[kernel-bench] shape {shape.name} ...", flush=True)
        entry = run_shape(shape, env, g("rows", 512), g("seed", 0))
        result["shapes"].append(entry)
        write()  # partial results survive a timeout
        print(f"[kernel-bench] {TABLE_HEAD}\n[kernel-bench] {table_row(entry)}  "
              f"({entry.get('wall_s', 0):.1f} s)", flush=True)
    del env
    _free_memory(device)
    write()
    print_table(result)
    return result
