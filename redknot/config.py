"""Head plan: the class, window and sink of every (layer, KV head), with upstream-JSON I/O.

:meth:`HeadConfig.visibility` turns the plan into the (window, sink) arrays that storage, the
kernels, recovery and capacity accounting use; what a (window, sink) lets a query see is
``redknot.visibility``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .visibility import GLOBAL_WINDOW  # noqa: F401  (a window wider than any position; defined with the rule)

SCHEMA_VERSION = 1
HEAD_CLASSES = ("global", "local", "retrieval", "dense")
# Names older upstream files use for what we call local (sink + recent window).
LEGACY_LOCAL = ("local_full", "limited", "streaming", "sink_dominant")
DEFAULT_SINK = 4

_KNOWN_KEYS = {"schema_version", "kv_head_classification", "kv_head_max_distance", "kv_head_sink_size",
               "retrieval_top_p", "dense_prefix_layers", "num_layers", "num_kv_heads"}


class HeadConfigError(ValueError):
    """A head config that is malformed or does not fit the model."""


@dataclass
class HeadConfig:
    classes: list[list[str]]  # [layers][kv_heads], one of HEAD_CLASSES
    windows: list[list[int]]  # recent window W per head; -1 = unlimited
    sinks: list[list[int]]  # sink size S per head
    retrieval_top_p: float = 0.9
    dense_prefix_layers: int = 0
    metadata: dict = field(default_factory=dict)  # model name, rationale, profiling stats …

    def __post_init__(self):
        self._check_shapes()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def all_global(cls, num_layers: int, num_kv_heads: int) -> "HeadConfig":
        return cls([["global"] * num_kv_heads for _ in range(num_layers)],
                   [[-1] * num_kv_heads for _ in range(num_layers)],
                   [[0] * num_kv_heads for _ in range(num_layers)])

    @classmethod
    def synthetic(cls, num_layers: int, num_kv_heads: int, global_ratio: float, window: int,
                  sink: int = DEFAULT_SINK, seed: int = 0) -> "HeadConfig":
        """Round(global_ratio * heads) global heads per layer at seeded positions, the rest local."""
        rng = random.Random(seed)
        n_global = round(global_ratio * num_kv_heads)
        mask = []
        for _ in range(num_layers):
            glob = set(rng.sample(range(num_kv_heads), n_global))
            mask.append([h in glob for h in range(num_kv_heads)])
        return cls.from_global_mask(mask, window, sink, {"method": f"synthetic g={global_ratio} W={window} seed={seed}"})

    @classmethod
    def from_global_mask(cls, is_global, window: int | list[list[int]], sink: int = DEFAULT_SINK,
                         metadata: dict | None = None) -> "HeadConfig":
        """Global where ``is_global[l][h]``, local elsewhere with ``window`` (one value, or per head)."""
        rows = [[bool(g) for g in row] for row in is_global]
        per_head = window if isinstance(window, list) else [[window] * len(row) for row in rows]
        return cls([["global" if g else "local" for g in row] for row in rows],
                   [[-1 if g else int(w) for g, w in zip(row, wrow)] for row, wrow in zip(rows, per_head)],
                   [[sink] * len(row) for row in rows], metadata=dict(metadata or {}))

    @classmethod
    def pattern(cls, name: str, num_layers: int, num_kv_heads: int, global_ratio: float, window: int,
                sink: int = DEFAULT_SINK, seed: int = 0) -> "HeadConfig":
        """Baseline head plans with round(global_ratio x all heads) global heads:

        ``random``: chosen uniformly among all (layer, head) pairs (seeded); ``first-layers``: the
        first heads in layer order (whole early layers global, the upstream Mistral pattern);
        ``per-layer``: the same number in every layer at seeded positions (``synthetic``)."""
        if name == "per-layer":
            return cls.synthetic(num_layers, num_kv_heads, global_ratio, window, sink, seed)
        total = num_layers * num_kv_heads
        n = round(global_ratio * total)
        if name == "random":
            chosen = set(random.Random(seed).sample(range(total), n))
        elif name == "first-layers":
            chosen = set(range(n))
        else:
            raise ValueError(f"head pattern {name!r}: use random, first-layers or per-layer")
        mask = [[l * num_kv_heads + h in chosen for h in range(num_kv_heads)] for l in range(num_layers)]
        return cls.from_global_mask(mask, window, sink, {"method": f"pattern {name} g={global_ratio} W={window}"
                                                                   + (f" seed={seed}" if name == "random" else "")})

    def with_local_windows(self, window: int | None = None) -> "HeadConfig":
        """The same full-context heads (global, dense, and retrieval, which see everything when no
        selection is given); every other head local, with ``window`` or its own."""
        full = [[c in ("global", "dense", "retrieval") for c in row] for row in self.effective_classes()]
        own = self.windows
        if window is None and any(w <= 0 for row, frow in zip(own, full) for w, f in zip(row, frow) if not f):
            raise HeadConfigError("a head that becomes local has no window of its own: pass a window")
        return HeadConfig.from_global_mask(full, own if window is None else window, DEFAULT_SINK, {
            **{k: v for k, v in self.metadata.items() if k != "profiling"},
            "derived": f"global heads of {self.metadata.get('method', 'a head config')}; other heads local"
                       + (f" with W={window}" if window is not None else " with their own windows")})

    @classmethod
    def from_json(cls, path: str | Path) -> "HeadConfig":
        return cls.from_dict(_read_json(path, "head config"), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "head config") -> "HeadConfig":
        if not isinstance(raw, dict):
            raise HeadConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if "kv_head_classification" not in raw:
            raise HeadConfigError(f"{source}: missing field kv_head_classification")
        cls_rows = _matrix(raw["kv_head_classification"], "kv_head_classification", source, str)
        n_layers, n_heads = len(cls_rows), len(cls_rows[0])
        classes = [[_class_name(c, f"{source}: kv_head_classification[{l}][{h}]") for h, c in enumerate(row)]
                   for l, row in enumerate(cls_rows)]
        default_window = raw.get("window", -1)
        windows = _matrix_or_fill(raw.get("kv_head_max_distance"), "kv_head_max_distance", source,
                                  n_layers, n_heads, default_window)
        sink_field = raw.get("kv_head_sink_size")
        if isinstance(sink_field, int):  # a single size for every head
            sink_field = None
            default_sink = raw["kv_head_sink_size"]
        else:
            default_sink = raw.get("sink_size", DEFAULT_SINK)
        sinks = _matrix_or_fill(sink_field, "kv_head_sink_size", source, n_layers, n_heads, default_sink)
        for key, expect in (("num_layers", n_layers), ("num_kv_heads", n_heads)):
            if key in raw and raw[key] != expect:
                raise HeadConfigError(f"{source}: {key}={raw[key]} but kv_head_classification is {n_layers}x{n_heads}")
        top_p = raw.get("retrieval_top_p", 0.9)
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise HeadConfigError(f"{source}: retrieval_top_p={top_p!r} must be in (0, 1]")
        dense_prefix = raw.get("dense_prefix_layers", 0)
        if not isinstance(dense_prefix, int) or not 0 <= dense_prefix <= n_layers:
            raise HeadConfigError(f"{source}: dense_prefix_layers={dense_prefix!r} must be an integer in [0, {n_layers}]")
        metadata = {k: v for k, v in raw.items() if k not in _KNOWN_KEYS}
        try:
            return cls(classes, windows, sinks, float(top_p), dense_prefix, metadata)
        except HeadConfigError as e:
            raise HeadConfigError(f"{source}: {e}") from None

    # ---- output -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {k: v for k, v in self.metadata.items() if k not in ("summary",)}
        out.update(
            schema_version=SCHEMA_VERSION,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            kv_head_classification=self.classes,
            kv_head_max_distance=self.windows,
            kv_head_sink_size=self.sinks,
            retrieval_top_p=self.retrieval_top_p,
            dense_prefix_layers=self.dense_prefix_layers,
            summary=self.class_counts(),
        )
        return out

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.classes)

    @property
    def num_kv_heads(self) -> int:
        return len(self.classes[0])

    def effective_classes(self) -> list[list[str]]:
        """Classes after dense_prefix_layers forces the first layers to dense."""
        return [["dense"] * self.num_kv_heads if l < self.dense_prefix_layers else list(row)
                for l, row in enumerate(self.classes)]

    def class_counts(self) -> dict:
        flat = [c for row in self.effective_classes() for c in row]
        counts = {c: flat.count(c) for c in HEAD_CLASSES}
        counts["total"] = len(flat)
        return counts

    def validate_model(self, num_layers: int, num_kv_heads: int) -> "HeadConfig":
        """Raise a one-line error if this plan does not fit a model of that shape."""
        if self.num_layers != num_layers:
            raise HeadConfigError(
                f"head config has {self.num_layers} layers but the model has {num_layers} (num_hidden_layers)")
        if self.num_kv_heads != num_kv_heads:
            raise HeadConfigError(
                f"head config has {self.num_kv_heads} KV heads per layer but the model has {num_kv_heads} "
                f"(num_key_value_heads)")
        return self

    def visibility(self, model_windows: list[int | None] | None = None,
                   selection: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per (layer, KV head) window W and sink S for the kernels: int64 arrays [L, Hkv].

        Global and dense heads get GLOBAL_WINDOW and sink 0. Retrieval heads see everything unless
        the caller supplies selected sets (``selection=True``), then sink + window + selection.
        ``model_windows`` is the architecture's own per-layer sliding window, which caps every head.
        """
        classes = np.array(self.effective_classes())
        window = np.array(self.windows, dtype=np.int64)
        sink = np.array(self.sinks, dtype=np.int64)
        limited = (classes == "local") | ((classes == "retrieval") & selection)
        window = np.where(limited & (window > 0), window, GLOBAL_WINDOW)
        sink = np.where(limited, sink, 0)
        if model_windows is not None:
            cap = np.array([w if w else GLOBAL_WINDOW for w in model_windows], dtype=np.int64)[:, None]
            sink = np.where(window > cap, 0, sink)  # a native sliding window has no sink
            window = np.minimum(window, cap)
        return window, sink

    # ---- checks -------------------------------------------------------------------------------
    def _check_shapes(self) -> None:
        if not self.classes or not self.classes[0]:
            raise HeadConfigError("kv_head_classification is empty")
        n_layers, n_heads = len(self.classes), len(self.classes[0])
        for name, m in (("kv_head_classification", self.classes), ("kv_head_max_distance", self.windows),
                        ("kv_head_sink_size", self.sinks)):
            if len(m) != n_layers or any(len(row) != n_heads for row in m):
                raise HeadConfigError(f"{name} must be {n_layers}x{n_heads} like kv_head_classification")
        for l, row in enumerate(self.classes):
            for h, c in enumerate(row):
                if c not in HEAD_CLASSES:
                    raise HeadConfigError(f"kv_head_classification[{l}][{h}] = {c!r} is not one of {HEAD_CLASSES}")
                if c == "local" and self.windows[l][h] <= 0:
                    raise HeadConfigError(
                        f"kv_head_max_distance[{l}][{h}] = {self.windows[l][h]} but a local head needs a window > 0")
                if self.sinks[l][h] < 0:
                    raise HeadConfigError(f"kv_head_sink_size[{l}][{h}] = {self.sinks[l][h]} must be >= 0")


def _read_json(path: str | Path, what: str):
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HeadConfigError(f"{path}: no such {what} file") from None
    except json.JSONDecodeError as e:
        raise HeadConfigError(f"{path}: malformed JSON ({e})") from None


def _class_name(c, where: str) -> str:
    if not isinstance(c, str):
        raise HeadConfigError(f"{where} = {c!r} is not a class name")
    c = c.strip().lower()
    if c in LEGACY_LOCAL:
        return "local"
    if c not in HEAD_CLASSES:
        raise HeadConfigError(
            f"{where} = {c!r} is not a head class (use {', '.join(HEAD_CLASSES)}; legacy {', '.join(LEGACY_LOCAL)} = local)")
    return c


def _matrix(value, name: str, source: str, kind) -> list[list]:
    if (not isinstance(value, list) or not value or not all(isinstance(r, list) and r for r in value)):
        raise HeadConfigError(f"{source}: {name} must be a non-empty list of non-empty lists (layers x KV heads)")
    width = len(value[0])
    for l, row in enumerate(value):
        if len(row) != width:
            raise HeadConfigError(f"{source}: {name}[{l}] has {len(row)} heads, layer 0 has {width}")
        for h, v in enumerate(row):
            if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise HeadConfigError(f"{source}: {name}[{l}][{h}] = {v!r} is not an integer")
    return value


def _matrix_or_fill(value, name: str, source: str, n_layers: int, n_heads: int, fill) -> list[list[int]]:
    if value is None:
        if isinstance(fill, bool) or not isinstance(fill, int):
            raise HeadConfigError(f"{source}: default for {name} is {fill!r}, not an integer")
        return [[fill] * n_heads for _ in range(n_layers)]
    m = _matrix(value, name, source, int)
    if len(m) != n_layers or len(m[0]) != n_heads:
        raise HeadConfigError(
            f"{source}: {name} is {len(m)}x{len(m[0])} but kv_head_classification is {n_layers}x{n_heads}")
    return [list(r) for r in m]


@dataclass
class SparseFFNConfig:
    """Tiered sparse-FFN thresholds of the redknot recovery (upstream ``sparse_ffn_params`` JSON).

    Layers < dense_until run the FFN on every token; layers in [dense_until, deep_layer_start)
    keep the tokens covering 1 - mass_thresh of the observation window's attention mass, deeper
    layers 1 - mass_thresh_deep. The last recent_n tokens and at least min_keep tokens always
    go through the FFN.

    ``keep_fraction`` replaces the mass tiers by a count: each sparse layer keeps that share of the
    chunk tokens computed at the first sparse layer (so ``redknot`` picks its set there once).
    ``importance`` ranks them: "attention" (the mass the suffix's last tokens give them), "cross"
    (the attention mass a token's own query
    gives to keys of *other* chunks, in the layer's full-context heads: the context its cached
    state never saw), "chunk" ("cross" averaged over each chunk: whole chunks are kept or left
    out first, rows within the chunk on the boundary by their own "cross"; measured in
    docs/results/quality_testbed.md) or "deviation" (how far the row's recomputed values at that
    layer are from its cached ones: CacheBlend's signal, read where the dense layers left it;
    keep_fraction only).

    ``chunk_start_tokens``: each chunk's first N tokens always go through the FFN (under
    ``keep_fraction`` they take the first places of its count). A chunk encoded alone gave its
    first tokens the attention a sequence start gets, so their cached states are the furthest
    from what the full context gives them (EPIC's observation).
    """

    dense_until: int = 4
    mass_thresh: float = 0.2
    deep_layer_start: int = 20
    mass_thresh_deep: float = 0.05
    recent_n: int = 128
    min_keep: int = 16
    importance: str = "attention"  # or "cross" (mass to other chunks), "chunk" (the same, per chunk), "deviation"
    keep_fraction: float | None = None  # a fixed share of chunk tokens instead of the mass tiers
    chunk_start_tokens: int = 0  # each chunk's first N tokens always kept

    def __post_init__(self):
        for name in ("dense_until", "deep_layer_start", "recent_n", "min_keep", "chunk_start_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise HeadConfigError(f"sparse FFN: {name}={v!r} must be an integer >= 0")
        for name in ("mass_thresh", "mass_thresh_deep"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise HeadConfigError(f"sparse FFN: {name}={v!r} must be in [0, 1)")
        if self.importance not in ("attention", "cross", "chunk", "deviation"):
            raise HeadConfigError(f"sparse FFN: importance={self.importance!r} must be 'attention', 'cross', "
                                  f"'chunk' or 'deviation'")
        if self.keep_fraction is not None and (isinstance(self.keep_fraction, bool)
                                               or not isinstance(self.keep_fraction, (int, float))
                                               or not 0 < self.keep_fraction <= 1):
            raise HeadConfigError(f"sparse FFN: keep_fraction={self.keep_fraction!r} must be in (0, 1] or null")
        if self.importance == "deviation" and self.keep_fraction is None:
            raise HeadConfigError("sparse FFN: importance='deviation' ranks rows for a keep_fraction: set one "
                                  "(the mass tiers read attention masses)")

    @classmethod
    def from_json(cls, path: str | Path) -> "SparseFFNConfig":
        raw = _read_json(path, "sparse FFN config")
        if not isinstance(raw, dict):
            raise HeadConfigError(f"{path}: expected a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise HeadConfigError(f"{path}: unknown sparse FFN field(s) {unknown} (known: {sorted(known)})")
        return cls(**raw)

    def threshold(self, layer: int) -> float | None:
        """Mass share a layer's FFN may drop; None for a dense-FFN layer."""
        if layer < self.dense_until:
            return None
        return self.mass_thresh if layer < self.deep_layer_start else self.mass_thresh_deep
