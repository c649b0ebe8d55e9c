"""Latent attention over the page pool: what the paged attention backend is for the Llama family,
for DeepSeek's MLA (``models/deepseek.py``).

Each layer stores its new tokens' rows ``[k_rope | latent]`` in the pages of the layer's one
latent head (the pool's K page row holds a row's first half, its V page row the second: the pool's
page copies, chunk cache and tiers move whole rows) and attends with absorbed queries, every query
head under its own window and sink, over those same pages: on a GPU a decode step runs the Triton
kernel (``kernels/mla_decode.py``), everything else the torch reference
(``kernels/mla_reference.py``), which puts the heads that see the whole past and the windowed ones
in two groups over one cache. A recovery forward (reused documents) stores its rows at their
positions and lets its row plan observe the cached rows as keys.
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


class PagedLatentAttention:
    """Store and attend for every MLA layer over one pool (``kernel``: the runner's choice)."""

    def __init__(self, pool, kernel: str, scale: float, rope_dim: int):
        self.pool, self.scale, self.rope_dim = pool, scale, rope_dim
        self.decode_kernel = None
        if kernel == "triton":
            from ..kernels import segpaged_store
            from ..kernels.mla_decode import mla_decode
            self._store, self.decode_kernel = segpaged_store, mla_decode
        else:
            self._store = reference.segpaged_store_ref

    def attention(self, layer: int, q: torch.Tensor, new_rows: torch.Tensor, ctx, rows=None) -> torch.Tensor:
        """Absorbed queries q [T, H, 2w] and the step's rows [T, 2w] of layer ``layer`` -> the
        weighted latents [T, H, 2w - rope_dim]. ``rows``: a recovery forward's row plan."""
        if ctx.capture_rows is not None or ctx.q_record is not None:
            raise ValueError("head selection records per-KV-head queries; latent attention keeps one latent "
                             "for all query heads and has none")
        if rows is not None:
            return self._recovery_rows(layer, q, new_rows, ctx, rows)
        pool, bt = self.pool, ctx.block_tables[layer]
        w = pool.head_dim
        k, v = new_rows[:, None, :w], new_rows[:, None, w:]
        if ctx.max_q_len == 1 and "decode_layout" in ctx.extras:
            return self._decode_gathered(layer, q, k, v, ctx)
        self._store(k, v, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t)
        if self.decode_kernel is not None and ctx.max_q_len == 1:
            return self.decode_kernel(q, pool.k_pages, pool.v_pages, bt, ctx.seq_lens_t, ctx.window[layer],
                                      ctx.sink[layer], self.scale, self.rope_dim)
        if self.decode_kernel is not None and 1 in ctx.q_lens:
            return self._extend_with_decodes(layer, q, ctx)
        return mla_attention_ref(q, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t,
                                 ctx.window[layer], ctx.sink[layer], self.scale, self.rope_dim)

    def _extend_with_decodes(self, layer, q, ctx):
        """A prefill chunk batched with decoding sequences: the one-token rows through the decode
        kernel, the others through the reference (which would gather every decoding sequence's
        whole context per layer)."""
        pool, bt = self.pool, ctx.block_tables[layer]
        starts = [0]
        for n in ctx.q_lens:
            starts.append(starts[-1] + n)
        one = [b for b, n in enumerate(ctx.q_lens) if n == 1]
        rest = [b for b, n in enumerate(ctx.q_lens) if n != 1]
        dev = q.device
        out = q.new_empty(q.shape[0], q.shape[1], 2 * pool.head_dim - self.rope_dim)
        rows_one = torch.tensor([starts[b] for b in one], device=dev)
        seqs = torch.tensor(one, device=dev)
        out[rows_one] = self.decode_kernel(q[rows_one], pool.k_pages, pool.v_pages, bt[seqs],
                                           ctx.seq_lens_t[seqs], ctx.window[layer], ctx.sink[layer], self.scale,
                                           self.rope_dim)
        if rest:
            rows_rest = torch.cat([torch.arange(starts[b], starts[b + 1], device=dev) for b in rest])
            seqs = torch.tensor(rest, device=dev)
            cu = torch.tensor([0] + [ctx.q_lens[b] for b in rest], device=dev).cumsum(0).to(torch.int32)
            out[rows_rest] = mla_attention_ref(q[rows_rest], pool.k_pages, pool.v_pages, bt[seqs], cu,
                                               ctx.seq_lens_t[seqs], ctx.window[layer], ctx.sink[layer], self.scale,
                                               self.rope_dim)
        return out

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

    def _recovery_rows(self, layer, q, new_rows, ctx, rows):
        """Rows at explicit positions, stored over the cached rows they replace; the row plan sees
        the cached rows before the store (their deviation) and every query head's keys after it."""
        pool, bt = self.pool, ctx.block_tables[layer]
        w, q_pos = pool.head_dim, ctx.positions
        cached = LatentRows(pool.k_pages, pool.v_pages)
        rows.before_store(layer, new_rows[:, None], bt, cached)
        self._store(new_rows[:, None, :w], new_rows[:, None, w:], pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q,
                    ctx.seq_lens_t, q_pos=q_pos)
        groups = rows.split(layer)
        if groups is None:
            groups = [(None, ctx.window[layer], ctx.sink[layer])]
        o = None
        for idx, window, sink in groups:
            if idx is None:
                o = mla_attention_ref(q, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t, window,
                                      sink, self.scale, self.rope_dim, q_pos=q_pos)
                continue
            if o is None:
                o = q.new_zeros(q.shape[0], q.shape[1], 2 * w - self.rope_dim)
            if idx.numel() == 0:
                continue
            seq = torch.repeat_interleave(torch.arange(len(ctx.q_lens), device=q.device),
                                          torch.tensor(ctx.q_lens, device=q.device))
            counts = torch.bincount(seq[idx], minlength=len(ctx.q_lens))
            cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
            o[idx] = mla_attention_ref(q[idx], pool.k_pages, pool.v_pages, bt, cu, ctx.seq_lens_t, window, sink,
                                       self.scale, self.rope_dim, q_pos=q_pos[idx])
        # every query head reads the layer's one latent head
        rows.after_attention(layer, q, bt.expand(-1, q.shape[1], -1), cached)
        return o
