"""Attention backends: where KV lives and how a layer attends.

The runner calls ``begin(ctx)`` before a forward (allocate, build per-batch metadata once),
each attention layer calls ``attention(layer, q, k, v)``, and the runner calls ``end(ctx)`` after
(e.g. release pages a head can no longer see). q: [T, Hq, D]; k, v: [T, Hkv, D], packed varlen
as described by the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..context import Context, get_context
from ..models.config import ModelConfig


class AttentionBackend:
    name = "base"

    def add_sequence(self, seq_id: int) -> None: ...

    def free_sequence(self, seq_id: int) -> None: ...

    def begin(self, ctx: Context) -> None: ...

    def end(self, ctx: Context) -> None: ...

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kv_bytes(self) -> int:
        """Bytes of KV held right now."""
        return 0

    def import_kv(self, seq_id: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Take a prefill computed elsewhere (the reuse engine): per layer [N, Hkv, D] K/V."""
        raise NotImplementedError


# Query rows per block of the windowed path: bounds its [Hq, rows, keys] mask and scores.
_WINDOW_QUERY_BLOCK = 1024


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None,
                     scale: float) -> torch.Tensor:
    """q [1, Hq, Tq, D] at positions [q_start, q_start + Tq) over k, v [1, Hkv, N, D] (N = q_start + Tq),
    causal and, if ``window``, within the last ``window`` positions. Memory stays O(N): no N x N mask,
    so a chunked prefill of a long prompt runs in fused kernels (flash / memory-efficient on a GPU)."""
    t, n = q.shape[2], k.shape[2]
    if window is None or window >= n:
        if q_start == 0 or t == 1:  # a lone last query sees every key: no mask at all (decode)
            return F.scaled_dot_product_attention(q, k, v, is_causal=q_start == 0 and t > 1, scale=scale,
                                                  enable_gqa=True)
        g = q.shape[1] // k.shape[1]  # the lower-right causal bias has no GQA form: expand K/V heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              attn_mask=causal_lower_right(t, n), scale=scale)
    out = torch.empty_like(q)
    for r0 in range(0, t, _WINDOW_QUERY_BLOCK):  # a block's keys: only those its queries can see
        r1 = min(t, r0 + _WINDOW_QUERY_BLOCK)
        k0 = max(0, q_start + r0 - window + 1)
        qpos = torch.arange(q_start + r0, q_start + r1, device=q.device)[:, None]
        kpos = torch.arange(k0, q_start + r1, device=q.device)[None, :]
        mask = (kpos <= qpos) & (qpos - kpos < window)
        out[:, :, r0:r1] = F.scaled_dot_product_attention(q[:, :, r0:r1], k[:, :, k0:q_start + r1],
                                                          v[:, :, k0:q_start + r1], attn_mask=mask,
                                                          scale=scale, enable_gqa=True)
    return out


class DenseBackend(AttentionBackend):
    """Contiguous per-sequence KV and torch SDPA: the plain dense baseline."""

    name = "dense"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.scale = cfg.head_dim**-0.5
        self.cache: dict[int, torch.Tensor] = {}  # seq_id -> [L, 2, capacity, Hkv, D]
        self.lengths: dict[int, int] = {}  # seq_id -> tokens stored

    def add_sequence(self, seq_id: int) -> None:
        self.cache[seq_id] = self._empty(0)

    def free_sequence(self, seq_id: int) -> None:
        self.cache.pop(seq_id, None)
        self.lengths.pop(seq_id, None)

    def _empty(self, capacity: int) -> torch.Tensor:
        c = self.cfg
        return torch.empty(c.num_hidden_layers, 2, capacity, c.num_key_value_heads, c.head_dim,
                           dtype=self.dtype, device=self.device)

    def begin(self, ctx: Context) -> None:
        for sid, n in zip(ctx.seq_ids, ctx.seq_lens):
            old = self.cache[sid]
            if old.shape[2] < n:  # grow geometrically so decode does not copy every step
                new = self._empty(max(n, 2 * old.shape[2], 64))
                new[:, :, : old.shape[2]] = old
                self.cache[sid] = new

    def attention(self, layer, q, k, v):
        ctx = get_context()
        window = self.cfg.sliding_windows[layer]
        out = torch.empty_like(q)
        start = 0
        for sid, q_len, n in zip(ctx.seq_ids, ctx.q_lens, ctx.seq_lens):
            end = start + q_len
            kv = self.cache[sid][layer]
            kv[0, n - q_len : n] = k[start:end]
            kv[1, n - q_len : n] = v[start:end]
            qb = q[start:end].transpose(0, 1)[None]  # [1, Hq, Tq, D]
            kb, vb = kv[0, :n].transpose(0, 1)[None], kv[1, :n].transpose(0, 1)[None]
            o = causal_attention(qb, kb, vb, n - q_len, window, self.scale)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    def kv_bytes(self) -> int:
        c = self.cfg
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype.itemsize
        return per_token * sum(self.lengths.values())

    def end(self, ctx: Context) -> None:
        self.lengths.update(zip(ctx.seq_ids, ctx.seq_lens))

    def import_kv(self, seq_id, k, v):
        n = k[0].shape[0]
        cache = self._empty(n)
        cache[:, 0], cache[:, 1] = torch.stack(k), torch.stack(v)
        self.cache[seq_id], self.lengths[seq_id] = cache, n
