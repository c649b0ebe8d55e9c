"""Attention backends: the one attention layer of every method, over the one page pool.

Each layer stores its new K/V into the pages of each KV head (only the pages the batch's head
plan keeps exist) and attends with the mask-free SegPaged kernel. Everything it needs comes from
the forward batch the runner builds and the model passes down: block tables, lengths and the
plan's windows and sinks; a recovery forward also passes its row plan, and a model with learned
attention sinks (gpt-oss) its per-query-head sink logits. A backend is chosen once
(``attention_backend``): ``TritonAttention`` (the kernels) or ``TorchAttention`` (their torch
reference, with a batched CPU decode path); ``init_batch`` builds its own per-batch metadata.
"""

from __future__ import annotations

import torch

from ..cache import PagePool
from ..forward_batch import ForwardBatch
from ..kernels import reference


def attention_backend(pool: PagePool, scale: float, kernel: str = "auto") -> "PagedAttention":
    """The backend for ``kernel``: "triton", "torch", or "auto" (Triton on CUDA, torch elsewhere)."""
    if kernel == "auto":
        kernel = "triton" if pool.device.type == "cuda" else "torch"
    backends = {"triton": TritonAttention, "torch": TorchAttention}
    if kernel not in backends:
        raise ValueError(f"kernel={kernel!r}: use 'auto', 'triton' or 'torch'")
    return backends[kernel](pool, scale)


class PagedAttention:
    """What every backend shares: the store-then-attend layer, recovery rows, query recording."""

    kernel = ""

    def __init__(self, pool: PagePool, scale: float):
        self.pool, self.scale = pool, scale

    def init_batch(self, batch: ForwardBatch) -> None:
        """Per-batch metadata of this backend, built once before the layer loop (none here)."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardBatch,
                  rows=None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``: a recovery forward's row plan (``engine.recovery_batch.RecoveryRows``);
        ``sink_logits`` [Hq]: the layer's learned sink logit per query head (None: none)."""
        bt = ctx.block_tables[layer]
        pool = self.pool
        if rows is not None:
            return self._recovery_rows(layer, q, k, v, ctx, rows, sink_logits)
        if ctx.capture_rows is not None:
            ctx.captured[layer] = q.index_select(0, ctx.capture_rows)
        if ctx.q_record is not None:
            ctx.q_record[layer, :q.shape[0]].copy_(q)
        if ctx.max_q_len == 1 and "decode_layout" in ctx.extras:
            return self._decode_gathered(layer, q, k, v, ctx, sink_logits)
        self._store(k, v, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t)
        sel = {} if ctx.sel_pos is None else {"sel_pos": ctx.sel_pos[layer], "sel_lens": ctx.sel_lens[layer]}
        return self._attend(q, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t,
                            ctx.window[layer], ctx.sink[layer], self.scale, max_q_len=ctx.max_q_len,
                            sink_logits=sink_logits, **sel)

    def _recovery_rows(self, layer, q, k, v, ctx, rows, sink_logits):
        """A recovery batch: rows at explicit positions, stored over the cached K/V they replace;
        the row plan observes the cached values before the store and the attention after it."""
        pool, bt = self.pool, ctx.block_tables[layer]
        q_pos = ctx.positions
        rows.before_store(layer, v, bt, pool.v_pages, k=k, k_pages=pool.k_pages)
        self._store(k, v, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t, q_pos=q_pos)
        groups = rows.split(layer)
        if groups is None:
            o = self._attend(q, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t,
                             ctx.window[layer], ctx.sink[layer], self.scale, max_q_len=ctx.max_q_len, q_pos=q_pos,
                             sink_logits=sink_logits)
        else:  # queries of one sequence under two visibilities: one call per row group
            o = torch.empty_like(q)
            seq = torch.repeat_interleave(torch.arange(len(ctx.q_lens), device=q.device),
                                          torch.tensor(ctx.q_lens, device=q.device))
            for idx, window, sink in groups:
                if idx.numel() == 0:
                    continue
                counts = torch.bincount(seq[idx], minlength=len(ctx.q_lens))
                cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
                o[idx] = self._attend(q[idx], pool.k_pages, pool.v_pages, bt, cu, ctx.seq_lens_t, window, sink,
                                      self.scale, max_q_len=int(counts.max()), q_pos=q_pos[idx],
                                      sink_logits=sink_logits)
        rows.after_attention(layer, q, bt, pool.k_pages, sink_logits)
        return o

    def store(self, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
              seq_lens: torch.Tensor, q_pos: torch.Tensor | None = None) -> None:
        """Write K/V [T, Hkv, D] of packed rows (row b: the tokens ending at ``seq_lens[b]``, or at
        the positions ``q_pos`` [T] names) into the pages of ``block_tables`` [B, Hkv, pages]; -1
        pages are skipped."""
        self._store(k, v, self.pool.k_pages, self.pool.v_pages, block_tables, cu_seqlens, seq_lens, q_pos)

    def _decode_gathered(self, layer, q, k, v, ctx, sink_logits=None):
        raise NotImplementedError


class TritonAttention(PagedAttention):
    kernel = "triton"

    def __init__(self, pool: PagePool, scale: float):
        super().__init__(pool, scale)
        from ..kernels import segpaged_attention, segpaged_store
        self._store, self._attend = segpaged_store, segpaged_attention


class TorchAttention(PagedAttention):
    """The torch reference kernels; decode on the CPU gathers each head's pages once per step."""

    kernel = "torch"

    def __init__(self, pool: PagePool, scale: float):
        super().__init__(pool, scale)
        self._store, self._attend = reference.segpaged_store_ref, reference.segpaged_attention_ref

    def init_batch(self, batch: ForwardBatch) -> None:
        """A decode batch's store slots and visibility masks for every layer (``reference.decode_layout``),
        so a layer costs a store and one batched attention."""
        if batch.max_q_len == 1 and batch.seq_lens:
            batch.extras["decode_layout"] = reference.decode_layout(
                batch.block_tables, batch.seq_lens_t, batch.window, batch.sink, self.pool.page_size,
                max(batch.seq_lens), sel_pos=batch.sel_pos, sel_lens=batch.sel_lens)

    def _decode_gathered(self, layer, q, k, v, ctx, sink_logits=None):
        lay = ctx.extras["decode_layout"]
        pool = self.pool
        src, dst = lay["store_src"][layer], lay["store_rows"][layer]  # present heads' (row * Hkv + head), pool rows
        d = k.shape[-1]
        k, v = k.reshape(-1, d), v.reshape(-1, d)
        if src is not None:
            k, v = k[src], v[src]
        pool.k_pages.view(-1, d).index_copy_(0, dst, k.to(pool.k_pages.dtype))
        pool.v_pages.view(-1, d).index_copy_(0, dst, v.to(pool.v_pages.dtype))
        return reference.paged_decode_attention_masked(q, pool.k_pages, pool.v_pages, lay["pages"][layer],
                                                       lay["bias"][layer], self.scale, sink_logits)
