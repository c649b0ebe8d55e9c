"""Readable torch references for SegPagedAttention (see docs/segpaged.md).

These are the oracles the Triton kernels are tested against. They favour clarity over speed:
plain loops over sequences and KV heads, float32 math, an explicit visibility mask.
"""

from __future__ import annotations

import math

import torch

from ..config import GLOBAL_WINDOW  # noqa: F401  (global/dense heads: `p - j < W` always holds)


def _as_list(x, n: int) -> list[int]:
    """Per-KV-head int values from a tensor, a sequence or a scalar."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, int):
        return [x] * n
    x = [int(v) for v in x]
    if len(x) != n:
        raise ValueError(f"expected {n} per-KV-head values, got {len(x)}")
    return x


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sink: int,
                    sel: torch.Tensor | None = None) -> torch.Tensor:
    """bool [len(q_pos), len(k_pos)]: query at p sees key j iff
    j <= p and (j < sink or p - j < window or j in sel)."""
    p = q_pos[:, None].long()
    j = k_pos[None, :].long()
    extra = (j < sink) | (p - j < window)
    if sel is not None:
        sel = sel[sel >= 0].long()
        extra = extra | torch.isin(k_pos.long(), sel)[None, :]
    return (j <= p) & extra


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            sm_scale: float):
    """q [Q, G, D], k/v [K, D], mask [Q, K] -> o [Q, G, D] fp32, lse [Q, G] fp32 (natural log).
    Rows that see nothing get o = 0 and lse = -inf."""
    s = torch.einsum("qgd,kd->qgk", q.float(), k.float()) * sm_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.einsum("qgk,kd->qgd", p, v.float())
    return o, lse


def segpaged_store_ref(k, v, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens):
    """Write the new tokens' K/V ([total_q, Hkv, D]) into their pages, in place.

    block_tables: int32 [B, Hkv, max_pages] of one layer; -1 entries are skipped (the head
    keeps nothing there)."""
    page_size = k_pages.shape[1]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    bt = block_tables.tolist()
    for b in range(len(lens)):
        q_len = cu[b + 1] - cu[b]
        for i in range(q_len):
            t = cu[b] + i
            pos = lens[b] - q_len + i
            lp, slot = divmod(pos, page_size)
            for h in range(k.shape[1]):
                phys = bt[b][h][lp] if lp < len(bt[b][h]) else -1
                if phys >= 0:
                    k_pages[phys, slot] = k[t, h]
                    v_pages[phys, slot] = v[t, h]


def segpaged_attention_ref(q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, window,
                           sink, sm_scale=None, max_q_len=None, sel_pos=None, sel_lens=None,
                           return_lse=False):
    """Attention over each KV head's own pages (docs/segpaged.md).

    q [total_q, Hq, D]; k_pages/v_pages [num_pages, page_size, D]; block_tables int32
    [B, Hkv, max_pages] (-1: nothing stored; such keys are absent); window/sink [Hkv];
    sel_pos int32 [B, Hkv, max_sel] padded with -1, sel_lens [B, Hkv] (None: count entries >= 0).
    Returns o [total_q, Hq, D] (dtype of q) and, if return_lse, lse float32 [total_q, Hq]."""
    total_q, hq, d = q.shape
    num_pages, page_size, _ = k_pages.shape
    hkv = block_tables.shape[1]
    g = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    windows, sinks = _as_list(window, hkv), _as_list(sink, hkv)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    o = torch.zeros(total_q, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(lens)):
        q_len, seq_len = cu[b + 1] - cu[b], lens[b]
        if q_len == 0:
            continue
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        for h in range(hkv):
            # Gather every stored key of this head through its block table.
            phys = block_tables[b, h].long()
            lp = k_pos // page_size
            in_table = lp < phys.numel()
            page = torch.where(in_table, phys[lp.clamp_max(phys.numel() - 1)], -1)
            present = page >= 0
            slot = k_pos % page_size
            kk = k_pages[page.clamp_min(0), slot]
            vv = v_pages[page.clamp_min(0), slot]
            sel = None
            if sel_pos is not None:
                n_sel = int((sel_pos[b, h] >= 0).sum()) if sel_lens is None else int(sel_lens[b, h])
                sel = sel_pos[b, h, :n_sel]
            mask = visibility_mask(q_pos, k_pos, windows[h], sinks[h], sel) & present[None, :]
            # Absent keys may hold anything (even NaN): zero them so they cannot leak.
            kk = torch.where(present[:, None], kk.float(), 0.0)
            vv = torch.where(present[:, None], vv.float(), 0.0)
            qs = q[cu[b]:cu[b + 1], h * g:(h + 1) * g]
            ob, lb = _attend(qs, kk, vv, mask, sm_scale)
            o[cu[b]:cu[b + 1], h * g:(h + 1) * g] = ob
            lse[cu[b]:cu[b + 1], h * g:(h + 1) * g] = lb
    o = o.to(q.dtype)
    return (o, lse) if return_lse else o


def dense_masked_attention(q, k, v, window, sink, sm_scale=None, sel=None, return_lse=False):
    """Second oracle: one sequence, contiguous K/V, no pages.

    q [q_len, Hq, D] are the last q_len positions of a sequence whose keys are k/v
    [seq_len, Hkv, D]; window/sink are per KV head; sel is an optional per-KV-head list of
    selected-position tensors. KV heads are expanded per query head (fine for an oracle)."""
    q_len, hq, d = q.shape
    seq_len, hkv, _ = k.shape
    g = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    windows, sinks = _as_list(window, hkv), _as_list(sink, hkv)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    mask = torch.stack([
        visibility_mask(q_pos, k_pos, windows[h], sinks[h], None if sel is None else sel[h])
        for h in range(hkv)
    ])                                                   # [Hkv, Q, K]
    mask = mask.repeat_interleave(g, dim=0)              # [Hq, Q, K]
    kf = k.float().repeat_interleave(g, dim=1)           # [K, Hq, D]
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                     # [Hq, Q]
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    o = torch.einsum("hqk,khd->qhd", p, vf).to(q.dtype)
    return (o, lse.transpose(0, 1).contiguous()) if return_lse else o
