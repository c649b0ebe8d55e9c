"""The methods as values: one registry that the engine, the fronts and the benchmarks ask.

A method says which head plan its KV lives under, how it uses document (chunk) KV, and, for the
recovery methods, the policy that decides what each layer recomputes. Everything that used to sort
methods by name asks its ``MethodSpec`` instead.

dense          every token, every layer, every head global (the baseline)
headsparse     every token, each head only its visible set (the head config), no reuse
prefix         exact KV of the longest cached prefix (the prefix cache), the rest dense
full_reuse     relocated chunk KV as it is; only the question is computed
epic           full_reuse, plus each chunk's first ``epic_tokens`` tokens recomputed
cacheblend     layers up to ``cacheblend_check_layer`` recompute every chunk token; the
               ``cacheblend_ratio`` of them whose values deviate most continue
redknot        what redknot serves: one recovery over chunks + question under the head plan (shallow
               layers local, dense FFN; deep layers global heads see everything, local heads their
               window), the FFN only on the tokens the question attends to most; a token left out
               of a layer's FFN stops there and later layers use its cached, relocated KV
               (alias: ``redknot_kv``)
redknot_paper  the paper's form: as redknot, but a token left out of the FFN keeps its residual and
               goes on through every later layer's projections and attention
qrecompute     query-guided recomputation: every chunk token up to ``qrecompute_layer``, where the
               question's attention picks the ``qrecompute_ratio`` of them that go on through every
               layer (each chunk's first ``qrecompute_start_tokens`` first); ``kv_correction`` moves
               the cached K/V of the rest by their chunk's mean recomputed-minus-cached offset
               (``kv_correction``, ``+kc``, also moves the left-out rows of cacheblend and redknot;
               ``dummy_prefix_tokens``, ``+dpN``, caches every chunk behind N dummy tokens). With
               ``question_pass`` (``+qp``; also redknot's sparse-FFN ranking) the question first runs
               alone over the placed KV and its attention over every layer ranks the tokens, which
               then run from layer 0
redknot_exact  the redknot code path with every head global, dense FFN, every chunk recomputed:
               equals dense (the correctness gate)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch

from ..config import DEFAULT_SINK, HeadConfig, SparseFFNConfig
from ..models.config import ModelConfig
from .options import ReuseOptions
from .policies import CacheBlend, QueryRecompute, QuestionScores, RedKnot
from .correction import KVCorrection
from .prompt import ChunkedPrompt
from .recovery import Policy


class ChunkUse(str, Enum):
    """How a method uses document KV."""
    NONE = "none"  # prefills the whole prompt (the prefix cache may still supply a prefix)
    PLACED = "placed"  # relocated chunk KV is copied in; the rest of the prompt prefills in the pool
    RECOVERED = "recovered"  # relocated chunk KV is copied in, then partly recomputed by a policy


@dataclass(frozen=True)
class PolicyInputs:
    """What a recovery policy is built from: one prompt's layout and the model's plan and knobs."""
    prompt: ChunkedPrompt
    config: ModelConfig
    head_config: HeadConfig | None
    sparse: SparseFFNConfig
    options: ReuseOptions
    device: torch.device

    def global_visibility(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        plan = HeadConfig.all_global(cfg.num_hidden_layers, cfg.num_key_value_heads)
        return _tensors(plan.visibility(cfg.sliding_windows))

    def plan_visibility(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _tensors(self.head_config.visibility(self.config.sliding_windows))

    def chunk_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_chunk bool [N], chunk_id long [N], -1 outside chunks)."""
        n, dev = len(self.prompt), self.device
        is_chunk = torch.zeros(n, dtype=torch.bool, device=dev)
        chunk_id = torch.full((n,), -1, dtype=torch.long, device=dev)
        for i, (ids, at) in enumerate(zip(self.prompt.chunks, self.prompt.chunk_starts)):
            chunk_id[at:at + len(ids)] = i
            is_chunk[at:at + len(ids)] = True
        return is_chunk, chunk_id


@dataclass(frozen=True)
class MethodSpec:
    name: str
    plan: str  # the head plan its KV lives under in the pool: "dense" or "headsparse"
    chunks: ChunkUse
    policy: Callable[[PolicyInputs], Policy] | None = None  # RECOVERED methods: what each layer recomputes
    recompute_chunk_heads: bool = False  # epic: each chunk's first tokens are recomputed after placement
    # Prompt tokens a recovery counts as served from a cache: "chunks" (prefix and chunks) or "prefix"
    cached_from: str = "chunks"

    @property
    def reads_chunks(self) -> bool:
        return self.chunks is not ChunkUse.NONE

    @property
    def recovers(self) -> bool:
        return self.chunks is ChunkUse.RECOVERED

    @property
    def needs_head_config(self) -> bool:
        return self.plan == "headsparse"

    def build_policy(self, inputs: PolicyInputs) -> tuple[Policy, torch.Tensor]:
        """The recovery policy over ``inputs.prompt`` and the positions whose K/V it takes from the
        cache (bool [N]: the prompt prefix and every chunk, relocated)."""
        if self.policy is None:
            raise ValueError(f"method {self.name!r} does not recover")
        is_chunk, _ = inputs.chunk_layout()
        cached = is_chunk.clone()
        cached[:len(inputs.prompt.prefix)] = True
        return self.policy(inputs), cached


# ---------------------------------------------------------------- policies by method

def _cacheblend(x: PolicyInputs) -> Policy:
    body = torch.arange(len(x.prompt.prefix), len(x.prompt), device=x.device)  # chunks + question
    is_chunk, _ = x.chunk_layout()
    o = x.options
    _, chunk_id = x.chunk_layout()
    return CacheBlend(body, *x.global_visibility(), is_chunk, o.cacheblend_ratio,
                      min(o.cacheblend_check_layer, x.config.num_hidden_layers - 1), chunk_id,
                      _correction(x))


def _qrecompute(x: PolicyInputs) -> Policy:
    p, o = x.prompt, x.options
    body = torch.arange(_first_recovered(x), len(p), device=x.device)
    is_chunk, chunk_id = x.chunk_layout()
    return QueryRecompute(body, *x.global_visibility(), is_chunk, chunk_id, o.qrecompute_ratio,
                          min(o.qrecompute_layer, x.config.num_hidden_layers - 1),
                          max(1, min(o.observation_tokens, len(p.suffix))), o.qrecompute_start_tokens, _correction(x),
                          _question_scores(x, *x.global_visibility()))


def _question_scores(x: PolicyInputs, window: torch.Tensor, sink: torch.Tensor) -> QuestionScores | None:
    """The question pass the options ask for (``+qp``): the question's rows under (window, sink), every
    question token observed from ``question_pass_from`` on; None without one."""
    if not x.options.question_pass:
        return None
    p = x.prompt
    is_chunk, _ = x.chunk_layout()
    return QuestionScores(torch.arange(p.suffix_start, len(p), device=x.device), window, sink, is_chunk,
                          max(1, len(p.suffix)), min(x.options.question_pass_from, x.config.num_hidden_layers - 1))


# Architectures whose keys carry one plain RoPE in every layer (what KV correction un-rotates)
_PLAIN_ROPE = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


def _correction(x: PolicyInputs) -> KVCorrection | None:
    """The KV correction the options ask for (``+kc``, keys only with ``+kck``, a share of the offset with
    ``+kc0.5``), or None."""
    if not x.options.kv_correction:
        return None
    return KVCorrection(_rope_relocation(x), values=x.options.kv_correction_values, scale=x.options.kv_correction_scale)


def _rope_relocation(x: PolicyInputs):
    from ..models.rope import RotaryEmbedding

    kind = getattr(x.config, "model_type", "llama") or "llama"
    if kind not in _PLAIN_ROPE:
        raise ValueError(f"kv_correction: model_type {kind!r} is not supported (keys under one plain RoPE: "
                         f"{', '.join(_PLAIN_ROPE)})")
    return RotaryEmbedding(x.config).to(x.device).relocate


def _redknot_exact(x: PolicyInputs) -> Policy:
    body = torch.arange(len(x.prompt.prefix), len(x.prompt), device=x.device)
    is_chunk, _ = x.chunk_layout()
    L = x.config.num_hidden_layers
    vis = x.global_visibility()
    return RedKnot(body, *vis, *vis, is_chunk, SparseFFNConfig(dense_until=L, deep_layer_start=L), 0, False)


def _redknot(keep_cached: bool) -> Callable[[PolicyInputs], Policy]:
    def build(x: PolicyInputs) -> Policy:
        window, sink = x.plan_visibility()
        shallow_w, shallow_s = _shallow(window, sink, x.options.shallow_window)
        p = x.prompt
        body = torch.arange(_first_recovered(x), len(p), device=x.device)
        is_chunk, chunk_id = x.chunk_layout()
        return RedKnot(body, window, sink, shallow_w, shallow_s, is_chunk, x.sparse,
                       min(x.options.observation_tokens, len(p.suffix)), keep_cached=keep_cached, chunk_id=chunk_id,
                       correction=_correction(x), scorer=_question_scores(x, window, sink))
    return build


def _first_recovered(x: PolicyInputs) -> int:
    """Where recovery starts. The first chunk was encoded right after the prefix, where it sits now:
    its cached K/V are what dense prefill computes, so recomputing it only costs FLOPs; recovery
    starts at the second chunk. Cached behind dummy tokens (``dummy_prefix_tokens``) it is not
    exact, and recovery starts at the first."""
    p = x.prompt
    if x.options.dummy_prefix_tokens and p.chunks:
        return p.chunk_starts[0]
    return p.chunk_starts[1] if len(p.chunks) > 1 else p.suffix_start


def _shallow(window: torch.Tensor, sink: torch.Tensor, shallow_window: int | None):
    """Local recovery: global heads get the widest local window (or ``shallow_window``) and a sink."""
    local = window[window < window.max()]
    w = shallow_window or (int(local.max()) if local.numel() else 1024)
    is_global = window > w
    return torch.where(is_global, w, window), torch.where(is_global, DEFAULT_SINK, sink)


def _tensors(vis) -> tuple[torch.Tensor, torch.Tensor]:
    window, sink = vis
    return torch.as_tensor(window, dtype=torch.int64), torch.as_tensor(sink, dtype=torch.int64)


_SPECS = (
    MethodSpec("dense", "dense", ChunkUse.NONE),
    MethodSpec("headsparse", "headsparse", ChunkUse.NONE),
    MethodSpec("prefix", "dense", ChunkUse.NONE),
    MethodSpec("full_reuse", "dense", ChunkUse.PLACED),
    MethodSpec("epic", "dense", ChunkUse.PLACED, recompute_chunk_heads=True),
    MethodSpec("cacheblend", "dense", ChunkUse.RECOVERED, _cacheblend),
    MethodSpec("redknot", "headsparse", ChunkUse.RECOVERED, _redknot(keep_cached=True)),
    MethodSpec("redknot_paper", "headsparse", ChunkUse.RECOVERED, _redknot(keep_cached=False)),
    MethodSpec("qrecompute", "dense", ChunkUse.RECOVERED, _qrecompute),
    MethodSpec("redknot_exact", "dense", ChunkUse.RECOVERED, _redknot_exact, cached_from="prefix"),
)
METHODS: dict[str, MethodSpec] = {s.name: s for s in _SPECS}
ALIASES = {"redknot_kv": "redknot"}
METHOD_NAMES = tuple(METHODS)


def canonical_name(name: str) -> str:
    """The registry name of ``name`` (aliases resolved); raises ValueError for an unknown one."""
    name = ALIASES.get(name, name)
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} (available: {', '.join(METHOD_NAMES)}; "
                         f"aliases: {', '.join(f'{a}={b}' for a, b in ALIASES.items())})")
    return name


def get_method(name: str) -> MethodSpec:
    return METHODS[canonical_name(name)]


def default_method(head_config, recommended: str | None = None) -> str:
    """The method a request that names none gets under ``auto``: the checkpoint's measured choice
    (``recommended``, its ``reuse.json``) where it has one; else the best quality per FLOP
    (docs/results/quality_testbed.md), ``redknot``, which needs a head config; without one
    ``cacheblend``, the strongest head-agnostic reuse."""
    if recommended is not None:
        return recommended
    return "redknot" if head_config is not None else "cacheblend"


# Knobs a request may set after "@" in its method (``cacheblend@0.3``): method -> (field, type). The
# first two are ReuseOptions fields, keep_fraction a SparseFFNConfig one.
BUDGET_KNOBS = {"cacheblend": ("cacheblend_ratio", float), "epic": ("epic_tokens", int),
                "redknot": ("keep_fraction", float), "redknot_paper": ("keep_fraction", float),
                "qrecompute": ("qrecompute_ratio", float)}
REUSE_KNOBS = ("cacheblend_ratio", "epic_tokens", "qrecompute_ratio", "qrecompute_start_tokens",
               "question_pass", "question_pass_from", "kv_correction", "kv_correction_values",
               "kv_correction_scale", "dummy_prefix_tokens")
# What may follow a budget after "+": chunk starts kept ("+s16"), KV correction ("+kc"; keys only "+kck"; a share of
# the offset "+kc0.5"), chunks cached behind dummy tokens ("+dp4"): the methods that take each.
START_TOKENS = {"redknot": "chunk_start_tokens", "redknot_paper": "chunk_start_tokens",
                "qrecompute": "qrecompute_start_tokens"}
KV_CORRECTED = ("cacheblend", "redknot", "qrecompute")
QUESTION_PASS = ("qrecompute", "redknot", "redknot_paper")


def parse_method(spec: str) -> tuple[str, dict]:
    """``"cacheblend@0.3"`` -> ``("cacheblend", {"cacheblend_ratio": 0.3})``, ``"epic@32"`` ->
    tokens recomputed per chunk, ``"redknot@0.2"`` -> the sparse FFN's keep fraction (with
    ``+sN``: each chunk's first N tokens among the kept rows; without it none); a plain name ->
    (its registry name, {}); ``"qrecompute@0.3"`` -> the share recomputed (each chunk's first 16
    tokens first; ``+sN``: N of them). ``+kc`` turns KV correction on (cacheblend, redknot,
    qrecompute; ``+kck`` the keys only; ``+kc0.5`` half the offset), ``+dpN`` caches each chunk behind N
    dummy tokens (any budgeted method), ``+qp`` ranks the rows by a question pass (qrecompute, redknot,
    redknot_paper; ``+qp6``: its attention from layer 6 on). Raises
    ValueError naming what is wrong."""
    name, at, value = spec.partition("@")
    name = canonical_name(name)
    if not at:
        return name, {}
    if name not in BUDGET_KNOBS:
        raise ValueError(f"method {spec!r}: only {', '.join(BUDGET_KNOBS)} take a budget after '@'")
    value, *extras = value.split("+")
    field_, kind = BUDGET_KNOBS[name]
    try:
        v = kind(value)
    except ValueError:
        raise ValueError(f"method {spec!r}: {value!r} is not a {kind.__name__} ({field_})") from None
    if v < 0 or (kind is float and (v != v or v > 1)) or (field_ == "keep_fraction" and v == 0):
        raise ValueError(f"method {spec!r}: {field_} out of range")
    knobs = {field_: v}
    if field_ == "keep_fraction":
        knobs["chunk_start_tokens"] = 0  # none unless "+sN" says otherwise
    for extra in extras:
        knobs.update(_extra_knob(spec, name, extra))
    return name, knobs


def _extra_knob(spec: str, name: str, extra: str) -> dict:
    """The knob one "+" suffix of a method spec sets (``parse_method``)."""
    kc = re.fullmatch(r"kc(k?)((?:0|1)?\.?\d*)", extra)
    if kc is not None:
        if name not in KV_CORRECTED:
            raise ValueError(f"method {spec!r}: KV correction ('+{extra}') is for {', '.join(KV_CORRECTED)} only")
        try:
            scale = float(kc[2]) if kc[2] else 1.0
        except ValueError:
            raise ValueError(f"method {spec!r}: {kc[2]!r} is not a share of the offset ('+kc0.5')") from None
        if not 0 < scale <= 1:
            raise ValueError(f"method {spec!r}: the share of the offset must be in (0, 1], got {scale:g}")
        return {"kv_correction": True, "kv_correction_values": not kc[1], "kv_correction_scale": scale}
    if extra.startswith("qp") and (extra == "qp" or extra[2:].isdigit()):
        if name not in QUESTION_PASS:
            raise ValueError(f"method {spec!r}: a question pass ('+qp') is for {', '.join(QUESTION_PASS)} only")
        return {"question_pass": True, "question_pass_from": int(extra[2:] or 0)}
    if extra.startswith("dp") and extra[2:].isdigit() and int(extra[2:]) > 0:
        return {"dummy_prefix_tokens": int(extra[2:])}
    if extra.startswith("s") and extra[1:].isdigit():
        if name not in START_TOKENS:
            raise ValueError(f"method {spec!r}: a chunk-start count ('+{extra}') is for "
                             f"{', '.join(START_TOKENS)} only")
        return {START_TOKENS[name]: int(extra[1:])}
    raise ValueError(f"method {spec!r}: {extra!r} is neither a chunk-start count ('+s16'), KV correction "
                     f"('+kc', keys only '+kck', a share '+kc0.5'), a dummy prefix ('+dp4') nor a question "
                     f"pass ('+qp', from layer 6 '+qp6')")


def with_budget(options: ReuseOptions, sparse: SparseFFNConfig, budget: dict | None):
    """(options, sparse) with one request's knobs (``parse_method``) over the engine's."""
    if not budget:
        return options, sparse
    return (replace(options, **{k: v for k, v in budget.items() if k in REUSE_KNOBS}),
            replace(sparse, **{k: v for k, v in budget.items() if k not in REUSE_KNOBS}))
