"""SegPaged attention backend: per-(layer, KV head) pages holding only what each head can see.

Per step: ``begin`` grows every sequence's pages for its new tokens and builds the block tables
once for the batch; each layer stores its new K/V into its pages and runs the mask-free kernel;
``end`` returns the pages local heads can no longer see to the pool.
"""

from __future__ import annotations

import torch

from ..cache import PagePool
from ..config import HeadConfig
from ..context import Context, get_context
from ..kernels import reference
from ..models.config import ModelConfig
from .backends import AttentionBackend

# Default pool size when none is given: this share of free GPU memory, or this many bytes on CPU.
_GPU_MEMORY_FRACTION = 0.5
_CPU_POOL_BYTES = 256 << 20


class SegPagedBackend(AttentionBackend):
    name = "segpaged"

    def __init__(self, cfg: ModelConfig, head_config: HeadConfig, dtype: torch.dtype, device: torch.device,
                 page_size: int = 64, num_pages: int | None = None, kernel: str = "auto"):
        head_config.validate_model(cfg.num_hidden_layers, cfg.num_key_value_heads)
        self.cfg, self.head_config = cfg, head_config
        self.scale = cfg.head_dim**-0.5
        window, sink = head_config.visibility(model_windows=cfg.sliding_windows)
        if num_pages is None:
            page_bytes = 2 * page_size * cfg.head_dim * dtype.itemsize
            budget = (torch.cuda.mem_get_info(device)[0] * _GPU_MEMORY_FRACTION if device.type == "cuda"
                      else _CPU_POOL_BYTES)
            num_pages = max(int(budget // page_bytes), 1)
        self.pool = PagePool(num_pages, page_size, cfg.head_dim, window, sink, dtype=dtype, device=device)
        self.window = torch.as_tensor(window, dtype=torch.int32, device=device)
        self.sink = torch.as_tensor(sink, dtype=torch.int32, device=device)
        if kernel == "auto":
            kernel = "triton" if device.type == "cuda" else "torch"
        if kernel == "triton":
            from ..kernels import segpaged_attention, segpaged_store
            self._store, self._attend = segpaged_store, segpaged_attention
        elif kernel == "torch":
            self._store, self._attend = reference.segpaged_store_ref, reference.segpaged_attention_ref
        else:
            raise ValueError(f"kernel={kernel!r}: use 'auto', 'triton' or 'torch'")
        self.kernel = kernel

    def add_sequence(self, seq_id: int) -> None:
        self.pool.add_sequence(seq_id)

    def free_sequence(self, seq_id: int) -> None:
        if seq_id in self.pool:
            self.pool.free_sequence(seq_id)

    def begin(self, ctx: Context) -> None:
        for sid, n in zip(ctx.seq_ids, ctx.seq_lens):
            self.pool.ensure(sid, n)  # raises PoolExhausted, allocating nothing for that sequence
        ctx.extras["block_tables"] = self.pool.block_tables(ctx.seq_ids)  # [L, B, Hkv, max_pages]

    def attention(self, layer, q, k, v):
        ctx = get_context()
        bt = ctx.extras["block_tables"][layer]
        pool = self.pool
        self._store(k, v, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t)
        return self._attend(q, pool.k_pages, pool.v_pages, bt, ctx.cu_seqlens_q, ctx.seq_lens_t,
                            self.window[layer], self.sink[layer], self.scale, max_q_len=ctx.max_q_len)

    def end(self, ctx: Context) -> None:
        for sid in ctx.seq_ids:
            self.pool.trim(sid)

    def import_kv(self, seq_id, k, v):
        n = k[0].shape[0]
        self.pool.ensure(seq_id, n)
        bt = self.pool.block_tables([seq_id])
        cu = torch.tensor([0, n], dtype=torch.int32, device=self.pool.device)
        lens = cu[1:]
        for layer, (kl, vl) in enumerate(zip(k, v)):
            self._store(kl, vl, self.pool.k_pages, self.pool.v_pages, bt[layer], cu, lens)
        self.pool.trim(seq_id)

    def kv_bytes(self) -> int:
        return (self.pool.num_pages - self.pool.num_free_pages) * self.pool.bytes_per_page
