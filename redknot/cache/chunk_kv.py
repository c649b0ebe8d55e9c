"""A chunk's key and its dense K/V (position-independent chunk reuse).

A chunk (a document, a tool output) is prefilled once on its own, right after a fixed canonical
prefix, and its per-layer K/V is kept under a hash of (model fingerprint, prefix ids, chunk ids);
later requests reuse it at any position after a RoPE relocation. ``ChunkKV`` is that K/V as dense
tensors (what the chunk cache's ``get``/``put`` speak).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

_KEY_DOMAIN = b"redknot-chunk-kv-v1"  # bump when the encoding or the K/V layout changes


@dataclass
class ChunkKV:
    """K/V of one chunk, computed at canonical positions `start .. start + n_tokens - 1`.

    `k`, `v`: `[num_layers, n_tokens, num_kv_heads, head_dim]`; keys already rotated at those
    positions. `fingerprint` is the model fingerprint it was computed under: a store records it so
    that a lookup under another model can never return it.
    """

    token_ids: tuple[int, ...]
    start: int
    k: torch.Tensor
    v: torch.Tensor
    compute_s: float = 0.0
    fingerprint: str | None = None

    def __post_init__(self):
        self.token_ids = tuple(int(t) for t in self.token_ids)
        for name in ("k", "v"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"ChunkKV.{name} must be a torch.Tensor, "
                                 f"got {type(getattr(self, name)).__name__}")
        if self.k.dim() != 4:
            raise ValueError(f"ChunkKV.k must be 4-D [num_layers, n_tokens, num_kv_heads, head_dim]"
                             f", got shape {tuple(self.k.shape)}")
        if self.v.shape != self.k.shape:
            raise ValueError(f"ChunkKV.v shape {tuple(self.v.shape)} does not match "
                             f"ChunkKV.k shape {tuple(self.k.shape)}")
        if len(self.token_ids) != self.k.shape[1]:
            raise ValueError(f"ChunkKV.token_ids has {len(self.token_ids)} ids but k holds "
                             f"{self.k.shape[1]} tokens")
        if self.start < 0:
            raise ValueError(f"ChunkKV.start must be >= 0, got {self.start}")

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return (self.k.nelement() * self.k.element_size()
                + self.v.nelement() * self.v.element_size())

    def to(self, device, non_blocking: bool = False) -> "ChunkKV":
        return dataclasses.replace(self, k=self.k.to(device, non_blocking=non_blocking),
                                   v=self.v.to(device, non_blocking=non_blocking))


def _ids_bytes(ids, name: str) -> bytes:
    """Length-prefixed little-endian int64 encoding, so concatenations cannot collide."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu()
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    return np.int64(arr.size).astype("<i8").tobytes() + arr.astype("<i8").tobytes()


def chunk_key(fingerprint: str, prefix_ids, chunk_ids) -> str:
    """sha256 hex over (fingerprint, canonical prefix ids, chunk ids)."""
    fp = fingerprint.encode("utf-8")
    h = hashlib.sha256(_KEY_DOMAIN)
    h.update(np.int64(len(fp)).astype("<i8").tobytes() + fp)
    h.update(_ids_bytes(prefix_ids, "prefix_ids"))
    h.update(_ids_bytes(chunk_ids, "chunk_ids"))
    return h.hexdigest()
