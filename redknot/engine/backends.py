"""Attention backends: where KV lives and how a layer attends.

The runner calls ``begin(ctx)`` before a forward (allocate, build per-batch metadata once),
each attention layer calls ``attention(layer, q, k, v)``, and the runner calls ``end(ctx)`` after
(e.g. release pages a head can no longer see). q: [T, Hq, D]; k, v: [T, Hkv, D], packed varlen
as described by the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
            if q_len == n and window is None:
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                qpos = torch.arange(n - q_len, n, device=q.device)[:, None]
                kpos = torch.arange(n, device=q.device)[None, :]
                mask = kpos <= qpos
                if window is not None:
                    mask &= qpos - kpos < window
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=self.scale, enable_gqa=True)
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
