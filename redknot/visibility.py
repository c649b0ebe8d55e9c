"""The visibility rule and what follows from it: which keys a query sees, which pages a head keeps,
how many bytes a head holds.

Every (layer, KV head) has a window W and a sink S (a global head has W >= ``GLOBAL_WINDOW``, so
its window covers every position); a retrieval head may add an explicit selection ``sel``. A query
at position p of that head sees key j iff

    j <= p and (j < S or p - j < W or j in sel)

Storage, kernels, references, recovery, the profiler, the FLOPs count and the benchmarks derive
what they keep, read or count from the functions here, so they cannot drift apart. The Triton
kernels evaluate the same rule on device (``redknot/kernels/segpaged.py``); their tests compare
them with these functions.

From the rule, per head and sequence of length n (the next query at p = n): a logical page lp of
``page_size`` positions is still needed iff it holds a sink position (lp * page_size < S) or a
position some query at p >= n sees, i.e. its last position (lp + 1) * page_size - 1 >= n - W + 1.
Later queries see less, so a page that is no longer needed never is again; the pool releases
such pages (``PagePool.trim``), and ``kept_page_mask`` / ``kept_pages`` say which and how many
remain.
"""

from __future__ import annotations

import numpy as np
import torch

# A window wider than any position: the head sees everything before it (a global head).
GLOBAL_WINDOW = 2**30


def visible(p, j, window, sink):
    """The rule without a selection, elementwise and broadcasting (tensors or ints): does a query
    at p see key j under (window, sink)?"""
    return (j <= p) & ((j < sink) | (p - j < window))


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sink: int,
                    sel: torch.Tensor | None = None) -> torch.Tensor:
    """bool [len(q_pos), len(k_pos)]: query at p sees key j iff
    j <= p and (j < sink or p - j < window or j in sel); ``sel`` entries < 0 are padding."""
    p = q_pos[:, None].long()
    j = k_pos[None, :].long()
    seen = visible(p, j, window, sink)
    if sel is not None:
        sel = sel[sel >= 0].long()
        seen = seen | ((j <= p) & torch.isin(k_pos.long(), sel)[None, :])
    return seen


def visible_pairs(q_pos: torch.Tensor, window: torch.Tensor, sink: torch.Tensor, group: int) -> int:
    """Sum over queries and query heads (``group`` per KV head) of the keys each sees: the rule
    counted in closed form, min(p + 1, W) recent keys plus the sink keys before the window."""
    return int(visible_pairs_per_kv_head(q_pos, window, sink)) * group


def visible_pairs_per_kv_head(q_pos: torch.Tensor, window: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``visible_pairs`` over KV heads, as a 0-d tensor on ``q_pos``'s device (no host sync)."""
    return keys_seen(q_pos.long()[:, None], window, sink).sum()


def visible_pairs_batched(q_pos: torch.Tensor, lens: torch.Tensor, window: torch.Tensor,
                          sink: torch.Tensor) -> torch.Tensor:
    """``visible_pairs_per_kv_head`` of R query sets at once: row r's queries are the first
    ``lens[r]`` positions of q_pos [R, T]. int64 [R] on the device (no host sync)."""
    valid = torch.arange(q_pos.shape[-1], device=q_pos.device) < lens[:, None]
    return (keys_seen(q_pos.long()[..., None], window, sink) * valid[..., None]).sum(dim=(-1, -2))


def keys_seen(p: torch.Tensor, window: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Keys each query at p [..., 1] sees per KV head [..., Hkv] (``window``/``sink`` [Hkv]):
    min(p + 1, W) recent keys plus the sink keys before the window."""
    n = p + 1  # keys at or before p
    w, s = window.long().to(p.device), sink.long().to(p.device)
    return torch.minimum(n, w) + torch.minimum(s, n - w).clamp_min(0)


def visible_keys(window, sink, context: int):
    """Keys one query at the end of a ``context``-token sequence sees, per head (int64 tensor of the
    shape of ``window``): every key for a head whose window covers the context, else its window
    plus its sink, capped at the context."""
    w = torch.as_tensor(window, dtype=torch.int64).clamp(max=context)
    s = torch.as_tensor(sink, dtype=torch.int64).clamp(max=context)
    return torch.where(w >= min(context, GLOBAL_WINDOW), context, torch.clamp(w + s, max=context))


def _cdiv(a, b):
    return -(-a // b)


def _as_int(x):
    """int64 array of ``x``, kept a tensor (on its device) when it is one, so the rule's page
    arithmetic runs on the host for the pool and on the device for the selection code."""
    return x.long() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.int64)


def _nonneg(x):
    return x.clamp_min(0) if isinstance(x, torch.Tensor) else np.maximum(0, x)


def _arange(count: int, like):
    return torch.arange(count, device=like.device) if isinstance(like, torch.Tensor) else np.arange(count)


def dead_pages_end(n: int, window, page_size: int):
    """Per head: logical pages lp < this (and past the sink pages) hold no position a query at
    p >= n sees: lp is dead iff (lp + 1) * page_size - 1 < n - W + 1, i.e. lp < floor((n - W + 1) / ps).
    Numpy in, numpy out; a tensor in, a tensor out on its device."""
    return _nonneg((n - _as_int(window) + 1) // page_size)


def kept_page_mask(n: int, window, sink, page_size: int, pages: int | None = None):
    """bool [..., pages]: the logical pages each head (``window``/``sink`` of any shape, e.g.
    [L, Hkv]) still needs once a sequence of ``n`` tokens is trimmed for its next query at p = n.
    ``pages`` defaults to ceil(n / page_size); pages past n count as kept (nothing to release yet).
    Global heads keep every page. Numpy in, numpy out; tensors in, a tensor out."""
    window, sink = _as_int(window), _as_int(sink)
    lp = _arange(_cdiv(n, page_size) if pages is None else pages, window)
    dead = (lp >= _cdiv(sink, page_size)[..., None]) & (lp < dead_pages_end(n, window, page_size)[..., None])
    return ~dead


def kept_pages(n: int, window, sink, page_size: int):
    """Pages each head holds for a trimmed sequence of ``n`` tokens (``kept_page_mask`` counted)."""
    window, sink = _as_int(window), _as_int(sink)
    return _cdiv(n, page_size) - _nonneg(dead_pages_end(n, window, page_size) - _cdiv(sink, page_size))


def bytes_per_page(page_size: int, head_dim: int, element_size: int) -> int:
    """Device bytes of one head's page, K and V together."""
    return 2 * page_size * head_dim * element_size


def bytes_per_head(n: int, window, sink, page_size: int, head_dim: int, element_size: int) -> np.ndarray:
    """KV bytes each head holds for a trimmed sequence of ``n`` tokens."""
    return kept_pages(n, window, sink, page_size) * bytes_per_page(page_size, head_dim, element_size)
