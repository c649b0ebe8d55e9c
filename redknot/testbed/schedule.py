"""How long a stage runs and at what learning rate: per-stage warmup + cosine, and the stage length
that fits a time budget (``--fit-steps``)."""

from __future__ import annotations

import math


def fit_steps(step: int, steps: int, seconds_left: float, step_s: float, eval_every: int, eval_s: float,
              save_every: int = 0, save_s: float = 0.0) -> int:
    """The stage length (at most ``steps``, at least ``step + 1``) whose remaining steps, and the
    held-out evaluations and periodic saves among them, fit in ``seconds_left``, at ``step_s`` per
    step, ``eval_s`` per evaluation and ``save_s`` per save."""
    per_step = step_s + (eval_s / eval_every if eval_every else 0.0) + (save_s / save_every if save_every else 0.0)
    return max(step + 1, min(steps, step + int(max(0.0, seconds_left) / per_step)))


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Per stage: linear warmup, then cosine down to min_ratio. A pure function of the position, so
    resuming restores the schedule exactly."""
    warmup = min(warmup, max(1, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
