"""Latent attention decode (DeepSeek's MLA) in Triton: one absorbed query per sequence over the
pool's latent pages, every query head under its own window and sink.

A token's cached row ``[k_rope | c]`` (width 2w) lies across the pool: its first w elements in the
K pages, the other w in the V pages (``kernels/mla_reference.py``). One program per (split, block
of query heads, sequence) loads a tile of rows once for all the heads of its block, the latents c
[BLOCK_N, R] and the RoPE parts [BLOCK_N, dr], scores each head's query against them and
accumulates the weighted latents; a block walks the key tiles any of its heads can see (its
widest sink, then its widest window) cut evenly over the splits, and each head masks what it
does not see. Partial outputs and base-2 LSEs are fp32 and merged in fp32. Launch shapes follow
from tensor shapes only (no host sync): decode steps replay in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)

BLOCK_H = 16  # query heads per program (the smallest tile tl.dot takes)


@triton.jit
def _mla_decode_kernel(Q, K, V, OP, LP, BT, SEQ, WIN, SINK, qk_scale, n_heads, per_split,
                       stride_qb, stride_qh, stride_opb, stride_oph, stride_ops, stride_lpb, stride_lph,
                       stride_kp, stride_ks, stride_bb, max_pages,
                       HALF: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, RANK: tl.constexpr,
                       RANK_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    split = tl.program_id(0)
    hb = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    pos = seq_len - 1  # the query's position
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < n_heads
    W = tl.load(WIN + h, mask=h_ok, other=1)
    S = tl.load(SINK + h, mask=h_ok, other=0)
    # the tiles some head of the block sees: sink tiles [0, n_sink), window tiles [w0, t_end)
    t_end = pos // BLOCK_N + 1
    w_max = tl.max(tl.where(h_ok, W, 1), 0)
    s_max = tl.max(tl.where(h_ok, S, 0), 0)
    n_sink = tl.minimum((s_max + BLOCK_N - 1) // BLOCK_N, t_end)
    w0 = tl.minimum(tl.maximum(tl.maximum(pos - w_max + 1, 0) // BLOCK_N, n_sink), t_end)
    n_vis = n_sink + t_end - w0
    i_lo = split * per_split
    i_hi = tl.minimum(i_lo + per_split, n_vis)

    offs_r = tl.arange(0, RANK_PAD)
    offs_e = tl.arange(0, ROPE_PAD)
    q_row = Q + b * stride_qb + h[:, None] * stride_qh
    q_rope = tl.load(q_row + offs_e[None, :], mask=h_ok[:, None] & (offs_e < ROPE)[None, :], other=0.0)
    q_lat = tl.load(q_row + ROPE + offs_r[None, :], mask=h_ok[:, None] & (offs_r < RANK)[None, :], other=0.0)
    if UPCAST:
        q_rope, q_lat = q_rope.to(tl.float32), q_lat.to(tl.float32)
    # latent element r is row element ROPE + r: in the K half below HALF, else in the V half
    e = ROPE + offs_r
    in_k = e < HALF
    lat_off = tl.where(in_k, e, e - HALF)
    lat_ok = (offs_r < RANK)[None, :]

    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = BT + b * stride_bb
    for i in range(i_lo, i_hi):
        t = tl.where(i < n_sink, i, w0 + i - n_sink)
        j = t * BLOCK_N + offs_n
        lp = j // PAGE
        phys = tl.load(bt_row + lp, mask=lp < max_pages, other=-1)
        ok = (phys >= 0) & (j < seq_len)
        base = phys.to(tl.int64) * stride_kp + (j % PAGE) * stride_ks
        c_ptr = tl.where(in_k[None, :], K + base[:, None] + lat_off[None, :], V + base[:, None] + lat_off[None, :])
        c = tl.load(c_ptr, mask=ok[:, None] & lat_ok, other=0.0).to(q_lat.dtype)
        kr = tl.load(K + base[:, None] + offs_e[None, :], mask=ok[:, None] & (offs_e < ROPE)[None, :],
                     other=0.0).to(q_rope.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PREC)
        s += tl.dot(q_rope, tl.trans(kr), input_precision=DOT_PREC)
        pj = pos - j
        keep = ok[None, :] & (pj >= 0)[None, :] & ((j[None, :] < S[:, None]) | (pj[None, :] < W[:, None]))
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head that has seen nothing yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new
    l_use = tl.where(l_i == 0.0, 1.0, l_i)
    o_row = OP + b * stride_opb + h[:, None] * stride_oph + split * stride_ops
    tl.store(o_row + offs_r[None, :], acc / l_use[:, None], mask=h_ok[:, None] & lat_ok)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_use))
    tl.store(LP + b * stride_lpb + h * stride_lph + split, lse, mask=h_ok)


@triton.jit
def _mla_merge_kernel(OP, LP, O, num_splits, stride_opb, stride_oph, stride_ops, stride_lpb, stride_lph,
                      stride_ob, stride_oh, RANK: tl.constexpr, RANK_PAD: tl.constexpr, CHUNK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.arange(0, RANK_PAD)
    offs_s = tl.arange(0, CHUNK)
    lp_row = LP + b * stride_lpb + h * stride_lph
    op_row = OP + b * stride_opb + h * stride_oph
    m_vec = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    for c in range(0, num_splits, CHUNK):
        m_vec = tl.maximum(m_vec, tl.load(lp_row + c + offs_s, mask=c + offs_s < num_splits, other=float("-inf")))
    m = tl.max(m_vec, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([CHUNK], dtype=tl.float32)
    acc = tl.zeros([CHUNK, RANK_PAD], dtype=tl.float32)
    for c in range(0, num_splits, CHUNK):
        s_ok = c + offs_s < num_splits
        w = tl.exp2(tl.load(lp_row + c + offs_s, mask=s_ok, other=float("-inf")) - m_use)
        o = tl.load(op_row + (c + offs_s)[:, None] * stride_ops + offs_r[None, :],
                    mask=s_ok[:, None] & (offs_r < RANK)[None, :], other=0.0)
        den += w
        acc += w[:, None] * o
    total = tl.sum(den, 0)
    out = tl.sum(acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + b * stride_ob + h * stride_oh + offs_r, out.to(O.dtype.element_ty), mask=offs_r < RANK)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def mla_decode(q, k_pages, v_pages, block_tables, seq_lens, window, sink, sm_scale: float, rope_dim: int,
               block_n: int | None = None, tiles_per_split: int | None = None) -> torch.Tensor:
    """Absorbed queries q [B, H, 2w] (one per sequence, at position seq_len - 1) over the rows of
    k_pages/v_pages [num_pages, page_size, w] through block_tables int32 [B, 1, max_pages] (-1: not
    stored); window/sink int32 [H] per query head. Returns the latent outputs [B, H, 2w - rope_dim]
    in q's dtype. ``block_n`` / ``tiles_per_split``: launch choices (tests reach small tiles)."""
    B, n_heads, width = q.shape
    w = k_pages.shape[2]
    rank = width - rope_dim
    if width != 2 * w or v_pages.shape != k_pages.shape or k_pages.stride() != v_pages.stride():
        raise ValueError(f"q rows are {width} wide; k_pages/v_pages must be two equal halves, got "
                         f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    if rope_dim > w or k_pages.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("the RoPE part must lie in the K half, and rows need a contiguous last dimension")
    if block_tables.dim() != 3 or block_tables.shape[:2] != (B, 1):
        raise ValueError(f"block_tables must be [B={B}, 1, max_pages], got {tuple(block_tables.shape)}")
    dev = q.device
    max_pages, page = block_tables.shape[2], k_pages.shape[1]
    bt = block_tables.to(torch.int32)
    sl = seq_lens.to(device=dev, dtype=torch.int32)
    win = torch.as_tensor(window, device=dev).to(torch.int32).contiguous()
    snk = torch.as_tensor(sink, device=dev).to(torch.int32).contiguous()
    block_n = block_n or (32 if rank >= 256 else 64)
    n_hblocks = triton.cdiv(n_heads, BLOCK_H)
    n_tiles = triton.cdiv(max_pages * page, block_n)
    if tiles_per_split is None:  # ~16 programs an SM if every block sees every tile, at most 64 splits
        sms = _num_sms(dev.index if dev.index is not None else torch.cuda.current_device()) if q.is_cuda else 4
        tiles_per_split = max(4, triton.cdiv(n_tiles, triton.cdiv(16 * sms, B * n_hblocks)), triton.cdiv(n_tiles, 64))
    num_splits = max(1, triton.cdiv(n_tiles, tiles_per_split))
    o_part = torch.empty((B, n_heads, num_splits, rank), dtype=torch.float32, device=dev)
    lse_part = torch.empty((B, n_heads, num_splits), dtype=torch.float32, device=dev)
    out = torch.empty((B, n_heads, rank), dtype=q.dtype, device=dev)
    if B == 0:
        return out
    upcast = _interpreting() and q.dtype != torch.float32  # the interpreter's dots want fp32
    _mla_decode_kernel[(num_splits, n_hblocks, B)](
        q, k_pages, v_pages, o_part, lse_part, bt, sl, win, snk, float(sm_scale) * _LOG2E, n_heads,
        tiles_per_split, q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), k_pages.stride(0), k_pages.stride(1), bt.stride(0), max_pages,
        HALF=w, ROPE=rope_dim, ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)), RANK=rank,
        RANK_PAD=max(16, triton.next_power_of_2(rank)), PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else None, UPCAST=upcast,
        num_warps=4, num_stages=2)
    _mla_merge_kernel[(B, n_heads)](
        o_part, lse_part, out, num_splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        RANK=rank, RANK_PAD=triton.next_power_of_2(rank), CHUNK=min(16, triton.next_power_of_2(num_splits)),
        num_warps=4)
    return out
