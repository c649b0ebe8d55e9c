"""Head profiler: measure every (layer, KV head) on calibration prompts and choose its class.

A sample is a calibration prompt ``[prefix][context][chunk][suffix]`` (the chunk is the record's
last document, the context the documents before it) plus an alternate ``[prefix][other][chunk]``
whose ``other`` is real text from other documents, cut to the context's length so the chunk sits
at the same positions. The model runs both layer by layer (fp32 softmax, queries in blocks), and
per KV head, pooled over its query group and over the samples:

* prefix sensitivity: ||o - o'|| / ||o|| over the chunk's tokens, the group's query heads and the
  head dim, where o is the head's attention output on the chunk under its own context and o' the
  output when the head reads the other document's K/V instead (the chunk's own q/k/v held fixed,
  so the change is what *this head* reads from the prefix, not what earlier layers changed).
  The end-to-end version (both prompts run through the whole model) is reported beside it;
* edge mass: share of attention outside sink (keys j < S) + reference window (p - j < W_ref);
* coverage window: smallest W, a multiple of the page size, such that keys j < S or p - j < W
  receive ``coverage`` of the attention mass (pooled over queries);
* retrieval score: attention mass on the ``retrieval_k`` most attended keys outside sink +
  reference window: high when a head reads a few distant tokens.

Edge mass, coverage and retrieval use the queries at positions p >= S + W_ref of the context
prompt (the ones that have anything outside sink + reference window to attend to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..config import DEFAULT_SINK, HeadConfig
from ..kernels.reference import softmax_with_sinks
from ..visibility import GLOBAL_WINDOW, visible

# Score elements per query block ([Hq, rows, keys] fp32): bounds memory at long context.
BLOCK_ELEMS = 2**24
_EPS = 1e-12
METRICS = ("prefix_sensitivity", "prefix_sensitivity_e2e", "edge_mass", "question_edge_mass",
           "question_window_error", "coverage_window", "retrieval_score")
# Measured only when asked (one forward per head and sample): see ablation_kl.
OPTIONAL_METRICS = ("ablation_kl",)


@dataclass
class Sample:
    ids: torch.Tensor  # [N] [prefix][context][chunk][suffix]
    alt_ids: torch.Tensor  # [chunk end] [prefix][other document][chunk]
    chunk: tuple[int, int]  # [start, end) of the chunk in both
    id: str = ""


# ---- calibration prompts -> samples -------------------------------------------------------------
def make_samples(tokenizer, records: list[dict], max_tokens: int = 4096) -> list[Sample]:
    """Tokenize records as the engine does (``build_prompt``) and pair each with an alternate
    context taken from the other records' documents (then its own, in reverse order)."""
    from ..reuse.prompt import build_prompt

    if not records:
        raise ValueError("no calibration records")
    prompts = [build_prompt(tokenizer, r["question"], r["documents"]) for r in records]
    samples = []
    for i, (rec, cp) in enumerate(zip(records, prompts)):
        prefix, suffix = list(cp.prefix), list(cp.suffix)
        docs = [list(c) for c in cp.chunks]
        if len(docs) >= 2:
            context, chunk = [t for d in docs[:-1] for t in d], docs[-1]
        else:  # one document: its first half is the context of its second half
            half = len(docs[0]) // 2
            context, chunk = docs[0][:half], docs[0][half:]
        chunk, suffix = chunk[:max(1, max_tokens // 4)], suffix[-max(1, max_tokens // 8):]
        room = max_tokens - len(prefix) - len(chunk) - len(suffix)
        if room <= 0 or not context:
            raise ValueError(f"record {rec.get('id', i)}: max_tokens={max_tokens} leaves no room for a context")
        context = context[-room:]  # keep the text adjacent to the chunk
        pool = [t for k in range(1, len(prompts)) for c in prompts[(i + k) % len(prompts)].chunks for t in c]
        pool += [t for d in reversed(docs) for t in d]
        pool = pool * -(-len(context) // len(pool))
        other = pool[:len(context)]
        if other == context:  # degenerate (one record, repeated text): shift the text by half
            other = context[len(context) // 2:] + context[:len(context) // 2]
        c0 = len(prefix) + len(context)
        samples.append(Sample(torch.tensor(prefix + context + chunk + suffix), torch.tensor(prefix + other + chunk),
                              (c0, c0 + len(chunk)), str(rec.get("id", i))))
    return samples


# ---- metrics on attention probabilities ---------------------------------------------------------
def attention_stats(probs: torch.Tensor, q_pos: torch.Tensor, sink: int, ref_window: int, page_size: int,
                    n_buckets: int, retrieval_k: int, learned_sink: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-query metrics of attention probabilities ``probs`` [H, R, N] (rows sum to 1, causal:
    key j visible to the query at position q_pos[r] iff j <= q_pos[r]). ``learned_sink`` [H, R]:
    the mass on a learned sink logit (gpt-oss), when the rows sum to 1 with it.

    Returns edge [H, R] (mass on j >= sink with p - j >= ref_window), retrieval [H, R] (mass of the
    retrieval_k largest of those keys) and covered [H, R, n_buckets]: the mass on j < sink or
    p - j < (b + 1) * page_size (and on the learned sink, which every head keeps), i.e. what a
    local head with that window would keep."""
    h, r, n = probs.shape
    probs = probs.float()
    j = torch.arange(n, device=probs.device)
    body = probs.masked_fill(j < sink, 0.0)
    cum = F.pad(body.cumsum(-1), (1, 0))  # cum[..., i] = body mass on keys j < i
    p = q_pos.to(probs.device).long()[:, None]  # [R, 1]

    def mass_before(idx):  # body mass on keys j < idx, idx [R, K]
        return cum.gather(-1, idx.clamp(0, n).expand(h, -1, -1))

    sink_mass = probs[..., :sink].sum(-1)
    total = mass_before(p + 1)[..., 0]  # body mass on visible keys
    edge = mass_before(p - ref_window + 1)[..., 0]  # keys at distance >= ref_window
    widths = (torch.arange(n_buckets, device=probs.device) + 1) * page_size
    covered = (sink_mass + total)[..., None] - mass_before(p - widths[None, :] + 1)
    if learned_sink is not None:
        covered = covered + learned_sink.float()[..., None]
    far = ~visible(p, j[None, :], ref_window, sink)  # [R, N]; keys past p carry no mass
    top = body.masked_fill(~far, 0.0).topk(min(retrieval_k, n), dim=-1).values.sum(-1)
    return {"edge": edge, "retrieval": top, "covered": covered}


def window_error(probs: torch.Tensor, q_pos: torch.Tensor, values: torch.Tensor, sink: int, window: int,
                 learned_sink: torch.Tensor | None = None) -> torch.Tensor:
    """Relative squared change of each query's attention output [H, R] if the head saw only sink +
    ``window`` (probabilities renormalised over what stays, the learned sink's mass [H, R] included
    when given): ||o - o_local||^2 / ||o||^2. ``probs`` [H, R, N], ``values`` [H, N, D]. What a
    local head would actually lose, where edge mass only says how much attention leaves the window
    (diffuse far attention can cost little)."""
    n = probs.shape[-1]
    j = torch.arange(n, device=probs.device)
    keep = visible(q_pos.to(probs.device).long()[:, None], j[None, :], window, sink)  # [R, N]
    local = probs.float() * keep
    kept = local.sum(-1, keepdim=True)
    if learned_sink is not None:
        kept = kept + learned_sink.float()[..., None]
    local = local / kept.clamp_min(_EPS)
    o, o_local = probs.float() @ values.float(), local @ values.float()
    return ((o - o_local).pow(2).sum(-1) / o.pow(2).sum(-1).clamp_min(_EPS)).double()


def coverage_window(covered_frac, coverage: float, page_size: int) -> np.ndarray:
    """Smallest window (a multiple of page_size) whose covered mass share [..., B] reaches
    ``coverage``; the widest bucket when none does."""
    frac = np.asarray(covered_frac, dtype=np.float64)
    ok = frac >= coverage - 1e-6
    first = np.where(ok.any(-1), ok.argmax(-1), frac.shape[-1] - 1)
    return ((first + 1) * page_size).astype(np.int64)


class _Accumulator:
    """Sums of the per-query metrics of one layer over measured queries (per query head)."""

    def __init__(self, n_heads, n_buckets, device, window_error: bool = False, **spec):
        self.spec = dict(spec, n_buckets=n_buckets)
        self.window_error = torch.zeros(n_heads, dtype=torch.float64, device=device) if window_error else None
        self.edge = torch.zeros(n_heads, dtype=torch.float64, device=device)
        self.retrieval = torch.zeros_like(self.edge)
        self.covered = torch.zeros(n_heads, n_buckets, dtype=torch.float64, device=device)
        self.queries = 0

    def add(self, probs, q_pos, values=None, learned_sink=None):
        st = attention_stats(probs, q_pos, **self.spec, learned_sink=learned_sink)
        if self.window_error is not None:
            self.window_error += window_error(probs, q_pos, values, self.spec["sink"], self.spec["ref_window"],
                                              learned_sink).sum(1)
        self.edge += st["edge"].sum(1).double()
        self.retrieval += st["retrieval"].sum(1).double()
        self.covered += st["covered"].sum(1).double()
        self.queries += q_pos.numel()


# ---- the forward by hand ------------------------------------------------------------------------
def _attend(q, q_start, k, v, scale, native_window=None, stats=(), block_elems=BLOCK_ELEMS, sink_logits=None):
    """Causal attention of q [R, Hq, D] at positions q_start.. over k [N, Hkv, D] and v [N, Hkv, Dv]
    at 0..N-1, in fp32, one block of query rows at a time, with the learned sink logits [Hq] (or
    None) in the softmax. ``stats``: (_Accumulator, first position) pairs; queries at positions >=
    the first position feed the accumulator. Returns o [R, Hq, Dv] in v's dtype."""
    r_total, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, N, D]
    out = torch.empty(r_total, hq, v.shape[-1], dtype=v.dtype, device=q.device)
    rows = max(1, block_elems // (hq * k.shape[0]))
    for r0 in range(0, r_total, rows):
        r1 = min(r0 + rows, r_total)
        n = q_start + r1  # keys after the block's last query are invisible: skip them
        pos = torch.arange(q_start + r0, q_start + r1, device=q.device)
        j = torch.arange(n, device=q.device)
        # every head sees its causal past, within the architecture's own sliding window if it has one
        seen = visible(pos[:, None], j[None, :], native_window or GLOBAL_WINDOW, 0)
        qb = q[r0:r1].float().view(r1 - r0, hkv, g, d)
        scores = torch.einsum("rhgd,hnd->hgrn", qb, kf[:, :n]) * scale
        scores = scores.masked_fill(~seen, float("-inf"))
        if sink_logits is None:
            probs, learned = scores.softmax(dim=-1), None  # [Hkv, g, rows, n]
        else:
            probs = softmax_with_sinks(scores, sink_logits.float().view(hkv, g, 1, 1))
            learned = 1 - probs.sum(-1)  # [Hkv, g, rows]: the learned sink's mass
        out[r0:r1] = torch.einsum("hgrn,hnd->rhgd", probs, vf[:, :n]).reshape(r1 - r0, hq, -1).to(v.dtype)
        for acc, measure_from in stats:
            i0 = max(0, measure_from - (q_start + r0))  # rows are sorted by position
            if i0 < r1 - r0:
                values = vf[:, :n].repeat_interleave(g, 0) if acc.window_error is not None else None
                acc.add(probs[:, :, i0:].reshape(hq, r1 - r0 - i0, n), pos[i0:], values,
                        None if learned is None else learned[:, :, i0:].reshape(hq, r1 - r0 - i0))
    return out


def _relative_l2(ref, other, n_kv):
    """||ref - other|| / ||ref|| per KV head over tokens, the group's query heads and dims."""
    t, hq, d = ref.shape
    ref, other = ref.float().view(t, n_kv, -1), other.float().view(t, n_kv, -1)
    return ((ref - other).pow(2).sum((0, 2)).sqrt() / ref.pow(2).sum((0, 2)).sqrt().clamp_min(_EPS)).double()



@torch.inference_mode()
def measure_heads(model, cfg, samples: list[Sample], *, sink: int = DEFAULT_SINK, ref_window: int = 256,
                  page_size: int = 64, coverage: float = 0.95, retrieval_k: int = 8,
                  block_elems: int = BLOCK_ELEMS, progress: bool = True) -> dict:
    """The four metrics per (layer, KV head) as float/int arrays [L, Hkv], plus counts."""
    from tqdm.auto import tqdm

    if not samples:
        raise ValueError("no calibration samples")
    from ..models.registry import adapter_for

    dev = next(model.parameters()).device
    adapter = adapter_for(model, cfg)  # PROFILE: embeddings, each layer's q/k/v, the rest of the layer
    n_layers, hq, hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    g = hq // hkv
    measure_from = sink + ref_window
    longest = max(s.ids.numel() for s in samples)
    if longest <= measure_from:
        raise ValueError(f"calibration prompts have at most {longest} tokens: the metrics need prompts longer "
                         f"than sink + reference window = {measure_from} (use longer prompts or a smaller "
                         f"ref_window / --ref-window)")
    n_buckets = -(-longest // page_size)
    native = list(cfg.sliding_windows or []) + [None] * n_layers
    acc = [_Accumulator(hq, n_buckets, dev, sink=sink, ref_window=ref_window, page_size=page_size,
                        retrieval_k=retrieval_k) for _ in range(n_layers)]
    # the question's own queries (the suffix): what a RAG prompt needs to reach back into the documents
    acc_q = [_Accumulator(hq, n_buckets, dev, window_error=True, sink=sink, ref_window=ref_window,
                          page_size=page_size, retrieval_k=retrieval_k) for _ in range(n_layers)]
    sens = torch.zeros(n_layers, hkv, dtype=torch.float64, device=dev)
    sens_e2e = torch.zeros_like(sens)
    for s in tqdm(samples, desc="profiling heads", unit="sample", disable=not progress):
        ids, alt = s.ids.to(dev), s.alt_ids.to(dev)
        c0, c1 = s.chunk
        pos, pos_alt = torch.arange(ids.numel(), device=dev), torch.arange(alt.numel(), device=dev)
        h, h_alt = adapter.embed(ids), adapter.embed(alt)
        for l in range(n_layers):
            scale, win, sinks = cfg.attention_scale, native[l], adapter.layer_sink_logits(l)
            q, k, v = adapter.layer_qkv(l, h, pos)
            qa, ka, va = adapter.layer_qkv(l, h_alt, pos_alt)
            o = _attend(q, 0, k, v, scale, win, [(acc[l], measure_from), (acc_q[l], max(c1, measure_from))],
                        block_elems, sinks)
            o_alt = _attend(qa, 0, ka, va, scale, win, block_elems=block_elems, sink_logits=sinks)
            # the chunk's own q/k/v, the other document's K/V before it
            o_mix = _attend(q[c0:c1], c0, torch.cat([ka[:c0], k[c0:c1]]), torch.cat([va[:c0], v[c0:c1]]),
                            scale, win, block_elems=block_elems, sink_logits=sinks)
            sens[l] += _relative_l2(o[c0:c1], o_mix, hkv)
            sens_e2e[l] += _relative_l2(o[c0:c1], o_alt[c0:c1], hkv)
            h, h_alt = adapter.layer_finish(l, h, o), adapter.layer_finish(l, h_alt, o_alt)
    queries = acc[0].queries
    if queries == 0:
        raise ValueError(f"no calibration prompt is longer than sink + reference window = {measure_from} tokens")

    def pooled(x, n=queries):  # per query head sums -> per KV head means over the group's queries
        return (x.view(hkv, g, *x.shape[1:]).sum(1) / (g * max(1, n))).cpu().numpy()

    covered = np.stack([pooled(a.covered) for a in acc])  # [L, Hkv, B]
    return {
        "prefix_sensitivity": (sens / len(samples)).cpu().numpy(),
        "prefix_sensitivity_e2e": (sens_e2e / len(samples)).cpu().numpy(),
        "edge_mass": np.stack([pooled(a.edge) for a in acc]),
        "question_edge_mass": np.stack([pooled(a.edge, a.queries) for a in acc_q]),
        "question_window_error": np.stack([pooled(a.window_error, a.queries) for a in acc_q]),
        "coverage_window": coverage_window(covered, coverage, page_size),
        "retrieval_score": np.stack([pooled(a.retrieval) for a in acc]),
        "measured_queries": queries,
        "tokens": int(sum(s.ids.numel() for s in samples)),
        "longest": longest,
    }


@torch.inference_mode()
def ablation_kl(model, cfg, samples: list[Sample], *, sink: int = DEFAULT_SINK, window: int = 256,
                progress: bool = True) -> np.ndarray:
    """Per (layer, KV head): KL(p || p_h) of the next-token distribution at each prompt's last
    position (where the answer starts), p with every head full-context and p_h with head h alone
    limited to sink + window, averaged over the samples. This is the head's effect on what the
    model answers, which the attention statistics above only approximate; it costs one forward
    per head and sample, so it is opt-in (``ablation_weight``)."""
    from tqdm.auto import tqdm

    from ..reuse.policies import FixedSet
    from ..reuse.recovery import recover

    if cfg.mla is not None:
        raise ValueError(f"ablation_kl runs the Llama-family recovery forward; {cfg.model_type} (latent attention) "
                         f"has none: profile it without ablation_weight")
    dev = next(model.parameters()).device
    n_layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    window_all, sink_all = HeadConfig.all_global(n_layers, hkv).visibility(cfg.sliding_windows)
    full_w, full_s = torch.as_tensor(window_all), torch.as_tensor(sink_all)
    kl = np.zeros((n_layers, hkv))
    runs = tqdm(total=len(samples) * n_layers * hkv, desc="ablating heads", unit="forward", disable=not progress)
    for s in samples:
        ids = s.ids.to(dev)
        pos = torch.arange(ids.numel(), device=dev)
        ref = recover(model, ids, FixedSet(pos, full_w, full_s)).logits.log_softmax(-1)
        for l in range(n_layers):
            for h in range(hkv):
                w, sk = full_w.clone(), full_s.clone()
                w[l, h], sk[l, h] = min(window, int(full_w[l, h])), sink
                out = recover(model, ids, FixedSet(pos, w, sk)).logits.log_softmax(-1)
                kl[l, h] += float((ref.exp() * (ref - out)).sum())
                runs.update()
    runs.close()
    return kl / len(samples)


# ---- selection ----------------------------------------------------------------------------------
def n_global_target(target_global: float, n_eligible: int) -> int:
    """round(target * eligible heads), halves rounded up."""
    return min(n_eligible, math.floor(target_global * n_eligible + 0.5))


def select_heads(metrics: dict, *, target_global: float = 0.15, dense_prefix_layers: int = 0, page_size: int = 64,
                 ref_window: int = 256, retrieval_threshold: float | None = 0.25,
                 min_global_edge: float | None = 0.02, force_global_edge: float | None = None,
                 sensitivity_weight: float = 0.5, question_weight: float = 0.0, ablation_weight: float = 0.0
                 ) -> tuple[list[list[str]], list[list[int]], np.ndarray, dict]:
    """Classes, windows, combined score [L, Hkv] and a summary of the selection.

    Eligible heads are those outside the first ``dense_prefix_layers`` layers (these are written as
    global and forced dense). score = (1 - qw) * (w * sensitivity / max(sensitivity) + (1 - w) *
    edge / max(edge)) + qw * question_error / max(question_error) over the eligible heads, where
    question_error is how much the attention output of the question's own queries changes if the
    head sees only sink + reference window (qw = ``question_weight``); with ``ablation_weight`` aw > 0
    that score becomes (1 - aw) * score + aw * ablation_kl / max(ablation_kl) (the head's measured
    effect on the answer's first token). The round(target * eligible) highest-scoring heads are global, except
    heads whose edge mass, over all queries and over the question's, is below ``min_global_edge``
    (nothing outside their window to read: fewer globals than the target); heads with edge mass
    >= ``force_global_edge`` are global regardless (more globals than the target). Of the others, heads with retrieval score >=
    ``retrieval_threshold`` are retrieval heads (window: the reference window, distant tokens come
    from their selection); the rest are local with their coverage window."""
    sens = np.asarray(metrics["prefix_sensitivity"], dtype=np.float64)
    edge = np.asarray(metrics["edge_mass"], dtype=np.float64)
    retr = np.asarray(metrics["retrieval_score"], dtype=np.float64)
    cover = np.asarray(metrics["coverage_window"], dtype=np.int64)
    eligible = np.zeros_like(edge, dtype=bool)
    eligible[dense_prefix_layers:] = True

    def normed(x):
        top = x[eligible].max() if eligible.any() else 0.0
        return x / top if top > 0 else np.zeros_like(x)

    base = sensitivity_weight * normed(sens) + (1 - sensitivity_weight) * normed(edge)
    if question_weight:
        qerr = np.asarray(metrics["question_window_error"], dtype=np.float64)
        base = (1 - question_weight) * base + question_weight * normed(qerr)
    if ablation_weight:
        if "ablation_kl" not in metrics:
            raise ValueError("ablation_weight > 0 needs the ablation_kl metric (measure it with ablation_kl)")
        base = (1 - ablation_weight) * base + ablation_weight * normed(np.asarray(metrics["ablation_kl"], np.float64))
    score = np.where(eligible, base, np.nan)
    order = np.argsort(-np.nan_to_num(score, nan=-np.inf), axis=None, kind="stable")  # ties: lower (layer, head)
    n_target = n_global_target(target_global, int(eligible.sum()))
    candidates = eligible.copy()
    if min_global_edge is not None:
        # a head that reads far only from the question (an answer-retrieval head) has edge mass
        # near 0 over all queries: the floor applies to the larger of the two
        reach = np.maximum(edge, np.asarray(metrics.get("question_edge_mass", edge), dtype=np.float64))
        candidates &= reach >= min_global_edge
    is_global = np.zeros_like(eligible)
    is_global.flat[order[candidates.flat[order]][:n_target]] = True
    forced = np.zeros_like(eligible)
    if force_global_edge is not None:
        forced = eligible & (edge >= force_global_edge) & ~is_global
        is_global |= forced
    is_retrieval = np.zeros_like(eligible)
    if retrieval_threshold is not None:
        is_retrieval = eligible & ~is_global & (retr >= retrieval_threshold)
    ref_pages = -(-ref_window // page_size) * page_size
    full = ~eligible | is_global  # dense prefix heads are written as global (full attention)
    classes = np.where(full, "global", np.where(is_retrieval, "retrieval", "local")).tolist()
    windows = np.where(full, -1, np.where(is_retrieval, np.minimum(cover, ref_pages), cover)).tolist()
    summary = {"eligible": int(eligible.sum()), "target": n_target, "global": int(is_global.sum()),
               "forced_global": int(forced.sum()),
               "below_min_edge": int((eligible & ~candidates).sum()), "retrieval": int(is_retrieval.sum())}
    return classes, windows, score, summary


# ---- the whole profile --------------------------------------------------------------------------
def profile_heads(model, cfg, tokenizer, records: list[dict], *, target_global: float = 0.15,
                  coverage: float = 0.95, page_size: int = 64, dense_prefix_layers: int = 0,
                  sink: int = DEFAULT_SINK, ref_window: int = 256, retrieval_k: int = 8,
                  retrieval_threshold: float | None = 0.25, min_global_edge: float | None = 0.02,
                  force_global_edge: float | None = None, sensitivity_weight: float = 0.5,
                  question_weight: float = 0.5, ablation_weight: float = 0.0,
                  max_tokens: int = 4096, block_elems: int = BLOCK_ELEMS, model_name: str | None = None,
                  progress: bool = True) -> HeadConfig:
    """Profile ``model`` (a redknot LlamaForCausalLM, ``cfg`` its ModelConfig) on calibration
    ``records`` and return the head plan; its metadata["profiling"] holds metrics and parameters.
    MLA models (one latent for every query head, no per-head selection) get no retrieval heads."""
    if cfg.mla is not None:
        retrieval_threshold = None
    _check_params(cfg, target_global, coverage, page_size, dense_prefix_layers, sink, ref_window, retrieval_k,
                  sensitivity_weight, max_tokens, question_weight, ablation_weight)
    max_tokens = min(max_tokens, cfg.max_position_embeddings)
    samples = make_samples(tokenizer, records, max_tokens)
    metrics = measure_heads(model, cfg, samples, sink=sink, ref_window=ref_window, page_size=page_size,
                            coverage=coverage, retrieval_k=retrieval_k, block_elems=block_elems, progress=progress)
    if ablation_weight:
        metrics["ablation_kl"] = ablation_kl(model, cfg, samples, sink=sink, window=ref_window, progress=progress)
    classes, windows, score, summary = select_heads(
        metrics, target_global=target_global, dense_prefix_layers=dense_prefix_layers, page_size=page_size,
        ref_window=ref_window, retrieval_threshold=retrieval_threshold, min_global_edge=min_global_edge,
        force_global_edge=force_global_edge, sensitivity_weight=sensitivity_weight, question_weight=question_weight,
        ablation_weight=ablation_weight)
    name = model_name or cfg.model_type
    params = dict(target_global=target_global, coverage=coverage, page_size=page_size,
                  dense_prefix_layers=dense_prefix_layers, sink=sink, ref_window=ref_window,
                  retrieval_k=retrieval_k, retrieval_threshold=retrieval_threshold, min_global_edge=min_global_edge,
                  force_global_edge=force_global_edge, sensitivity_weight=sensitivity_weight,
                  question_weight=question_weight, ablation_weight=ablation_weight, max_tokens=max_tokens)
    profiling = {
        "model": name, "samples": len(samples), "tokens": metrics["tokens"], "longest_prompt": metrics["longest"],
        "measured_queries": metrics["measured_queries"], "parameters": params, "selection": summary,
        "metrics": {m: np.round(metrics[m], 5).tolist() for m in METRICS + OPTIONAL_METRICS if m in metrics},
        "score": [[None if np.isnan(x) else round(float(x), 5) for x in row] for row in score],
    }
    return HeadConfig(classes, windows, [[sink] * cfg.num_key_value_heads for _ in classes],
                      dense_prefix_layers=dense_prefix_layers,
                      metadata={"model": name, "method": "redknot profile", "profiling": profiling})


def _check_params(cfg, target_global, coverage, page_size, dense_prefix_layers, sink, ref_window, retrieval_k,
                  sensitivity_weight, max_tokens, question_weight=0.0, ablation_weight=0.0):
    checks = [
        ("target_global", target_global, 0 <= target_global <= 1, "in [0, 1]"),
        ("coverage", coverage, 0 < coverage <= 1, "in (0, 1]"),
        ("page_size", page_size, page_size >= 1, ">= 1"),
        ("dense_prefix_layers", dense_prefix_layers, 0 <= dense_prefix_layers <= cfg.num_hidden_layers,
         f"in [0, {cfg.num_hidden_layers}] (num_hidden_layers)"),
        ("sink", sink, sink >= 0, ">= 0"),
        ("ref_window", ref_window, ref_window >= 1, ">= 1"),
        ("retrieval_k", retrieval_k, retrieval_k >= 1, ">= 1"),
        ("sensitivity_weight", sensitivity_weight, 0 <= sensitivity_weight <= 1, "in [0, 1]"),
        ("question_weight", question_weight, 0 <= question_weight <= 1, "in [0, 1]"),
        ("ablation_weight", ablation_weight, 0 <= ablation_weight <= 1, "in [0, 1]"),
        ("max_tokens", max_tokens, max_tokens >= 16, ">= 16"),
    ]
    for name, value, ok, want in checks:
        if not ok:
            raise ValueError(f"profile: {name}={value!r} must be {want}")


# ---- plans from a stored profile ----------------------------------------------------------------
def local_share(plan: HeadConfig, windows=(128, 256, 512, 1024)) -> dict[int, float]:
    """Share of the profiled heads that can be local at each window: their coverage window (the
    smallest window holding ``coverage`` of their attention mass on the calibration prompts) is at
    most W. Reads the metrics a profiled plan stores (``metadata["profiling"]``)."""
    cover = np.asarray(_profiling(plan)["metrics"]["coverage_window"], dtype=np.int64)
    return {int(w): float((cover <= w).mean()) for w in windows}


def reselect(plan: HeadConfig, target_global: float, **overrides) -> HeadConfig:
    """The plan a profile would have written at another ``target_global`` (and other selection
    parameters, ``overrides``), from the metrics a profiled plan stores: no model, no forward."""
    prof = _profiling(plan)
    params = dict(prof["parameters"], **overrides, target_global=target_global)
    metrics = {k: np.asarray(v, dtype=np.float64) for k, v in prof["metrics"].items()}
    keys = ("dense_prefix_layers", "page_size", "ref_window", "retrieval_threshold", "min_global_edge",
            "force_global_edge", "sensitivity_weight", "question_weight", "ablation_weight")
    classes, windows, score, summary = select_heads(metrics, target_global=target_global,
                                                    **{k: params[k] for k in keys if k in params})
    profiling = {**prof, "parameters": params, "selection": summary,
                 "score": [[None if np.isnan(x) else round(float(x), 5) for x in row] for row in score],
                 "reselected_from": prof["parameters"].get("target_global")}
    sink = params.get("sink", DEFAULT_SINK)
    return HeadConfig(classes, windows, [[sink] * len(row) for row in classes],
                      dense_prefix_layers=params["dense_prefix_layers"],
                      metadata={**plan.metadata, "profiling": profiling})


def _profiling(plan: HeadConfig) -> dict:
    prof = plan.metadata.get("profiling")
    if not isinstance(prof, dict) or "metrics" not in prof or "parameters" not in prof:
        raise ValueError("the head config holds no profile metrics (metadata.profiling): write it with "
                         "`redknot profile`")
    return prof
