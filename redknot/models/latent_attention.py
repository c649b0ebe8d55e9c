"""Latent attention over the page pool: what the paged attention backend is for the Llama family,
for DeepSeek's MLA (``models/deepseek.py``).

Each layer stores its new tokens' rows ``[k_rope | latent]`` in the pages of the layer's one
latent head (the pool's K page row holds a row's first half, its V page row the second: the pool's
page copies, chunk cache and tiers move whole rows) and attends over those same pages, every query
head under its own window and sink:

* decode (one query per sequence): absorbed queries over the latent rows, the Triton kernel on a
  GPU (``kernels/mla_decode.py``), the torch reference elsewhere (``kernels/mla_reference.py``,
  which puts the heads that see the whole past and the windowed ones in two groups over one cache);
* prefill chunks and recovery rows on a GPU: the rows of each sequence's pages expanded to every
  head's keys and values (as transformers computes them) into a page-shaped buffer that the
  SegPaged prefill kernel reads with each head's own window and sink: per (query, key) pair that
  is (dn + dr) + dv multiply-adds per head instead of the absorbed form's 2R + dr; on the CPU the
  absorbed reference.

A recovery forward (reused documents) stores its rows at their positions and lets its row plan
observe the cached rows as every query head's keys.
"""

from __future__ import annotations

import torch

from ..kernels import reference
from ..kernels.mla_reference import mla_attention_ref, mla_decode_masked


class LatentRows:
    """The pool's K and V pages read as one [k_rope | latent] row per token: the shape and indexing
    of a pages tensor, for the recovery code that gathers keys (and values) from pages."""

    def __init__(self, k_pages: torch.Tensor, v_pages: torch.Tensor):
        self.k_pages, self.v_pages = k_pages, v_pages

    @property
    def shape(self) -> tuple[int, int, int]:
        n, ps, w = self.k_pages.shape
        return n, ps, 2 * w

    def __getitem__(self, index) -> torch.Tensor:
        return torch.cat([self.k_pages[index], self.v_pages[index]], dim=-1)


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + list(lens), device=device).cumsum(0).to(torch.int32)


class PagedLatentAttention:
    """Store and attend for every MLA layer over one pool (``kernel``: the runner's choice)."""

    def __init__(self, pool, kernel: str, scale: float, rope_dim: int):
        self.pool, self.scale, self.rope_dim = pool, scale, rope_dim
        self.decode_kernel = self.prefill_kernel = None
        if kernel == "triton":
            from ..kernels import segpaged_attention, segpaged_store
            from ..kernels.mla_decode import mla_decode
            self._store, self.decode_kernel, self.prefill_kernel = segpaged_store, mla_decode, segpaged_attention
        else:
            self._store = reference.segpaged_store_ref

    def attention(self, attn, q_nope: torch.Tensor, q_rope: torch.Tensor, new_rows: torch.Tensor, ctx,
                  rows=None) -> torch.Tensor:
        """Layer ``attn`` (an ``MLAttention``): its queries' nope [T, H, dn] and rotated RoPE parts
        [T, H, dr] and the step's rows [T, 2w] -> every head's output [T, H, dv]. ``rows``: a
        recovery forward's row plan."""
        if ctx.capture_rows is not None or ctx.q_record is not None:
            raise ValueError("head selection records per-KV-head queries; latent attention keeps one latent "
                             "for all query heads and has none")
        if rows is not None:
            return self._recovery_rows(attn, q_nope, q_rope, new_rows, ctx, rows)
        layer, pool = attn.layer_idx, self.pool
        bt, w = ctx.block_tables[layer], pool.head_dim
        k, v = new_rows[:, None, :w], new_rows[:, None, w:]
        if ctx.max_q_len == 1 and "decode_layout" in ctx.extras:
            return attn.value_out(self._decode_gathered(layer, attn.absorbed_query(q_nope, q_rope), k, v, ctx))
        self._store(k, v, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t)
        window, sink = ctx.window[layer], ctx.sink[layer]
        if self.decode_kernel is None:
            latent = mla_attention_ref(attn.absorbed_query(q_nope, q_rope), pool.k_pages, pool.v_pages, bt,
                                       ctx.cu_seqlens_q, ctx.seq_lens_t, window, sink, self.scale, self.rope_dim)
            return attn.value_out(latent)
        if ctx.max_q_len == 1:
            return attn.value_out(self.decode_kernel(attn.absorbed_query(q_nope, q_rope), pool.k_pages, pool.v_pages,
                                                     bt, ctx.seq_lens_t, window, sink, self.scale, self.rope_dim))
        return self._extend(attn, q_nope, q_rope, ctx)

    def _extend(self, attn, q_nope, q_rope, ctx):
        """GPU, a batch with prefill chunks: sequences with one new token through the decode kernel
        (expanding their whole context would cost more than it saves), the others expanded."""
        layer, dev = attn.layer_idx, q_nope.device
        bt, window, sink = ctx.block_tables[layer], ctx.window[layer], ctx.sink[layer]
        starts = [0]
        for n in ctx.q_lens:
            starts.append(starts[-1] + n)
        one = [b for b, n in enumerate(ctx.q_lens) if n == 1]
        rest = [b for b, n in enumerate(ctx.q_lens) if n > 1]
        out = q_nope.new_empty(q_nope.shape[0], attn.n_heads, attn.mla.v_head_dim)
        if one:
            r, s = torch.tensor([starts[b] for b in one], device=dev), torch.tensor(one, device=dev)
            latent = self.decode_kernel(attn.absorbed_query(q_nope[r], q_rope[r]), self.pool.k_pages,
                                        self.pool.v_pages, bt[s], ctx.seq_lens_t[s], window, sink, self.scale,
                                        self.rope_dim)
            out[r] = attn.value_out(latent)
        if rest:
            r = torch.cat([torch.arange(starts[b], starts[b + 1], device=dev) for b in rest])
            s = torch.tensor(rest, device=dev)
            pages = self._expanded_pages(attn, bt[s], [ctx.seq_lens[b] for b in rest])
            out[r] = self._attend_expanded(q_nope[r], q_rope[r], pages, _cu([ctx.q_lens[b] for b in rest], dev),
                                           ctx.seq_lens_t[s], window, sink, max(ctx.q_lens), attn.mla.v_head_dim)
        return out

    def _expanded_pages(self, attn, bt: torch.Tensor, lens: list[int]):
        """Every head's keys and values of B sequences' rows (``bt`` [B, 1, P] of the layer's latent
        head, ``lens`` their lengths) in a buffer read as SegPaged pages: (k_pages, v_pages, block
        tables [B, H, P]) with head_dim a power of 2 (keys [nope | rope] and values zero-padded)."""
        pool, dev = self.pool, bt.device
        ps, m, h = pool.page_size, attn.mla, attn.n_heads
        n_pages = [-(-n // ps) for n in lens]
        phys = torch.cat([bt[b, 0, :p] for b, p in enumerate(n_pages)]).long()  # the sequences' pages, in order
        idx = phys.clamp_min(0)
        rows = torch.cat([pool.k_pages[idx], pool.v_pages[idx]], dim=-1).flatten(0, 1)  # [pages * ps, 2w]
        k, v = attn.expanded_kv(rows)
        d = max(16, 1 << (max(m.qk_head_dim, m.v_head_dim) - 1).bit_length())
        total = rows.shape[0]
        kbuf = k.new_zeros(total, h, d)
        vbuf = v.new_zeros(total, h, d)
        kbuf[..., :m.qk_head_dim], vbuf[..., :m.v_head_dim] = k, v
        # page g of head i is rows [g * ps, (g + 1) * ps) of that head: id g * ps * H + i, stride H * d a slot
        view = ((len(phys) - 1) * ps * h + h, ps, d), (d, h * d, 1)
        k_pages, v_pages = kbuf.as_strided(*view), vbuf.as_strided(*view)
        first = torch.tensor([0] + n_pages[:-1], device=dev).cumsum(0)
        width = max(n_pages)
        lp = torch.arange(width, device=dev)
        table = ((first[:, None, None] + lp[None, None, :]) * (ps * h)
                 + torch.arange(h, device=dev)[None, :, None])  # [B, H, width]
        stored = torch.full((len(lens), width), -1, dtype=torch.long, device=dev)
        for b, p in enumerate(n_pages):
            stored[b, :p] = bt[b, 0, :p]
        table = torch.where((stored >= 0)[:, None, :], table, -1).to(torch.int32)  # pages the pool no longer keeps
        return k_pages, v_pages, table

    def _attend_expanded(self, q_nope, q_rope, pages, cu, seq_lens, window, sink, max_q_len: int, v_dim: int,
                         q_pos=None) -> torch.Tensor:
        k_pages, v_pages, table = pages
        t, h, dn = q_nope.shape
        q = q_nope.new_zeros(t, h, k_pages.shape[2])
        q[..., :dn], q[..., dn:dn + q_rope.shape[2]] = q_nope, q_rope
        o = self.prefill_kernel(q, k_pages, v_pages, table, cu, seq_lens, window, sink, self.scale,
                                max_q_len=max_q_len, q_pos=q_pos)
        return o[..., :v_dim]

    def _decode_gathered(self, layer, q, k, v, ctx):
        """CPU decode: the torch backend's per-batch layout (store rows, pages, per-head masks)."""
        lay, pool = ctx.extras["decode_layout"], self.pool
        src, dst = lay["store_src"][layer], lay["store_rows"][layer]
        w = k.shape[-1]
        k, v = k.reshape(-1, w), v.reshape(-1, w)
        if src is not None:
            k, v = k[src], v[src]
        pool.k_pages.view(-1, w).index_copy_(0, dst, k.to(pool.k_pages.dtype))
        pool.v_pages.view(-1, w).index_copy_(0, dst, v.to(pool.v_pages.dtype))
        return mla_decode_masked(q, pool.k_pages, pool.v_pages, lay["pages"][layer], lay["bias"][layer],
                                 self.scale, self.rope_dim)

    def _recovery_rows(self, attn, q_nope, q_rope, new_rows, ctx, rows):
        """Rows at explicit positions, stored over the cached rows they replace; the row plan sees
        the cached rows before the store (their deviation) and every query head's keys after it."""
        layer, pool = attn.layer_idx, self.pool
        bt, w, q_pos = ctx.block_tables[layer], pool.head_dim, ctx.positions
        cached = LatentRows(pool.k_pages, pool.v_pages)
        rows.before_store(layer, new_rows[:, None], bt, cached)
        self._store(new_rows[:, None, :w], new_rows[:, None, w:], pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q,
                    ctx.seq_lens_t, q_pos=q_pos)
        q = attn.absorbed_query(q_nope, q_rope)
        groups = rows.split(layer)
        if groups is None:
            groups = [(None, ctx.window[layer], ctx.sink[layer])]
        pages = self._expanded_pages(attn, bt, list(ctx.seq_lens)) if self.prefill_kernel is not None else None
        o = q_nope.new_zeros(q.shape[0], attn.n_heads, attn.mla.v_head_dim)
        seq = torch.repeat_interleave(torch.arange(len(ctx.q_lens), device=q.device),
                                      torch.tensor(ctx.q_lens, device=q.device))
        for idx, window, sink in groups:
            if idx is None:
                idx, cu = torch.arange(q.shape[0], device=q.device), ctx.cu_seqlens_q
            elif idx.numel() == 0:
                continue
            else:
                counts = torch.bincount(seq[idx], minlength=len(ctx.q_lens))
                cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
            if pages is not None:
                o[idx] = self._attend_expanded(q_nope[idx], q_rope[idx], pages, cu, ctx.seq_lens_t, window, sink,
                                               ctx.max_q_len, attn.mla.v_head_dim, q_pos=q_pos[idx])
            else:
                o[idx] = attn.value_out(mla_attention_ref(q[idx], pool.k_pages, pool.v_pages, bt, cu, ctx.seq_lens_t,
                                                          window, sink, self.scale, self.rope_dim, q_pos=q_pos[idx]))
        # every query head reads the layer's one latent head
        rows.after_attention(layer, q, bt.expand(-1, q.shape[1], -1), cached)
        return o
