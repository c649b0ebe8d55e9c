"""KV correction: the cached K/V of chunk tokens a recovery leaves out, moved by their chunk's mean
offset (recomputed minus cached) over the tokens it did recompute (AgentKVShift's idea).

A reused chunk's K/V lack the context before the chunk; the tokens recomputed at a layer show how
far that context moves them. Per chunk, layer and KV head, the mean of those moves is added to the
chunk's other tokens. Keys carry RoPE at their own positions, so their offsets are averaged with the
rotation taken out (each move rotated back to position 0) and put back at each token's position:
a constant shift of the unrotated keys is then corrected exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [T, H, D], delta positions [T]) -> rotated x


@dataclass(frozen=True)
class KVCorrection:
    """How a recovery corrects the rows it leaves out: ``rotate`` is the model's RoPE relocation;
    ``values`` False moves the keys only (the values keep their cached version); ``scale`` is the
    share of the probes' mean offset added."""

    rotate: Rotate
    values: bool = True
    scale: float = 1.0


def chunk_offsets(new_k: torch.Tensor, old_k: torch.Tensor, new_v: torch.Tensor, old_v: torch.Tensor,
                  pos: torch.Tensor, chunk: torch.Tensor, n_chunks: int, rotate: Rotate):
    """Mean (recomputed - cached) offsets of the probe tokens at positions ``pos`` [P] of chunks
    ``chunk`` [P]: (key offset unrotated, value offset) float32 [C, Hkv, D] and whether a chunk has
    a probe (bool [C])."""
    d_k = rotate(new_k.float() - old_k.float(), -pos)
    d_v = new_v.float() - old_v.float()
    count = torch.zeros(n_chunks, device=pos.device).index_add_(0, chunk, torch.ones_like(chunk, dtype=torch.float32))
    zeros = torch.zeros((n_chunks,) + tuple(d_k.shape[1:]), device=pos.device)
    scale = 1 / count.clamp_min(1)[:, None, None]
    return (zeros.index_add(0, chunk, d_k) * scale, zeros.index_add(0, chunk, d_v) * scale, count > 0)


def corrected(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, chunk: torch.Tensor, offsets, rotate: Rotate,
              values: bool = True, scale: float = 1.0):
    """Cached K/V [T, Hkv, D] of the tokens at ``pos`` [T] (chunks ``chunk`` [T]) plus ``scale`` times
    their chunk's offsets (``chunk_offsets``; the values' only if ``values``); tokens of a chunk
    without a probe are returned as they are."""
    off_k, off_v, has = offsets
    keep = has[chunk][:, None, None]
    k_new = torch.where(keep, k.float() + scale * rotate(off_k[chunk], pos), k.float()).to(k.dtype)
    if not values:
        return k_new, v
    return k_new, torch.where(keep, v.float() + scale * off_v[chunk], v.float()).to(v.dtype)


def correct_layer(new_k: torch.Tensor, new_v: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor,
                  cur: torch.Tensor, probe: torch.Tensor, rest: torch.Tensor, chunk_id: torch.Tensor,
                  read: Callable, correction: KVCorrection):
    """One layer's correction: the recomputed rows ``cur`` [T] (their new and cached K/V), the probe
    rows among them (bool [T]), the positions left out ``rest`` [R], ``chunk_id`` per position;
    ``read(pos)`` gives the cached (K, V) at positions. Returns the corrected (K, V) of ``rest``."""
    n_chunks = int(chunk_id.max()) + 1 if chunk_id.numel() else 0
    p = cur[probe]
    offsets = chunk_offsets(new_k[probe], old_k[probe], new_v[probe], old_v[probe], p, chunk_id[p], max(n_chunks, 1),
                            correction.rotate)
    k_rest, v_rest = read(rest)
    return corrected(k_rest, v_rest, rest, chunk_id[rest], offsets, correction.rotate, correction.values,
                     correction.scale)
