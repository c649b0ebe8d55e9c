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
    # qrecompute: the share of chunk tokens recomputed through every layer, chosen by the attention the
    # question's last ``observation_tokens`` give them at ``qrecompute_layer`` (every token runs up to it)
    qrecompute_ratio: float = 0.3
    qrecompute_layer: int = 2  # first-token KL on 4 HotpotQA records (SmolLM2): layer 2 best per FLOP
    qrecompute_start_tokens: int = 16  # each chunk's first tokens rank first among the recomputed ones
    # A question pass ranks the rows instead (qrecompute, redknot): the whole question runs alone over the
    # placed K/V first, and its attention summed over the layers from ``question_pass_from`` on ranks the
    # chunk tokens. qrecompute's chosen rows then run from layer 0; redknot's through its sparse FFN.
    question_pass: bool = False
    question_pass_from: int = 0
    # KV correction: a token left out adds its chunk's mean (recomputed - cached) K/V offset per layer
    # and KV head, measured on the recomputed tokens of that chunk (qrecompute, cacheblend, redknot; off by default)
    kv_correction: bool = False
    kv_correction_values: bool = True  # False: the keys move, the values keep their cached version
    # The share of the mean offset added. The probes are the tokens a method chose to recompute, the
    # ones whose K/V move most, so their mean overstates how far the others move: < 1 shrinks it.
    kv_correction_scale: float = 1.0
    # Each chunk cached behind this many shared dummy tokens (the model's BOS) after the prefix, their
    # K/V dropped at reuse (EPIC's LegoLink-0): the chunk's own first tokens are not its attention
    # sinks. 0: cached right after the prefix (the first chunk's cache is then exact).
    dummy_prefix_tokens: int = 0
    # hybrid models: a linear-attention head whose decay over a placed chunk, exp(sum of its log
    # decays), is at most this starts from the chunk's own state (the incoming state, then at most
    # this share of its norm, dropped: no work); the others apply the chunk's transition (exact).
    # 0: every head exact; 1: every head drops. 1e-6 is below float32's rounding of the state.
    linear_decay_threshold: float = 1e-6

    def __post_init__(self):
        if self.shallow_window is not None and self.shallow_window < 1:
            raise ValueError(f"ReuseOptions.shallow_window={self.shallow_window!r}: use a window >= 1 or None")
        if not 0 < self.kv_correction_scale <= 1:
            raise ValueError(f"ReuseOptions.kv_correction_scale={self.kv_correction_scale!r}: use a share in (0, 1]")
        if self.question_pass_from < 0:
            raise ValueError(f"ReuseOptions.question_pass_from={self.question_pass_from!r}: use a layer >= 0")
        if self.qrecompute_layer < 0:
            raise ValueError(f"ReuseOptions.qrecompute_layer={self.qrecompute_layer!r}: use a layer >= 0")
        if not 0 <= self.qrecompute_ratio <= 1:
            raise ValueError(f"ReuseOptions.qrecompute_ratio={self.qrecompute_ratio!r}: use a share in [0, 1]")
        if self.dummy_prefix_tokens < 0:
            raise ValueError(f"ReuseOptions.dummy_prefix_tokens={self.dummy_prefix_tokens!r}: use a count >= 0")
        if not 0 <= self.linear_decay_threshold <= 1:
            raise ValueError(f"ReuseOptions.linear_decay_threshold={self.linear_decay_threshold!r}: use a decay "
                             f"in [0, 1]")
        if self.cacheblend_check_layer < 0:
            raise ValueError(f"ReuseOptions.cacheblend_check_layer={self.cacheblend_check_layer!r}: use a layer >= 0")

