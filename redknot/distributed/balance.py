"""Head-to-rank balancing: which KV heads of each layer go to which tensor-parallel rank.

Ranks hold KV heads in contiguous blocks of ``Hkv / N``. Under a head plan a global head reads
every cached token of a context while a local head reads at most its sink + window, so a layer
whose global heads sit on one rank makes that rank read (and store) more KV than the others, and
every rank waits for it at the layer's all-reduce. Attention heads are independent, so any
permutation of a layer's KV heads (with their query heads, their rows of q/k/v and columns of
o_proj, and the plan's entries) computes the same function: ``balanced_order`` picks one that
spreads each layer's cost evenly, ``imbalance`` reports a plan's per-rank cost under an order.
"""

from __future__ import annotations

import dataclasses

from ..config import HeadConfig


def head_reads(hc: HeadConfig | None, layers: int, kv_heads: int, context: int) -> list[list[int]]:
    """Tokens each (layer, KV head) reads per decode step at ``context`` tokens: every one for a
    global head (and with no plan), at most sink + window for a local one."""
    if hc is None:
        return [[context] * kv_heads for _ in range(layers)]
    out = []
    for row, wins, sinks in zip(hc.effective_classes(), hc.windows, hc.sinks):
        out.append([context if c in ("global", "dense", "retrieval") or w <= 0 else min(context, w + s)
                    for c, w, s in zip(row, wins, sinks)])
    return out


def imbalance(hc: HeadConfig, world: int, order: list[list[int]] | None = None, context: int = 32768,
              bytes_per_token: int = 1) -> dict:
    """Per-rank KV cost of a plan under ``order`` (per layer, the KV heads in rank order; None: the
    checkpoint's). ``reads``: tokens read per decode step, ``bytes``: times ``bytes_per_token`` (K and
    V of one head: 2 x head_dim x dtype bytes), ``global_heads`` per rank, and ``max_over_mean``: the
    slowest rank's reads over the mean (1.0 is balanced); ``layer_max_over_mean``: the same per layer,
    at its worst (what a layer's all-reduce waits on)."""
    layers, heads = hc.num_layers, hc.num_kv_heads
    reads = head_reads(hc, layers, heads, context)
    classes = hc.effective_classes()
    order = order or [list(range(heads)) for _ in range(layers)]
    k = heads // world
    per_rank, glob, worst = [0] * world, [0] * world, 1.0
    for l in range(layers):
        loads = [sum(reads[l][h] for h in order[l][r * k:(r + 1) * k]) for r in range(world)]
        for r in range(world):
            per_rank[r] += loads[r]
            glob[r] += sum(classes[l][h] in ("global", "dense", "retrieval") for h in order[l][r * k:(r + 1) * k])
        mean = sum(loads) / world
        worst = max(worst, max(loads) / mean if mean else 1.0)
    mean = sum(per_rank) / world
    return {"context": context, "reads": per_rank, "bytes": [n * bytes_per_token for n in per_rank],
            "global_heads": glob, "max_over_mean": max(per_rank) / mean if mean else 1.0,
            "layer_max_over_mean": worst}


def balanced_order(hc: HeadConfig | None, world: int, context: int = 32768) -> list[list[int]] | None:
    """Per layer, the KV heads in rank order (rank r holds positions [r*k, (r+1)*k)) such that every
    rank reads about as much: heads by cost, largest first, each to the least-loaded rank with room
    (ties to the lower rank, then the lower head: deterministic on every rank). None without a plan
    (every head costs the same)."""
    if hc is None:
        return None
    reads = head_reads(hc, hc.num_layers, hc.num_kv_heads, context)
    k = hc.num_kv_heads // world
    order = []
    for row in reads:
        ranks: list[list[int]] = [[] for _ in range(world)]
        loads = [0] * world
        for h in sorted(range(len(row)), key=lambda h: (-row[h], h)):
            r = min((r for r in range(world) if len(ranks[r]) < k), key=lambda r: (loads[r], r))
            ranks[r].append(h)
            loads[r] += row[h]
        order.append([h for r in ranks for h in sorted(r)])
    return order


def permute_head_config(hc: HeadConfig, order: list[list[int]]) -> HeadConfig:
    """The plan with each layer's KV heads in ``order`` (what a model with its heads permuted so needs)."""
    pick = lambda rows: [[row[h] for h in o] for row, o in zip(rows, order)]  # noqa: E731
    return dataclasses.replace(hc, classes=pick(hc.classes), windows=pick(hc.windows), sinks=pick(hc.sinks))
