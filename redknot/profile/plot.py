"""Heat map of a head plan: classes and windows, layers x KV heads (PNG, matplotlib Agg)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..config import HEAD_CLASSES, HeadConfig

_COLORS = {"global": "#d62728", "local": "#1f77b4", "retrieval": "#ff7f0e", "dense": "#7f7f7f"}
_ANNOTATE_MAX_CELLS = 1024  # above this, window labels are unreadable anyway


def _tokens(w: int) -> str:
    return f"{w // 1024}K" if w >= 1024 and w % 1024 == 0 else str(w)


def plot_heads(cfg: HeadConfig, path: str | Path, title: str | None = None) -> Path:
    """Left: the class of every head (local/retrieval windows written in the cells). Right: the
    window of the limited heads on a log2 scale (full-context heads blank)."""
    # Figure + Agg canvas directly: no pyplot, so the global backend is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    classes = np.array(cfg.effective_classes())
    n_layers, n_kv = classes.shape
    index = np.vectorize(HEAD_CLASSES.index)(classes)
    limited = (classes == "local") | (classes == "retrieval")
    windows = np.where(limited, np.array(cfg.windows, dtype=float), np.nan)
    log_w = np.log2(np.where(windows > 0, windows, np.nan))

    w_in = min(4 + 0.45 * n_kv, 14)
    h_in = min(1.5 + 0.28 * n_layers, 20)
    fig = Figure(figsize=(2 * w_in, h_in), layout="constrained")
    FigureCanvasAgg(fig)
    ax_c, ax_w = fig.subplots(1, 2)
    ax_c.imshow(index, cmap=ListedColormap([_COLORS[c] for c in HEAD_CLASSES]), vmin=-0.5,
                vmax=len(HEAD_CLASSES) - 0.5, aspect="auto", interpolation="nearest")
    if n_layers * n_kv <= _ANNOTATE_MAX_CELLS:
        for l, h in zip(*np.nonzero(limited)):
            ax_c.text(h, l, _tokens(int(windows[l, h])), ha="center", va="center", fontsize=6, color="white")
    counts = cfg.class_counts()
    ax_c.legend(handles=[Patch(color=_COLORS[c], label=f"{c} ({counts[c]})") for c in HEAD_CLASSES],
                loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    ax_c.set_title("head class (cell: window)", fontsize=9)
    im = ax_w.imshow(log_w, cmap="viridis", aspect="auto", interpolation="nearest")
    finite = log_w[np.isfinite(log_w)]
    if finite.size:
        ticks = range(math.floor(finite.min()), math.ceil(finite.max()) + 1)
        bar = fig.colorbar(im, ax=ax_w, ticks=list(ticks))
        bar.ax.set_yticklabels([_tokens(2**t) for t in ticks], fontsize=7)
        bar.set_label("window (tokens)", fontsize=8)
    ax_w.set_title("local / retrieval window (blank: full context)", fontsize=9)
    for ax in (ax_c, ax_w):
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        if n_kv <= 32:
            ax.set_xticks(range(n_kv))
    fig.suptitle(title or f"{cfg.metadata.get('model', 'head plan')}: {counts['global']} global, {counts['local']} "
                 f"local, {counts['retrieval']} retrieval, {counts['dense']} dense of {counts['total']}", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
