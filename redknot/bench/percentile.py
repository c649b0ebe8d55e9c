"""Percentiles of measured times, one definition for every benchmark."""

from __future__ import annotations

import math


def percentile(xs, q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``xs``: the smallest value at or above a
    share ``q`` of them (the 99th of 100 values for q = 0.99, not the largest); NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs), max(1, math.ceil(q * len(xs) - 1e-9))) - 1]
