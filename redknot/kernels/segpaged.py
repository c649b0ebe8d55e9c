"""SegPagedAttention Triton kernels (contract: docs/segpaged.md).

Three kernels share a few jitted helpers:

* ``_store_kernel``: writes the step's new K/V into each KV head's own pages (one launch).
* ``_prefill_kernel``: varlen attention for any q_len. One program per (query head, query block,
  sequence). It walks only the tiles a head can see from its query block: the sink tiles, then
  the window tiles, split into [window edge | interior | causal edge]; only edges compute a mask.
* ``_decode_kernel`` + ``_merge_kernel``: small q_len. One program per (split, KV head, sequence)
  packs every query head of the GQA group (and every query of the step) into one tile, so each KV
  page is read once per group; each head's visible tiles are cut evenly over the splits so small
  batches and sparse heads still fill the GPU. Partial O/LSE are fp32 and merged in fp32, by
  ``_merge_kernel`` or (``KernelConfig.decode_fused_merge``) by the last split of each group
  inside ``_decode_kernel``; both call ``_merge_rows``.

Positions are never stored: slot s of logical page lp holds position lp * page_size + s.
All softmax math is fp32, base-2 (scores are pre-multiplied by log2(e)); LSE is returned in
natural log. A learned sink logit per query head (gpt-oss) is one more term of the denominator
with no value: prefill starts each row's online softmax from it (max = sink, sum = 1), decode
adds it once in the merge.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
import triton
import triton.language as tl

from ..config import GLOBAL_WINDOW  # noqa: F401  (re-exported for convenience)

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)  # base-2 LSE -> natural log
_LOG2E_C = tl.constexpr(1.4426950408889634)  # natural-log logit -> base 2

# Largest q_len (per sequence) that takes the split-KV decode path.
DECODE_MAX_Q = 8
# Fewest key tiles per busy decode split when each head's tiles are cut evenly (measured on an
# H200: 1 and 2 tie on dense decode; 1 is up to 8% faster on budgeted heads).
DECODE_MIN_TILES = 1


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch choices for ``segpaged_attention``; a field left None keeps the built-in choice.

    The built-in choices follow from head_dim, dtype and shapes. Tests set fields to reach small
    tiles and every code path under the interpreter; benchmarks set them to sweep variants.

    * ``prefill``: (BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel.
    * ``decode``: (BLOCK_N, num_warps, num_stages) of the decode kernel.
    * ``decode_max_q``: largest q_len that takes the decode path (built-in: ``DECODE_MAX_Q``).
    * ``decode_tiles_per_split``: key tiles per decode split, fixed (built-in: the split count
      follows from shapes and each head's visible tiles are cut evenly over it).
    * ``decode_min_tiles_per_split``: fewest key tiles a busy decode split reads when the tiles
      are cut evenly (built-in: ``DECODE_MIN_TILES``).
    * ``decode_maxnreg``: a cap on the decode kernel's registers per thread (built-in: 128 with
      selected sets on a GPU, else the compiler's choice).
    * ``fast_interior``: mask-free interior tiles in prefill (built-in: True); False reads them
      through the path that still checks whether each page is stored.
    * ``merge_edges``: all masked tiles of a prefill block in one loop instead of three
      (built-in: BLOCK_N <= 32).
    * ``tma``: prefill reads interior key tiles through tensor descriptors (TMA on Hopper and
      later) instead of pointer loads (built-in: off until measured faster). Needs BLOCK_N to
      divide the page and a contiguous pool. (Triton's warp specialisation of that loop was
      measured on an H100 with Triton 3.6: no faster, 339 vs 340 TFLOP/s at 32K, and it fails to
      compile with 4 warps; it is not offered.)
    * ``decode_fused_merge``: the decode splits merge their own partials: each split counts
      itself on a per-(sequence, KV head) semaphore after writing its partial, and the last one
      merges the group's rows, so decode is one launch instead of two (built-in: off, the
      separate merge kernel, until measured faster). The semaphores are a cached buffer that
      every launch leaves zeroed (CUDA-graph safe); launches sharing a shape must not run
      concurrently on different streams.
    """

    prefill: tuple[int, int, int, int] | None = None
    decode: tuple[int, int, int] | None = None
    decode_max_q: int | None = None
    decode_tiles_per_split: int | None = None
    decode_min_tiles_per_split: int | None = None
    decode_maxnreg: int | None = None
    fast_interior: bool | None = None
    merge_edges: bool | None = None
    tma: bool | None = None
    decode_fused_merge: bool | None = None


_BUILT_IN = KernelConfig()


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _kv_rows(bt_row, j0, max_pages, stride_kp, stride_ks,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pool row offsets of key positions j0 + [0, BLOCK_N) and whether their page is stored."""
    offs = tl.arange(0, BLOCK_N)
    if PAGE % BLOCK_N == 0:
        # The tile sits inside one page: one table lookup, contiguous rows.
        lp = j0 // PAGE
        phys = tl.load(bt_row + lp, mask=lp < max_pages, other=-1)
        rows = phys.to(tl.int64) * stride_kp + ((j0 % PAGE) + offs) * stride_ks
        ok = (phys + offs * 0) >= 0
    else:
        # The tile spans several pages: one lookup per row.
        j = j0 + offs
        lp = j // PAGE
        phys = tl.load(bt_row + lp, mask=lp < max_pages, other=-1)
        rows = phys.to(tl.int64) * stride_kp + (j % PAGE) * stride_ks
        ok = phys >= 0
    return rows, ok


@triton.jit
def _softmax_step(acc, l_i, m_i, s, v, DOT_PREC: tl.constexpr):
    """One online-softmax update with base-2 scores s [M, N] (masked entries are -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp, stride_ks,
                  t_lo, t_hi, pos, seq_len, W, S, qk_scale,
                  HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """Attend to key tiles [t_lo, t_hi) (tile t = positions t*BLOCK_N + [0, BLOCK_N)).

    MASKED=False is only used on tiles every query of the block fully sees (interior), where
    the one remaining check is whether the page is stored at all."""
    for t in range(t_lo, t_hi):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp, stride_ks, t,
                              pos, seq_len, W, S, qk_scale, HEAD_DIM, PAGE, BLOCK_N, MASKED,
                              DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _attend_edges(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp, stride_ks,
                  n_sink, w0, f0, f1, t_end, pos, seq_len, W, S, qk_scale,
                  HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """The masked tiles [0, n_sink) + [w0, f0) + [f1, t_end) as one loop (one pipeline fill)."""
    n_win = f0 - w0
    for i in range(0, n_sink + n_win + (t_end - f1)):
        t = tl.where(i < n_sink, i, tl.where(i < n_sink + n_win, w0 + i - n_sink, f1 + i - n_sink - n_win))
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp, stride_ks, t,
                              pos, seq_len, W, S, qk_scale, HEAD_DIM, PAGE, BLOCK_N, True, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _tile(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp, stride_ks, t,
          pos, seq_len, W, S, qk_scale,
          HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
          MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key tile (positions t*BLOCK_N + [0, BLOCK_N)) into the online softmax."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    j0 = t * BLOCK_N
    rows, ok = _kv_rows(bt_row, j0, max_pages, stride_kp, stride_ks, PAGE, BLOCK_N)
    j = j0 + offs_n
    if MASKED:
        # Slots past seq_len may hold anything (even NaN): never load them.
        ok = ok & (j < seq_len)
    k = tl.load(K + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
    v = tl.load(V + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASKED:
        pj = pos[:, None] - j[None, :]
        keep = ok[None, :] & (pj >= 0) & ((j[None, :] < S) | (pj < W))
        s = tl.where(keep, s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale + tl.where(ok, 0.0, float("-inf"))[None, :]
    return _softmax_step(acc, l_i, m_i, s, v, DOT_PREC)


@triton.jit
def _interior_step(acc, l_i, m_i, q, k, v, qk_scale, DOT_PREC: tl.constexpr):
    """One fully visible key tile into the online softmax: no masks; the scale folds into the
    exp2 argument, and each row's max is finite from the first tile."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attend_interior(acc, l_i, m_i, q, K, V, bt_row, stride_kp, stride_ks, t_lo, t_hi, qk_scale,
                     HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    """Tiles [t_lo, t_hi) that every query of the block fully sees: no masks at all.

    Every position the rule makes visible is stored (pool invariant), so pages here exist;
    the scale folds into the exp2 argument and each row's max is finite from the first tile."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(t_lo, t_hi):
        j0 = t * BLOCK_N
        if PAGE % BLOCK_N == 0:
            phys = tl.maximum(tl.load(bt_row + j0 // PAGE), 0)
            rows = phys.to(tl.int64) * stride_kp + ((j0 % PAGE) + offs_n) * stride_ks
        else:
            j = j0 + offs_n
            phys = tl.maximum(tl.load(bt_row + j // PAGE), 0)
            rows = phys.to(tl.int64) * stride_kp + (j % PAGE) * stride_ks
        k = tl.load(K + rows[:, None] + offs_d[None, :]).to(q.dtype)
        v = tl.load(V + rows[:, None] + offs_d[None, :]).to(q.dtype)
        acc, l_i, m_i = _interior_step(acc, l_i, m_i, q, k, v, qk_scale, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _attend_interior_tma(acc, l_i, m_i, q, k_desc, v_desc, bt_row, t_lo, t_hi, qk_scale,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """``_attend_interior`` with each key tile fetched through tensor descriptors: a tile sits
    inside one page (BLOCK_N divides PAGE), so it is one [BLOCK_N, D] box of the pool's rows."""
    for t in range(t_lo, t_hi):
        j0 = t * BLOCK_N
        phys = tl.maximum(tl.load(bt_row + j0 // PAGE), 0)
        row = phys * PAGE + j0 % PAGE
        k = k_desc.load([row, 0]).to(q.dtype)
        v = v_desc.load([row, 0]).to(q.dtype)
        acc, l_i, m_i = _interior_step(acc, l_i, m_i, q, k, v, qk_scale, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _attend_sel(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp, stride_ks,
                sel_row, n_sel, i_lo, i_hi, pos, seq_len, W, S, qk_scale,
                HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SEL_N: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """Retrieval: attend to selected positions (blocks [i_lo, i_hi) of SEL_N entries) that the
    sink/window rule does not already cover.

    A block that is one aligned run of SEL_N positions (what page-granular budgets select) is
    read as a key tile, rows found as for any tile; other blocks gather each position through
    the block table."""
    offs_n = tl.arange(0, SEL_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for i in range(i_lo, i_hi):
        base = i * SEL_N
        j_first = tl.load(sel_row + base)
        j_last = tl.load(sel_row + base + SEL_N - 1, mask=base + SEL_N <= n_sel, other=-1)
        if (j_first >= 0) & (j_first % SEL_N == 0) & (j_last - j_first == SEL_N - 1):
            js = j_first + offs_n
            rows, ok = _kv_rows(bt_row, j_first, max_pages, stride_kp, stride_ks, PAGE, SEL_N)
            ok = ok & (js < seq_len)
        else:
            idx = base + offs_n
            js = tl.load(sel_row + idx, mask=idx < n_sel, other=-1)
            inside = (idx < n_sel) & (js >= 0) & (js < seq_len)
            lp = tl.where(inside, js, 0) // PAGE
            phys = tl.load(bt_row + lp, mask=inside & (lp < max_pages), other=-1)
            ok = inside & (phys >= 0)
            rows = phys.to(tl.int64) * stride_kp + (tl.where(inside, js, 0) % PAGE) * stride_ks
        k = tl.load(K + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        v = tl.load(V + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        pj = pos[:, None] - js[None, :]
        already = (js[None, :] < S) | (pj < W)
        keep = ok[None, :] & (pj >= 0) & (already == 0)
        s = tl.where(keep, s * qk_scale, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _tile_ranges(p_lo, p_hi, W, S, BLOCK_N: tl.constexpr):
    """Tiles a head can see from queries at positions [p_lo, p_hi]:
    sink tiles [0, n_sink), then window tiles [w0, t_end) split as
    [w0, f0) window edge | [f0, f1) fully visible | [f1, t_end) causal edge."""
    t_end = p_hi // BLOCK_N + 1
    n_sink = tl.minimum((S + BLOCK_N - 1) // BLOCK_N, t_end)
    w0 = tl.minimum(tl.maximum(tl.maximum(p_lo - W + 1, 0) // BLOCK_N, n_sink), t_end)
    f0 = tl.minimum(tl.maximum((tl.maximum(p_hi - W + 1, 0) + BLOCK_N - 1) // BLOCK_N, w0), t_end)
    f1 = tl.minimum(tl.maximum((p_lo + 1) // BLOCK_N, f0), t_end)
    return n_sink, w0, f0, f1, t_end


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _store_kernel(Kn, Vn, KP, VP, BT, CU, SEQ, QPOS, total_q, num_seqs,
                  stride_knt, stride_knh, stride_vnt, stride_vnh,
                  stride_kp, stride_ks, stride_vp, stride_vs,
                  stride_bb, stride_bh, max_pages,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
                  SEARCH_STEPS: tl.constexpr, HAS_QPOS: tl.constexpr):
    hk = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < total_q
    # Sequence of each token: the largest b with cu[b] <= t (binary search, empty seqs ok).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = (hi - lo) > 1
        c = tl.load(CU + mid, mask=go, other=0)
        lo = tl.where(go & (c <= t), mid, lo)
        hi = tl.where(go & (c > t), mid, hi)
    b = lo
    q_start = tl.load(CU + b, mask=t_ok, other=0)
    q_len = tl.load(CU + b + 1, mask=t_ok, other=0) - q_start
    if HAS_QPOS:  # explicit positions (rows a recovery computes anywhere in the prompt)
        pos = tl.load(QPOS + t, mask=t_ok, other=0)
    else:
        pos = tl.load(SEQ + b, mask=t_ok, other=0) - q_len + (t - q_start)
    lp = pos // PAGE
    phys = tl.load(BT + b * stride_bb + hk * stride_bh + lp,
                   mask=t_ok & (lp < max_pages) & (pos >= 0), other=-1)
    offs_d = tl.arange(0, BLOCK_D)  # any head_dim: rows padded to a power of 2, masked
    ok = (phys >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(Kn + t64[:, None] * stride_knt + hk * stride_knh + offs_d[None, :], mask=ok)
    v = tl.load(Vn + t64[:, None] * stride_vnt + hk * stride_vnh + offs_d[None, :], mask=ok)
    phys64 = phys.to(tl.int64)
    slot = pos % PAGE
    tl.store(KP + (phys64 * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :],
             k.to(KP.dtype.element_ty), mask=ok)
    tl.store(VP + (phys64 * stride_vp + slot * stride_vs)[:, None] + offs_d[None, :],
             v.to(VP.dtype.element_ty), mask=ok)


@triton.jit
def _prefill_kernel(Q, K, V, O, LSE, BT, CU, SEQ, WIN, SINK, SEL, SEL_LEN, QPOS, SINK_LOGIT, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                    stride_kp, stride_ks, stride_bb, stride_bh, max_pages,
                    stride_sb, stride_sh, stride_nb, pool_rows,
                    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEL_N: tl.constexpr,
                    HAS_SEL: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST: tl.constexpr, FAST_INTERIOR: tl.constexpr,
                    MERGE_EDGES: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_SINK_LOGIT: tl.constexpr,
                    USE_TMA: tl.constexpr):
    hq = tl.program_id(0)
    # Late query blocks see the most keys: launch them first to shorten the tail.
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q_start
    m_start = mb * BLOCK_M
    if m_start >= q_len:
        return
    seq_len = tl.load(SEQ + b)
    ctx = seq_len - q_len
    hk = hq // GQA
    W = tl.load(WIN + hk)
    S = tl.load(SINK + hk)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + tok[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if HAS_QPOS:  # explicit (sorted) query positions: a recovery computes a subset of tokens
        pos = tl.load(QPOS + tok, mask=row_ok, other=0)
        p_lo = tl.load(QPOS + q_start + m_start)
        p_hi = tl.load(QPOS + q_start + tl.minimum(m_start + BLOCK_M, q_len) - 1)
    else:  # the last q_len positions of the sequence
        pos = ctx + offs_m
        p_lo = ctx + m_start
        p_hi = ctx + tl.minimum(m_start + BLOCK_M, q_len) - 1
    n_sink, w0, f0, f1, t_end = _tile_ranges(p_lo, p_hi, W, S, BLOCK_N)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if HAS_SINK_LOGIT:  # the sink is the first term of the softmax: max = sink (base 2), sum = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK_LOGIT + hq) * _LOG2E_C
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row = BT + b * stride_bb + hk * stride_bh
    if MERGE_EDGES:
        acc, l_i, m_i = _attend_edges(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                      stride_ks, n_sink, w0, f0, f1, t_end, pos, seq_len, W, S,
                                      qk_scale, HEAD_DIM, PAGE, BLOCK_N, DOT_PREC)
    else:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                      stride_ks, 0, n_sink, pos, seq_len, W, S, qk_scale,
                                      HEAD_DIM, PAGE, BLOCK_N, True, DOT_PREC)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                      stride_ks, w0, f0, pos, seq_len, W, S, qk_scale,
                                      HEAD_DIM, PAGE, BLOCK_N, True, DOT_PREC)
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(K, shape=[pool_rows, HEAD_DIM], strides=[stride_ks, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V, shape=[pool_rows, HEAD_DIM], strides=[stride_ks, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        acc, l_i, m_i = _attend_interior_tma(acc, l_i, m_i, q, k_desc, v_desc, bt_row, f0, f1,
                                             qk_scale, PAGE, BLOCK_N, DOT_PREC)
    elif FAST_INTERIOR:
        acc, l_i, m_i = _attend_interior(acc, l_i, m_i, q, K, V, bt_row, stride_kp, stride_ks,
                                         f0, f1, qk_scale, HEAD_DIM, PAGE, BLOCK_N, DOT_PREC)
    else:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                      stride_ks, f0, f1, pos, seq_len, W, S, qk_scale,
                                      HEAD_DIM, PAGE, BLOCK_N, False, DOT_PREC)
    if not MERGE_EDGES:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                      stride_ks, f1, t_end, pos, seq_len, W, S, qk_scale,
                                      HEAD_DIM, PAGE, BLOCK_N, True, DOT_PREC)
    if HAS_SEL:
        n_sel = tl.load(SEL_LEN + b * stride_nb + hk)
        acc, l_i, m_i = _attend_sel(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                    stride_ks, SEL + b * stride_sb + hk * stride_sh, n_sel,
                                    0, (n_sel + SEL_N - 1) // SEL_N, pos, seq_len, W, S,
                                    qk_scale, HEAD_DIM, PAGE, SEL_N, DOT_PREC)

    l_use = tl.where(l_i == 0.0, 1.0, l_i)  # a row that sees nothing outputs 0
    o = acc / l_use[:, None]
    tl.store(O + tok[:, None] * stride_ot + hq * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_use)) * _LN2)
        tl.store(LSE + tok * stride_lt + hq, lse, mask=row_ok)


@triton.jit
def _merge_rows(OP, LP, O, LSE, SINK_LOGIT, tok, h, row_ok, num_splits,
                stride_opt, stride_oph, stride_ops, stride_lpt, stride_lph, stride_ot, stride_oh, stride_lt,
                ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, WRITE_LSE: tl.constexpr,
                HAS_SINK_LOGIT: tl.constexpr, CACHE: tl.constexpr):
    """Merges the split partials (fp32 O, base-2 LSE) of ROWS (query token tok, query head h) rows
    (row_ok: the rows that exist) into their outputs (and natural-log LSE): each row's max LSE
    first, then the LSE-weighted sum. CACHE is the partials' load cache modifier ('.cg' reads
    them from L2, never a stale L1 line)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, CHUNK)
    lp_row = LP + tok * stride_lpt + h * stride_lph
    op_row = OP + tok * stride_opt + h * stride_oph
    # Pass 1: the max base-2 LSE over splits.
    m_vec = tl.full([ROWS, CHUNK], float("-inf"), dtype=tl.float32)
    for c in range(0, num_splits, CHUNK):
        ok = row_ok[:, None] & (c + offs_s < num_splits)[None, :]
        lse = tl.load(lp_row[:, None] + c + offs_s[None, :], mask=ok, other=float("-inf"),
                      cache_modifier=CACHE)
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, 1)
    sink2 = float("-inf")
    if HAS_SINK_LOGIT:  # one more partial: the sink, with weight exp(sink) and output 0
        sink2 = tl.load(SINK_LOGIT + h, mask=row_ok, other=float("-inf")) * _LOG2E_C
        m = tl.maximum(m, sink2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    # Pass 2: LSE-weighted sum of the partial outputs, in fp32.
    den = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    acc = tl.zeros([ROWS, CHUNK, HEAD_DIM], dtype=tl.float32)
    for c in range(0, num_splits, CHUNK):
        ok = row_ok[:, None] & (c + offs_s < num_splits)[None, :]
        lse = tl.load(lp_row[:, None] + c + offs_s[None, :], mask=ok, other=float("-inf"),
                      cache_modifier=CACHE)
        w = tl.exp2(lse - m_use[:, None])
        o = tl.load(op_row[:, None, None] + (c + offs_s)[None, :, None] * stride_ops + offs_d[None, None, :],
                    mask=ok[:, :, None], other=0.0, cache_modifier=CACHE)
        den += w
        acc += w[:, :, None] * o
    total = tl.sum(den, 1)
    if HAS_SINK_LOGIT:
        total += tl.exp2(sink2 - m_use)
    out = tl.sum(acc, 1) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(O + (tok * stride_ot + h * stride_oh)[:, None] + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    if WRITE_LSE:
        lse_out = tl.where(total == 0.0, float("-inf"), (m_use + tl.log2(total)) * _LN2)
        tl.store(LSE + tok * stride_lt + h, lse_out, mask=row_ok)


@triton.jit
def _decode_kernel(Q, K, V, OP, LP, BT, CU, SEQ, WIN, SINK, SEL, SEL_LEN, qk_scale,
                   stride_qt, stride_qh, stride_opt, stride_oph, stride_ops,
                   stride_lpt, stride_lph,
                   stride_kp, stride_ks, stride_bb, stride_bh, max_pages,
                   stride_sb, stride_sh, stride_nb, min_tiles,
                   O, LSE, SINK_LOGIT, SEM, stride_ot, stride_oh, stride_lt,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_SEL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                   FUSED_MERGE: tl.constexpr, CHUNK: tl.constexpr, MERGE_ROWS: tl.constexpr,
                   WRITE_LSE: tl.constexpr, HAS_SINK_LOGIT: tl.constexpr):
    split = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q_start
    if q_len == 0:
        return
    seq_len = tl.load(SEQ + b)
    ctx = seq_len - q_len
    W = tl.load(WIN + hk)
    S = tl.load(SINK + hk)

    # Row r of the tile is query qi = r // GQA of query head hk * GQA + r % GQA.
    r = tl.arange(0, BLOCK_M)
    qi = r // GQA
    hq = hk * GQA + r % GQA
    row_ok = qi < q_len
    pos = ctx + qi
    tok = (q_start + qi).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + tok[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Visible tiles of the group, as one list: sink tiles, window tiles, selected blocks.
    n_sink, w0, f0, f1, t_end = _tile_ranges(ctx, seq_len - 1, W, S, BLOCK_N)
    n_page = n_sink + (t_end - w0)
    n_tiles = n_page
    n_sel = 0
    if HAS_SEL:
        n_sel = tl.load(SEL_LEN + b * stride_nb + hk)
        n_tiles += (n_sel + BLOCK_N - 1) // BLOCK_N
    # The head's own visible tiles (not the block table's width) are cut evenly over the
    # splits: a budgeted head whose few kept pages sit in a wide table still spreads over all
    # of them instead of loading every tile in the first few splits.
    num_splits = tl.num_programs(0)
    per_split = tl.maximum(min_tiles, (n_tiles + num_splits - 1) // num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row = BT + b * stride_bb + hk * stride_bh
    # Memory bound: every tile is masked, the ALU cost is hidden behind the loads.
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                  stride_ks, t_lo, tl.minimum(t_hi, n_sink), pos, seq_len,
                                  W, S, qk_scale, HEAD_DIM, PAGE, BLOCK_N, True, DOT_PREC)
    shift = w0 - n_sink
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                  stride_ks, tl.maximum(t_lo, n_sink) + shift,
                                  tl.minimum(t_hi, n_page) + shift, pos, seq_len,
                                  W, S, qk_scale, HEAD_DIM, PAGE, BLOCK_N, True, DOT_PREC)
    if HAS_SEL:
        acc, l_i, m_i = _attend_sel(acc, l_i, m_i, q, K, V, bt_row, max_pages, stride_kp,
                                    stride_ks, SEL + b * stride_sb + hk * stride_sh, n_sel,
                                    tl.maximum(t_lo, n_page) - n_page, t_hi - n_page,
                                    pos, seq_len, W, S, qk_scale,
                                    HEAD_DIM, PAGE, BLOCK_N, DOT_PREC)

    # Every split writes its partial, empty ones as (0, -inf), so the merge needs no mask.
    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_use[:, None]
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_use))
    tl.store(OP + tok[:, None] * stride_opt + hq[:, None] * stride_oph + split * stride_ops
             + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(LP + tok * stride_lpt + hq * stride_lph + split, lse2, mask=row_ok)
    if FUSED_MERGE:
        # Count this split on the group's semaphore; the split that sees every other one counted
        # merges the group's rows. The barrier puts every thread's partial stores before the
        # release; the acquire (and L2-only loads) make the other splits' partials visible.
        tl.debug_barrier()
        sem = SEM + b * tl.num_programs(1) + hk
        done = tl.atomic_add(sem, 1, sem="acq_rel")
        if done == num_splits - 1:
            tl.store(sem, 0)  # every split of the group has counted: ready for the next launch
            for r0 in range(0, q_len * GQA, MERGE_ROWS):
                rr = r0 + tl.arange(0, MERGE_ROWS)  # rows of the tile: query rr // GQA, head rr % GQA
                _merge_rows(OP, LP, O, LSE, SINK_LOGIT, (q_start + rr // GQA).to(tl.int64), hk * GQA + rr % GQA,
                            rr < q_len * GQA, num_splits, stride_opt, stride_oph, stride_ops,
                            stride_lpt, stride_lph, stride_ot, stride_oh, stride_lt,
                            MERGE_ROWS, HEAD_DIM, CHUNK, WRITE_LSE, HAS_SINK_LOGIT, ".cg")


@triton.jit
def _merge_kernel(OP, LP, O, LSE, SINK_LOGIT, num_splits,
                  stride_opt, stride_oph, stride_ops, stride_lpt, stride_lph,
                  stride_ot, stride_oh, stride_lt,
                  HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, WRITE_LSE: tl.constexpr,
                  HAS_SINK_LOGIT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) + tl.zeros([1], dtype=tl.int64)
    h = tl.program_id(1) + tl.zeros([1], dtype=tl.int32)
    _merge_rows(OP, LP, O, LSE, SINK_LOGIT, t, h, h >= 0, num_splits, stride_opt, stride_oph, stride_ops,
                stride_lpt, stride_lph, stride_ot, stride_oh, stride_lt,
                1, HEAD_DIM, CHUNK, WRITE_LSE, HAS_SINK_LOGIT, "")


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _upcast(dtype: torch.dtype) -> bool:
    # The interpreter's tl.dot mishandles 16-bit floats: run the dots in fp32 there.
    # On the GPU the dots stay in the input dtype (fp32 accumulation).
    return _interpreting() and dtype != torch.float32


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small machine, so tests still exercise several splits
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _prefill_merge_edges(block_n: int, cfg: KernelConfig) -> bool:
    """One loop for all masked tiles pays off with narrow tiles (measured: -3% at 8K with
    BLOCK_N=32) and costs with wide ones (+6% at 32K with BLOCK_N=128)."""
    if cfg.merge_edges is not None:
        return cfg.merge_edges
    return block_n <= 32


def _prefill_tma(cfg: KernelConfig, k_pages: torch.Tensor, v_pages: torch.Tensor, block_n: int) -> bool:
    """Whether prefill reads interior tiles through tensor descriptors; an explicit request that
    the pool cannot serve is an error, not a silent fallback, so benchmarks time what they name."""
    if not cfg.tma:
        return False
    page, d = k_pages.shape[1], k_pages.shape[2]
    problems = []
    if page % block_n:
        problems.append(f"BLOCK_N={block_n} must divide the page ({page})")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not x.is_contiguous():
            problems.append(f"{name} must be contiguous")
        if x.data_ptr() % 16 or (d * x.element_size()) % 16:
            problems.append(f"{name} rows must be 16-byte aligned")
    if problems:
        raise ValueError("KernelConfig(tma=True): " + "; ".join(problems))
    if k_pages.is_cuda:
        _tma_allocator()
    return True


@functools.lru_cache(maxsize=None)
def _tma_allocator() -> None:
    """Descriptors built inside a kernel need Triton's global scratch allocator, set once."""
    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(alloc)


def _prefill_config(head_dim: int, dtype: torch.dtype, max_q_len: int, cfg: KernelConfig):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel."""
    if cfg.prefill is not None:
        return cfg.prefill
    if head_dim > 128:  # keep Q + K/V stages within shared memory
        return 64, 32, 8, 2
    if dtype == torch.float32:  # 2x the bytes per tile: keep shared memory in budget
        return (64, 32, 4, 2) if head_dim >= 128 else (64, 64, 4, 2)
    if head_dim >= 128:
        # Measured on an H200 (docs/results/kernel.md): long prefills are fastest with 128-key
        # tiles (two 64-token pages) in 2 stages; up to 16K queries, smaller 4-warp programs
        # balance the short local-head rows better.
        return (128, 32, 4, 4) if max_q_len <= 16384 else (128, 128, 8, 2)
    if head_dim >= 64:
        return 128, 64, 4, 3
    return 64, 64, 4, 3


def _decode_config(head_dim: int, dtype: torch.dtype, cfg: KernelConfig, has_sel: bool = False):
    """(BLOCK_N, num_warps, num_stages) for the decode kernel. num_stages pipelines each of its
    key-tile loops (sink, window and selected tiles): Triton applies the launch's stage count to
    every loop that sets none of its own."""
    if cfg.decode is not None:
        return cfg.decode
    block_n = 64 if head_dim >= 128 else 128
    if has_sel:
        # Measured on an H200 (docs/results/kernel.md, H2O decode): a budgeted head's few kept
        # tiles leave each split one or two tiles, where pipeline stages only cost shared memory
        # and occupancy: one stage is 1.16-1.24x faster than three at 8K-32K.
        return block_n, 4, 1
    stages = 2 if dtype == torch.float32 else 3
    return block_n, 4, stages


def _per_head(x, n: int, device: torch.device, name: str) -> torch.Tensor:
    """window/sink as int32 [Hkv] on the device (no copy if already so)."""
    if not isinstance(x, torch.Tensor):
        x = torch.tensor([int(x)] * n if isinstance(x, int) else list(x), dtype=torch.int32)
    if x.dim() != 1 or x.shape[0] != n:
        raise ValueError(f"{name} must have one value per KV head ({n}), got shape "
                         f"{tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int32)


def _int32(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.int32)


def _check_common(k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, head_dim, any_width=False):
    if k_pages.dim() != 3 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [num_pages, page_size, head_dim], "
                         f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    if not any_width and (head_dim < 16 or head_dim & (head_dim - 1)):
        raise ValueError(f"head_dim must be a power of 2 >= 16 (16, 64, 128, ...), got {head_dim}")
    if k_pages.shape[2] != head_dim:
        raise ValueError(f"head_dim mismatch: tokens have {head_dim}, pages {k_pages.shape[2]}")
    if k_pages.stride(2) != 1 or v_pages.stride(2) != 1:
        raise ValueError("k_pages/v_pages need a contiguous last (head_dim) dimension")
    if block_tables.dim() != 3:
        raise ValueError("block_tables must be one layer's [B, Hkv, max_pages], got shape "
                         f"{tuple(block_tables.shape)}")
    B = block_tables.shape[0]
    if seq_lens.shape != (B,) or cu_seqlens_q.shape != (B + 1,):
        raise ValueError(f"seq_lens must be [B] and cu_seqlens_q [B+1] with B={B}, got "
                         f"{tuple(seq_lens.shape)} and {tuple(cu_seqlens_q.shape)}")


def segpaged_store(k, v, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, q_pos=None):
    """Write new K/V ([total_q, Hkv, D], any D) into their pages in place; -1 pages are skipped.
    q_pos int [total_q]: each row's position (default: the last q_len positions of its sequence)."""
    total_q, hkv, d = k.shape
    _check_common(k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, d, any_width=True)
    if v.shape != k.shape or block_tables.shape[1] != hkv:
        raise ValueError(f"k/v must be [total_q, Hkv={block_tables.shape[1]}, D], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k/v need a contiguous last (head_dim) dimension")
    if total_q == 0:
        return
    dev = k_pages.device
    bt = _int32(block_tables, dev)
    cu = _int32(cu_seqlens_q, dev)
    sl = _int32(seq_lens, dev)
    B = bt.shape[0]
    block_t = 32
    grid = (triton.cdiv(total_q, block_t), hkv)
    qpos = _int32(q_pos, dev).contiguous() if q_pos is not None else cu  # placeholder when unused
    _store_kernel[grid](
        k, v, k_pages, v_pages, bt, cu, sl, qpos, total_q, B,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
        bt.stride(0), bt.stride(1), bt.shape[2],
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), PAGE=k_pages.shape[1], BLOCK_T=block_t,
        SEARCH_STEPS=max(1, math.ceil(math.log2(max(B, 1)))) + 1, HAS_QPOS=q_pos is not None,
        num_warps=4,
    )


def segpaged_attention(q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, window, sink,
                       sm_scale=None, max_q_len=None, sel_pos=None, sel_lens=None,
                       return_lse=False, q_pos=None, config: KernelConfig | None = None,
                       sink_logits=None):
    """Per-head sink/window(/selected) attention over each KV head's own pages.

    q [total_q, Hq, D] (varlen, packed by cu_seqlens_q); k_pages/v_pages
    [num_pages, page_size, D]; block_tables int32 [B, Hkv, max_pages] (-1 = not stored);
    seq_lens int32 [B] (after this step's tokens were stored); window/sink [Hkv];
    max_q_len: host int bound on q_len (None: total_q); sel_pos int32 [B, Hkv, max_sel] sorted,
    -1 padded, with sel_lens [B, Hkv]. q_pos int32 [total_q]: explicit, sorted query positions
    per sequence (default: the last q_len positions). config: launch choices (KernelConfig;
    None: the built-in ones). sink_logits [Hq]: a learned logit per query head in every softmax
    denominator, with no value (gpt-oss; None: none). Returns o (dtype of q) and, if return_lse,
    float32 lse [total_q, Hq] (natural log, the sink logit included). No host syncs: every
    launch parameter comes from shapes."""
    total_q, hq, d = q.shape
    _check_common(k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, d)
    B, hkv, max_pages = block_tables.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if q.stride(2) != 1:
        raise ValueError("q needs a contiguous last (head_dim) dimension")
    if k_pages.stride() != v_pages.stride():
        raise ValueError("k_pages and v_pages must have the same strides")
    cfg = _BUILT_IN if config is None else config
    gqa = hq // hkv
    dev = q.device
    page = k_pages.shape[1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qk_scale = float(sm_scale) * _LOG2E
    bt = _int32(block_tables, dev)
    cu = _int32(cu_seqlens_q, dev)
    sl = _int32(seq_lens, dev)
    win = _per_head(window, hkv, dev, "window")
    snk = _per_head(sink, hkv, dev, "sink")
    has_sel = sel_pos is not None
    if has_sel:
        sel = _int32(sel_pos, dev)
        if sel.dim() != 3 or sel.shape[:2] != (B, hkv) or sel.stride(2) != 1:
            raise ValueError(f"sel_pos must be contiguous [B={B}, Hkv={hkv}, max_sel], got "
                             f"{tuple(sel.shape)}")
        nsel = (sel >= 0).sum(-1, dtype=torch.int32) if sel_lens is None else _int32(sel_lens, dev)
        nsel = nsel.contiguous()
        sel_strides = (sel.stride(0), sel.stride(1), nsel.stride(0))
    else:
        sel, nsel, sel_strides = sl, sl, (0, 0, 0)  # unused placeholders
    has_sink_logit = sink_logits is not None
    if has_sink_logit:
        if sink_logits.shape != (hq,):
            raise ValueError(f"sink_logits must have one value per query head ({hq}), got shape "
                             f"{tuple(sink_logits.shape)}")
        sink_logit = sink_logits.to(device=dev, dtype=torch.float32).contiguous()
    else:
        sink_logit = sl  # unused placeholder
    # fp32 inputs: exact fp32 dots (no silent tf32); 16-bit inputs: the default tensor-core path.
    dot_prec = "ieee" if q.dtype == torch.float32 else None
    upcast = _upcast(q.dtype)

    o = torch.empty_like(q)
    lse = torch.empty((total_q, hq), dtype=torch.float32, device=dev) if return_lse else o
    lse_stride = lse.stride(0) if return_lse else 0
    if total_q == 0:
        return (o, lse) if return_lse else o

    mq = total_q if max_q_len is None else min(int(max_q_len), total_q)
    decode_max_q = DECODE_MAX_Q if cfg.decode_max_q is None else cfg.decode_max_q
    has_qpos = q_pos is not None
    qpos = _int32(q_pos, dev).contiguous() if has_qpos else cu  # placeholder when unused
    if mq <= decode_max_q and not has_qpos:
        _decode(q, k_pages, v_pages, bt, cu, sl, win, snk, sel, nsel, sel_strides, has_sel,
                qk_scale, o, lse, return_lse, gqa, mq, dot_prec, cfg, sink_logit, has_sink_logit)
    else:
        block_m, block_n, warps, stages = _prefill_config(d, q.dtype, mq, cfg)
        use_tma = _prefill_tma(cfg, k_pages, v_pages, block_n)
        grid = (hq, triton.cdiv(mq, block_m), B)
        _prefill_kernel[grid](
            q, k_pages, v_pages, o, lse, bt, cu, sl, win, snk, sel, nsel, qpos, sink_logit, qk_scale,
            q.stride(0), q.stride(1), o.stride(0), o.stride(1), lse_stride,
            k_pages.stride(0), k_pages.stride(1), bt.stride(0), bt.stride(1), max_pages,
            *sel_strides, k_pages.shape[0] * page,
            GQA=gqa, HEAD_DIM=d, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
            SEL_N=block_n, HAS_SEL=has_sel, WRITE_LSE=return_lse, DOT_PREC=dot_prec,
            UPCAST=upcast, FAST_INTERIOR=True if cfg.fast_interior is None else cfg.fast_interior,
            MERGE_EDGES=_prefill_merge_edges(block_n, cfg), HAS_QPOS=has_qpos,
            HAS_SINK_LOGIT=has_sink_logit, USE_TMA=use_tma,
            num_warps=warps, num_stages=stages,
        )
    return (o, lse) if return_lse else o


def _decode(q, k_pages, v_pages, bt, cu, sl, win, snk, sel, nsel, sel_strides, has_sel,
            qk_scale, o, lse, return_lse, gqa, mq, dot_prec, cfg, sink_logit, has_sink_logit):
    total_q, hq, d = q.shape
    B, hkv, max_pages = bt.shape
    page = k_pages.shape[1]
    block_n, warps, stages = _decode_config(d, q.dtype, cfg, has_sel)
    block_m = max(16, triton.next_power_of_2(gqa * mq))
    # Split count from shapes only (no syncs; CUDA-graph friendly): enough splits that if every
    # group were full there would be ~16 programs per SM. Inside the kernel each head cuts its
    # own visible tiles evenly over them (at least min_tiles a split), so short or budgeted
    # heads finish in a few short programs instead of one long one.
    n_tiles_max = triton.cdiv(max_pages * page, block_n)
    if has_sel:
        n_tiles_max += triton.cdiv(sel.shape[2], block_n)
    if cfg.decode_tiles_per_split is not None:
        per_split = min_tiles = cfg.decode_tiles_per_split
    else:
        want_splits = triton.cdiv(16 * _sm_count(q.device), B * hkv)
        per_split = max(8, triton.cdiv(n_tiles_max, want_splits))
        per_split = max(per_split, triton.cdiv(n_tiles_max, 64))  # cap the merge fan-in
        min_tiles = (DECODE_MIN_TILES if cfg.decode_min_tiles_per_split is None
                     else cfg.decode_min_tiles_per_split)
    num_splits = max(1, triton.cdiv(n_tiles_max, per_split))

    o_part = torch.empty((total_q, hq, num_splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((total_q, hq, num_splits), dtype=torch.float32, device=q.device)
    maxnreg = cfg.decode_maxnreg
    if maxnreg is None and has_sel and cfg.decode is None and q.is_cuda and not _interpreting():
        # Measured on an H200 (docs/results/kernel.md, H2O decode): the compiler's 158 registers
        # a thread leave 3 programs an SM; capped at 128, 4 fit and a budgeted step is 1-7% faster.
        maxnreg = 128
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    fused = bool(cfg.decode_fused_merge)
    chunk = min(16, triton.next_power_of_2(num_splits))
    lse_stride = lse.stride(0) if return_lse else 0
    if fused:
        merge_args = (o, lse, sink_logit, _merge_semaphores(q.device, B * hkv), o.stride(0), o.stride(1), lse_stride)
        merge_consts = dict(CHUNK=chunk, MERGE_ROWS=_fused_merge_rows(gqa * mq, chunk, d), WRITE_LSE=return_lse,
                            HAS_SINK_LOGIT=has_sink_logit)
    else:  # fixed placeholders: the split kernel compiles once whatever the merge's shape
        merge_args = (sl, sl, sl, sl, 0, 0, 0)
        merge_consts = dict(CHUNK=1, MERGE_ROWS=1, WRITE_LSE=False, HAS_SINK_LOGIT=False)
    _decode_kernel[(num_splits, hkv, B)](
        q, k_pages, v_pages, o_part, lse_part, bt, cu, sl, win, snk, sel, nsel, qk_scale,
        q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        k_pages.stride(0), k_pages.stride(1), bt.stride(0), bt.stride(1), max_pages,
        *sel_strides, min_tiles,
        *merge_args,
        GQA=gqa, HEAD_DIM=d, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SEL=has_sel, DOT_PREC=dot_prec, UPCAST=_upcast(q.dtype), FUSED_MERGE=fused, **merge_consts,
        num_warps=warps, num_stages=stages, **extra,
    )
    if fused:
        return
    _merge_kernel[(total_q, hq)](
        o_part, lse_part, o, lse, sink_logit, num_splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        o.stride(0), o.stride(1), lse_stride,
        HEAD_DIM=d, CHUNK=chunk, WRITE_LSE=return_lse,
        HAS_SINK_LOGIT=has_sink_logit, num_warps=2 if d <= 64 else 4,
    )


def _fused_merge_rows(rows: int, chunk: int, head_dim: int) -> int:
    """Rows the fused merge takes at once: all of a group's if they fit 4096 fp32 partial values
    (32 registers a thread at 4 warps), else as many as do; fewer rounds, fewer L2 round trips."""
    return max(1, min(triton.next_power_of_2(rows), 4096 // (chunk * head_dim)))


_SEMAPHORES: dict[tuple[str, int], torch.Tensor] = {}


def _merge_semaphores(device: torch.device, n: int) -> torch.Tensor:
    """The fused merge's int32 counters, one per (sequence, KV head), zeroed once and cached per
    (device, count): every launch leaves them zero again, so later calls (and CUDA graphs that
    capture them after a warm-up call) reuse the same buffer."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), n)
    buf = _SEMAPHORES.get(key)
    if buf is None:
        buf = _SEMAPHORES[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return buf
