"""Readable torch references for SegPagedAttention (see docs/segpaged.md).

These are the oracles the Triton kernels are tested against, and the CPU path of the SegPaged
backend: a loop over sequences only, every head at once, float32 math, an explicit visibility
mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..visibility import visibility_mask, visible  # noqa: F401  (the rule; re-exported for the tests)


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


def segpaged_store_ref(k, v, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, q_pos=None):
    """Write the new tokens' K/V ([total_q, Hkv, D]) into their pages, in place.

    block_tables: int32 [B, Hkv, max_pages] of one layer; -1 entries are skipped (the head
    keeps nothing there). q_pos [total_q]: each row's position (default: the last q_len
    positions of its sequence)."""
    page_size, max_pages = k_pages.shape[1], block_tables.shape[2]
    seq, pos = _token_positions(cu_seqlens_q, seq_lens)
    if q_pos is not None:
        pos = q_pos.long()
    lp, slot = pos // page_size, pos % page_size
    phys = block_tables[seq, :, lp.clamp_max(max_pages - 1)].long()  # [T, Hkv]
    phys = torch.where((lp < max_pages)[:, None], phys, -1)
    t, h = (phys >= 0).nonzero(as_tuple=True)
    k_pages[phys[t, h], slot[t]] = k[t, h].to(k_pages.dtype)
    v_pages[phys[t, h], slot[t]] = v[t, h].to(v_pages.dtype)


def _token_positions(cu_seqlens_q, seq_lens):
    """Sequence index and absolute position of every packed query token."""
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(q_lens.numel(), device=cu.device), q_lens)
    pos = seq_lens.long()[seq] - q_lens[seq] + torch.arange(int(cu[-1]), device=cu.device) - cu[seq]
    return seq, pos


def segpaged_attention_ref(q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, window,
                           sink, sm_scale=None, max_q_len=None, sel_pos=None, sel_lens=None,
                           return_lse=False, q_pos=None, sink_logits=None):
    """Attention over each KV head's own pages (docs/segpaged.md).

    q [total_q, Hq, D]; k_pages/v_pages [num_pages, page_size, D]; block_tables int32
    [B, Hkv, max_pages] (-1: nothing stored; such keys are absent); window/sink [Hkv];
    sel_pos int32 [B, Hkv, max_sel] padded with -1, sel_lens [B, Hkv]; q_pos [total_q]: explicit
    query positions (default: the last q_len positions of each sequence); sink_logits [Hq]: a
    learned logit per query head in every softmax denominator, with no value (gpt-oss; None:
    none). Returns o [total_q, Hq, D] (dtype of q) and, if return_lse, lse float32 [total_q, Hq]
    (the sink logit included)."""
    total_q, hq, d = q.shape
    page_size, max_pages = k_pages.shape[1], block_tables.shape[2]
    hkv = block_tables.shape[1]
    g = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    windows = torch.tensor(_as_list(window, hkv), device=q.device)[:, None, None]  # [Hkv, 1, 1]
    sinks = torch.tensor(_as_list(sink, hkv), device=q.device)[:, None, None]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    o = torch.zeros(total_q, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(lens)):
        q_len, seq_len = cu[b + 1] - cu[b], lens[b]
        if q_len == 0:
            continue
        # Gather every stored key of every head through its block table: [Hkv, L, D].
        k_pos = torch.arange(seq_len, device=q.device)
        lp = k_pos // page_size
        phys = block_tables[b][:, lp.clamp_max(max_pages - 1)].long()
        present = (phys >= 0) & (lp < max_pages)[None, :]  # [Hkv, L]
        slot = (k_pos % page_size)[None, :]
        # Absent keys may hold anything (even NaN): zero them so they cannot leak.
        kk = torch.where(present[..., None], k_pages[phys.clamp_min(0), slot].float(), 0.0)
        vv = torch.where(present[..., None], v_pages[phys.clamp_min(0), slot].float(), 0.0)
        # The visibility rule for all heads at once: [Hkv, Q, L].
        p = (torch.arange(seq_len - q_len, seq_len, device=q.device) if q_pos is None
             else q_pos[cu[b]:cu[b + 1]].long())[None, :, None]
        j = k_pos[None, None, :]
        seen = visible(p, j, windows, sinks)
        if sel_pos is not None:
            for h in range(hkv):  # retrieval heads' explicit selections
                chosen = sel_pos[b, h, : int(sel_lens[b, h])].long()
                seen[h] |= (j[0] <= p[0]) & torch.isin(k_pos, chosen)[None, :]
        mask = seen & present[:, None, :]
        if not return_lse and sink_logits is None:  # fused masked SDPA: same math, much faster on CPU
            ob = F.scaled_dot_product_attention(
                q[cu[b]:cu[b + 1]].float().transpose(0, 1)[None], kk[None], vv[None],
                attn_mask=mask.repeat_interleave(g, dim=0)[None], scale=sm_scale, enable_gqa=True)
            o[cu[b]:cu[b + 1]] = torch.nan_to_num(ob[0].transpose(0, 1), nan=0.0)  # rows seeing nothing
            continue
        qs = q[cu[b]:cu[b + 1]].float().view(q_len, hkv, g, d)
        s = torch.einsum("qhgd,hkd->hgqk", qs, kk) * sm_scale
        s = s.masked_fill(~mask[:, None], float("-inf"))
        lb = torch.logsumexp(s, dim=-1)  # [Hkv, G, Q]; -inf for a row that sees nothing
        if sink_logits is not None:
            lb = torch.logaddexp(lb, sink_logits.to(lb.device, torch.float32).view(hkv, g, 1))
        pr = torch.nan_to_num(torch.exp(s - lb[..., None]), nan=0.0)
        ob = torch.einsum("hgqk,hkd->qhgd", pr, vv)
        o[cu[b]:cu[b + 1]] = ob.reshape(q_len, hq, d)
        lse[cu[b]:cu[b + 1]] = lb.permute(2, 0, 1).reshape(q_len, hq)
    o = o.to(q.dtype)
    return (o, lse) if return_lse else o


def dense_masked_attention(q, k, v, window, sink, sm_scale=None, sel=None, return_lse=False,
                           sink_logits=None):
    """Second oracle: one sequence, contiguous K/V, no pages.

    q [q_len, Hq, D] are the last q_len positions of a sequence whose keys are k/v
    [seq_len, Hkv, D]; window/sink are per KV head; sel is an optional per-KV-head list of
    selected-position tensors; sink_logits [Hq] as in ``segpaged_attention_ref``. KV heads are
    expanded per query head (fine for an oracle). The math runs in float64 when q is float64."""
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
    ft = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf = k.to(ft).repeat_interleave(g, dim=1)            # [K, Hq, D]
    vf = v.to(ft).repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(ft), kf) * sm_scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                     # [Hq, Q]
    if sink_logits is not None:
        lse = torch.logaddexp(lse, sink_logits.to(lse.device, ft)[:, None])
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    o = torch.einsum("hqk,khd->qhd", p, vf).to(q.dtype)
    return (o, lse.transpose(0, 1).contiguous()) if return_lse else o


def decode_layout(block_tables, seq_lens, window, sink, page_size: int, max_len: int,
                  sel_pos=None, sel_lens=None) -> dict:
    """What a decode step (one query per sequence, at seq_len - 1) needs in every layer, at once:
    the pool rows each new token is stored in (``store_rows``, for the entries ``store_src`` of
    the flattened [B, Hkv] K/V; None: all), the pages to gather and the additive mask ``bias``.

    block_tables int32 [L, B, Hkv, >= ceil(max_len / page_size)]; window/sink [L, Hkv];
    sel_pos int32 [L, B, Hkv, max_sel] (-1 padded) with sel_lens [L, B, Hkv]: selected sets."""
    n_pages = -(-max_len // page_size)
    tables = block_tables[:, :, :, :n_pages].long()  # [L, B, Hkv, P]
    pos = seq_lens.long() - 1  # [B]
    lp = (pos // page_size).clamp_max(n_pages - 1)
    store_page = tables.gather(3, lp[None, :, None, None].expand(*tables.shape[:3], 1))[..., 0]  # [L, B, Hkv]
    present = (tables >= 0).repeat_interleave(page_size, dim=3)  # [L, B, Hkv, P * ps]
    j = torch.arange(n_pages * page_size, device=tables.device)[None, None, None, :]
    mask = visible(pos[None, :, None, None], j, window.long()[:, None, :, None], sink.long()[:, None, :, None])
    if sel_pos is not None:  # selected positions, scattered into the key axis (slot P*ps: padding)
        width = n_pages * page_size
        idx = sel_pos.long()
        ok = (idx >= 0) & (idx < width) & (torch.arange(idx.shape[3], device=idx.device) < sel_lens.long()[..., None])
        chosen = torch.zeros(*idx.shape[:3], width + 1, dtype=torch.bool, device=idx.device)
        chosen.scatter_(3, torch.where(ok, idx, width), True)
        mask = mask | (chosen[..., :width] & (j <= pos[None, :, None, None]))
    mask = mask & present
    # the new token's K/V rows in the pool's [pages * page_size, D] view, per layer, present heads only
    rows = store_page * page_size + (pos % page_size)[None, :, None]  # [L, B, Hkv]
    present_now = store_page >= 0
    if bool(present_now.all()):  # the usual case: every head keeps the new token's page
        store, store_rows = [None] * len(rows), list(rows.flatten(1))
    else:
        store = [ok.flatten().nonzero()[:, 0] for ok in present_now]
        store_rows = [r.flatten()[keep] for r, keep in zip(rows, store)]
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return {"pages": tables.clamp_min(0), "bias": bias.unsqueeze(3), "store_src": store, "store_rows": store_rows}


def paged_decode_attention_masked(q, k_pages, v_pages, pages, bias, sm_scale, sink_logits=None) -> torch.Tensor:
    """q [B, Hq, D] over the gathered pages [B, Hkv, P] of one layer, with the additive mask
    bias [B, Hkv, 1, P * ps] (0 visible, -inf hidden); sink_logits [Hq] or None."""
    B, hq, d = q.shape
    hkv, n = pages.shape[1], pages.numel()
    ps = k_pages.shape[1]
    # index_select on the flat [pages, ps * D] view: one memcpy per page (advanced indexing is ~6x slower)
    idx = pages.reshape(n)
    kk = torch.index_select(k_pages.view(k_pages.shape[0], ps * d), 0, idx).view(B, hkv, -1, d)
    vv = torch.index_select(v_pages.view(v_pages.shape[0], ps * d), 0, idx).view(B, hkv, -1, d)
    # plain matmuls: for one query row they beat SDPA's masked CPU paths, which vary 100x by mask
    scores = torch.matmul(q.view(B, hkv, hq // hkv, d).to(kk.dtype), kk.transpose(2, 3))
    scores = scores.float().mul_(sm_scale).add_(bias)
    if sink_logits is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = softmax_with_sinks(scores, sink_logits.to(scores.device, torch.float32).view(1, hkv, hq // hkv, 1))
    o = torch.matmul(probs.to(vv.dtype), vv)
    return o.reshape(B, hq, d).to(q.dtype)


def paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, window, sink, sm_scale,
                           max_len: int, sink_logits=None) -> torch.Tensor:
    """One query per sequence (decode), every sequence and head at once: gathers each head's
    pages and runs one masked attention. The CPU fast path beside ``segpaged_attention_ref``;
    same rule, no loop over sequences.

    q [B, Hq, D]; block_tables [B, Hkv, >= ceil(max_len / page_size)]; seq_lens [B] (the query
    sits at seq_len - 1); window/sink [Hkv] tensors; max_len >= every seq_len (host int)."""
    lay = decode_layout(block_tables[None], seq_lens, window[None], sink[None], k_pages.shape[1], max_len)
    return paged_decode_attention_masked(q, k_pages, v_pages, lay["pages"][0], lay["bias"][0], sm_scale,
                                         sink_logits)


def softmax_with_sinks(scores: torch.Tensor, sink_logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of scores (-inf: hidden) with one more logit per row in the
    denominator that takes no value (gpt-oss's learned attention sink): exp(s_j) / (sum_k exp(s_k)
    + exp(sink)). sink_logits broadcasts against scores[..., :1]. A row that sees nothing gets
    all zeros (all its mass on the sink)."""
    sink = sink_logits.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
