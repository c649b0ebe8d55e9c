"""Torch references for multi-head latent attention (DeepSeek's MLA) over the page pool.

The pool keeps one row per token and layer: the token's RoPE key part followed by its normed
latent, ``[k_rope | c]`` of width 2w. Its first w elements are the pool's K page row, the other w
its V page row, so a page moves wherever K/V pages move (copy on write, the chunk cache, tiers).

Queries arrive absorbed: per head ``[q_rope | q_nope @ W_UK]``, the width of a row, so a head's
score for a key is its query times the key's row and its output the probability-weighted latents
(the caller multiplies them by W_UV). One latent serves every query head, and each query head has
its own window and sink under the one visibility rule: the heads that see a sequence's whole past
run as one group over all of its rows, the others as a second group over its sink and window rows
only (two groups over one cache). Softmax in fp32.
"""

from __future__ import annotations

import torch

from ..visibility import visible

# Score elements per block ([heads, query rows, keys] fp32): bounds memory at long context.
BLOCK_ELEMS = 2**24


def gather_rows(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, n: int):
    """Rows [n, 2w] (float32) of positions 0..n-1 through one sequence's block table [max_pages]
    (the layer's one latent head), and whether each is stored (bool [n]); absent rows are zero."""
    ps = k_pages.shape[1]
    j = torch.arange(n, device=k_pages.device)
    lp = j // ps
    phys = table.long()[lp.clamp_max(table.shape[0] - 1)]
    present = (phys >= 0) & (lp < table.shape[0])
    idx, slot = phys.clamp_min(0), j % ps
    rows = torch.cat([k_pages[idx, slot], v_pages[idx, slot]], dim=-1).float()
    return torch.where(present[:, None], rows, 0.0), present


def attend_rows(q: torch.Tensor, q_pos: torch.Tensor, rows: torch.Tensor, k_pos: torch.Tensor,
                present: torch.Tensor, window: torch.Tensor, sink: torch.Tensor, sm_scale: float, rope_dim: int,
                block_elems: int = BLOCK_ELEMS) -> torch.Tensor:
    """Absorbed queries q [Q, H, 2w] at positions q_pos over rows [M, 2w] at positions k_pos
    (``present`` bool [M]), each head under its (window, sink) [H]. Returns the latent outputs
    [Q, H, 2w - rope_dim] in float32 (zero for a query that sees nothing)."""
    nq, h, _ = q.shape
    m = rows.shape[0]
    out = torch.zeros(nq, h, rows.shape[1] - rope_dim, dtype=torch.float32, device=q.device)
    if nq == 0 or m == 0:
        return out
    latent = rows[:, rope_dim:]
    w, s = window.long()[:, None, None], sink.long()[:, None, None]
    step = max(1, block_elems // (h * m))
    for r0 in range(0, nq, step):
        p = q_pos[r0:r0 + step].long()[None, :, None]
        mask = visible(p, k_pos[None, None, :], w, s) & present[None, None, :]  # [H, rows, M]
        scores = torch.einsum("qhd,md->hqm", q[r0:r0 + step].float(), rows) * sm_scale
        probs = torch.nan_to_num(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), nan=0.0)
        out[r0:r0 + step] = torch.einsum("hqm,mr->qhr", probs, latent)
    return out


def mla_attention_ref(q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, window, sink, sm_scale: float,
                      rope_dim: int, q_pos=None, block_elems: int = BLOCK_ELEMS) -> torch.Tensor:
    """Latent attention of packed absorbed queries q [total_q, H, 2w] over the pool's rows.

    k_pages/v_pages [num_pages, page_size, w] (the rows' halves); block_tables int32 [B, 1,
    max_pages] (-1: not stored); seq_lens [B] (after this step's rows were stored); window/sink
    [H] per query head; q_pos [total_q]: explicit query positions (default: the last q_len of each
    sequence). Returns the latent outputs [total_q, H, 2w - rope_dim] in q's dtype."""
    total_q, h, _ = q.shape
    out = torch.zeros(total_q, h, 2 * k_pages.shape[2] - rope_dim, dtype=torch.float32, device=q.device)
    window, sink = torch.as_tensor(window, device=q.device), torch.as_tensor(sink, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    win_host = window.tolist()
    for b, n in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        pos = (torch.arange(n - (q1 - q0), n, device=q.device) if q_pos is None else q_pos[q0:q1].long())
        rows, present = gather_rows(k_pages, v_pages, block_tables[b, 0], n)
        k_pos = torch.arange(n, device=q.device)
        full = [i for i, w in enumerate(win_host) if w >= n]  # see every earlier position
        part = [i for i, w in enumerate(win_host) if w < n]
        qb = q[q0:q1]
        if full:
            out[q0:q1, full] = attend_rows(qb[:, full], pos, rows, k_pos, present, window[full], sink[full],
                                           sm_scale, rope_dim, block_elems)
        if part:  # only the rows some head of the group can see: the sink, then the window
            sink_end = min(int(sink[part].max()), n)
            lo = max(int(pos.min()) - max(win_host[i] for i in part) + 1, sink_end, 0)
            keys = torch.cat([k_pos[:sink_end], k_pos[lo:int(pos.max()) + 1]])
            out[q0:q1, part] = attend_rows(qb[:, part], pos, rows[keys], keys, present[keys], window[part],
                                           sink[part], sm_scale, rope_dim, block_elems)
    return out.to(q.dtype)


def mla_decode_masked(q, k_pages, v_pages, pages, bias, sm_scale: float, rope_dim: int) -> torch.Tensor:
    """One absorbed query per sequence q [B, H, 2w] over the gathered pages [B, 1, P] of one layer,
    with the additive mask ``bias`` [B, H, 1, P * page_size] (0 visible, -inf hidden; the layout
    ``reference.decode_layout`` builds). Returns the latent outputs [B, H, 2w - rope_dim]."""
    B, h, _ = q.shape
    ps, w = k_pages.shape[1], k_pages.shape[2]
    idx = pages.reshape(-1)
    kk = torch.index_select(k_pages.view(k_pages.shape[0], ps * w), 0, idx).view(B, -1, w)
    vv = torch.index_select(v_pages.view(v_pages.shape[0], ps * w), 0, idx).view(B, -1, w)
    rows = torch.cat([kk, vv], dim=-1)  # [B, N, 2w]
    scores = torch.matmul(q.to(rows.dtype), rows.transpose(1, 2))  # [B, H, N]
    probs = torch.softmax(scores.float().mul_(sm_scale).add_(bias[:, :, 0]), dim=-1)
    return torch.matmul(probs.to(rows.dtype), rows[..., rope_dim:]).to(q.dtype)
