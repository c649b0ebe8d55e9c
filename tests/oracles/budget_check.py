"""The reference form of a decode budget check: one request, layer by layer over every position.

``HeadSelection._check`` runs a step's checks stacked over requests and heads; tests compare it with
this. A budgeted head's page mass grows by what the check's query gives every key it sees in decode
(its sink, window and current selection); its set becomes the pages ranked highest within its
budget; retrieval heads keep the set chosen at prefill.
"""

from __future__ import annotations

import numpy as np
import torch

from redknot import visibility
from redknot.cache import selection as sel_ops
from redknot.engine.selective import _grown


@torch.inference_mode()
def reference_check(sel, seq, d, q_rows: list, n: int) -> None:
    """Check ``seq`` (length n) with its queries ``q_rows`` (per layer [1, Hq, D], position n-1)."""
    table = sel.pool.table(seq.seq_id)  # [L, H, P]
    P = table.shape[2]
    prev = sel.pool.selection(seq.seq_id)
    sel.checks += 1
    acc = seq.page_mass if seq.page_mass is not None else torch.zeros(*d.mode.shape, P, device=sel.device)
    acc = _grown(acc, P)
    sets: dict[tuple[int, int], np.ndarray] = {}
    for l in d.layers:
        heads = np.nonzero(d.mode[l])[0]

        def decode_view(q_pos, l=l, heads=heads):  # what each head sees in decode
            return decode_visible(prev[l, heads], d.window[l, heads], d.sink[l, heads], q_pos, n)

        heads, hs, tbl, mass = sel.layer_mass(d, l, table, q_rows[l], n, decode_view)
        acc[l, hs, :P] += sel_ops.page_mass(mass, sel.pool.page_size)[:, :P]
        sel.budget_sets(d, l, heads, hs, tbl, acc, n, sets)
        for r in np.nonzero(d.mode[l, heads] == 1)[0]:
            row = prev[l, heads[r]]
            sets[(l, int(heads[r]))] = row[row >= 0]
    sel._write_sets(seq, d, sets, acc)


def decode_visible(sel: np.ndarray, window, sink, q_pos: torch.Tensor, n: int) -> torch.Tensor:
    """bool [R, M, n]: the decode visibility of R heads (sink, window, selected set)."""
    dev = q_pos.device
    j = torch.arange(n, device=dev)
    w = torch.as_tensor(window, device=dev)[:, None, None]
    sk = torch.as_tensor(sink, device=dev)[:, None, None]
    vis = visibility.visible(q_pos[None, :, None], j, w, sk)
    chosen = torch.zeros(sel.shape[0], n + 1, dtype=torch.bool, device=dev)
    idx = torch.from_numpy(np.where((sel >= 0) & (sel < n), sel, n).astype(np.int64)).to(dev)
    chosen.scatter_(1, idx, True)
    return vis | (chosen[:, None, :n] & (j <= q_pos[:, None]))
