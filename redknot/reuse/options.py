"""Knobs of the reuse methods' policies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReuseOptions:
    epic_tokens: int = 16
    cacheblend_ratio: float = 0.15
    # The layer whose value deviation ranks CacheBlend's rows (LMCache's blend_check_layers). Not 0:
    # layer 0's values depend on the token alone, so cached and recomputed ones agree to rounding there.
    cacheblend_check_layer: int = 1
    observation_tokens: int = 16  # suffix tail whose attention mass ranks tokens for the sparse FFN
    shallow_window: int | None = None  # local-recovery window of global heads; None: widest local window

    def __post_init__(self):
        if self.shallow_window is not None and self.shallow_window < 1:
            raise ValueError(f"ReuseOptions.shallow_window={self.shallow_window!r}: use a window >= 1 or None")
        if self.cacheblend_check_layer < 0:
            raise ValueError(f"ReuseOptions.cacheblend_check_layer={self.cacheblend_check_layer!r}: use a layer >= 0")

