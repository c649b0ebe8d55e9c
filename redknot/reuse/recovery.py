"""One prefill forward in which each layer computes only a chosen set of tokens.

Every reuse method is a *policy* over this forward: which positions are computed at each layer
(the rest take their K/V from the cache: the exact prefix, relocated chunks), what each head may
see, and which tokens go through the FFN (the rest keep their residual). Dense prefill is the
policy "every token, every layer, every head global", so exact mode runs the same code.

The sets shrink monotonically (a token dropped after layer l has no hidden state later), and a
dropped token must be cached. The forward returns the K/V of every position at every layer: the
cache the decode continues from. Softmax in fp32; attention masks are built per head from the
same (window, sink) rule as the kernels. A model with learned attention sinks (gpt-oss: an
attention module's ``sinks``, one logit per query head) has them in every softmax here, the
attention masses the policies observe included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from ..kernels.reference import softmax_with_sinks
from ..models.registry import adapter_for
from ..visibility import visible
from .correction import correct_layer
from .flops import FlopReport, visible_pairs

# Query rows per attention block: bounds the [Hq, rows, N] mask and score memory.
_QUERY_BLOCK = 1024


class Policy:
    """What a method computes. Override the hooks; positions are absolute, idx index `cur`."""

    def initial(self) -> torch.Tensor:
        """Positions computed at layer 0 (sorted)."""
        raise NotImplementedError

    def scoring_pass(self) -> "Policy | None":
        """A policy whose forward runs first, over the same cached K/V, to observe what decides
        this one's rows (``initial`` reads it after that forward); None: a single forward."""
        return None

    def visibility(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(window, sink) int64 [Hkv] for this layer's queries."""
        raise NotImplementedError

    def query_split(self, layer: int) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(first position, window, sink): queries from that position on see this (window, sink)
        instead of ``visibility(layer)``'s (e.g. the suffix keeps its head plan where chunk tokens
        recover locally). None: one visibility for every query."""
        return None

    def needs_deviation(self, layer: int) -> bool:
        """Whether ``keep_rows``/``ffn_rows`` read ``info["v_deviation"]`` at this layer."""
        return False

    def observe(self, layer: int) -> int:
        """How many of the last computed queries report the attention mass they give (0: none)."""
        return 0

    def cross_chunks(self, layer: int, cur: torch.Tensor) -> torch.Tensor | None:
        """Chunk id of every position (-1 outside chunks) when this layer should report, per computed
        row, the attention mass its query gives keys of other chunks (``info["cross"]``); else None."""
        return None

    def kv_correction(self, layer: int, cur: torch.Tensor):
        """(chunk id per position [N], probe rows bool [len(cur)], KVCorrection) when this layer moves the
        cached K/V of the chunk tokens it does not compute by their chunk's mean offset over the
        probe rows (``reuse.correction``; ``rotate(x, delta)`` is the model's RoPE relocation);
        None: no correction."""
        return None

    def ffn_rows(self, layer: int, cur: torch.Tensor, info: dict) -> torch.Tensor | None:
        """Rows of `cur` whose FFN runs (None: all)."""
        return None

    def keep_rows(self, layer: int, cur: torch.Tensor, info: dict) -> torch.Tensor | None:
        """Rows of `cur` still computed from the next layer on (None: all)."""
        return None


@dataclass
class Recovered:
    logits: torch.Tensor  # float32 [vocab] of the last position
    k: list[torch.Tensor]  # per layer [N, Hkv, D]: the cache decode continues from
    v: list[torch.Tensor]
    flops: FlopReport


@torch.inference_mode()
def recover(model: torch.nn.Module, token_ids: torch.Tensor, policy: Policy,
            cache_k: list[torch.Tensor] | None = None, cache_v: list[torch.Tensor] | None = None,
            cached: torch.Tensor | None = None, kernel: str = "auto") -> Recovered:
    """Run the policy's prefill over ``token_ids`` [N].

    kernel: the attention path of windowed heads, "triton" (the SegPaged kernel reading the
    buffers as pages), "torch" (masked SDPA) or "auto" (triton on CUDA, torch elsewhere).
    cache_k/v: per layer [N, Hkv, D] K/V of cached positions (keys rotated at their absolute
    positions), ideally from ``kv_buffer``; ``cached`` bool [N] marks them. Positions never
    computed must be cached. The buffers are written in place and returned as the result."""
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel={kernel!r}: use 'auto', 'triton' or 'torch'")
    scorer = policy.scoring_pass()
    # the scoring pass writes only rows the policy computes again (the question), so the caches stay
    # those of the placed chunks; its FLOPs are the method's too
    scored = None if scorer is None else recover(model, token_ids, scorer, cache_k, cache_v, cached, kernel).flops
    cfg = model.config
    dev = token_ids.device
    n = token_ids.numel()
    paged = kernel == "triton" or (kernel == "auto" and dev.type == "cuda")
    cached = torch.zeros(n, dtype=torch.bool, device=dev) if cached is None else cached
    cur = policy.initial().to(dev)
    covered = cached.clone()
    covered[cur] = True
    if not bool(covered.all()):
        raise ValueError("recovery policy leaves positions neither cached nor computed")
    group = cfg.num_kv_groups
    flops = FlopReport()
    body = model.model
    adapter = adapter_for(model, cfg)  # the layer's attention and FFN blocks, as the architecture computes them
    h = adapter.embed(token_ids[cur])
    run = _run(cur)
    out_k, out_v = [], []
    # record_function ranges name the phases in a torch.profiler trace (`redknot bench ttft --profile`)
    for l, layer in enumerate(body.layers):
        attn = layer.self_attn
        sinks = adapter.layer_sink_logits(l)  # gpt-oss: a learned logit per query head in every softmax
        t = cur.numel()
        with record_function("recover.qkv"):
            q, k, v = attn.qkv(layer.input_layernorm(h), cur)
        if cache_k is not None:  # the caller's buffers become this layer's output (written in place)
            keys, values = cache_k[l], cache_v[l]
        else:
            keys, values = kv_buffer(n, attn.n_kv, attn.head_dim, k.dtype, dev), \
                kv_buffer(n, attn.n_kv, attn.head_dim, k.dtype, dev)
        info = {}
        with record_function("recover.kv_write"):
            if cache_k is not None:
                _correct(policy, l, cur, cached, k, v, keys, values)
                was = cached[cur]  # deviation of recomputed values from their cached version (CacheBlend)
                info["v_deviation"] = torch.where(
                    was, (v.float() - values[cur].float()).norm(dim=(-1, -2)), torch.zeros((), device=dev))
            if run is not None:  # contiguous positions: a slice copy, not a scatter
                keys[run[0]:run[1]], values[run[0]:run[1]] = k, v
            else:
                keys[cur], values[cur] = k, v
        window, sink = policy.visibility(l)
        split = policy.query_split(l)
        with record_function("recover.attention"):
            if split is None:
                o, mass = _attend(q, cur, keys, values, window.to(dev), sink.to(dev), cfg.attention_scale,
                                  policy.observe(l), full=window.cpu() >= n, paged=paged, sink_logits=sinks)
                pairs = visible_pairs(cur, window, sink, group)
            else:  # rows before `at` under (window, sink), rows from `at` on under their own
                at, window2, sink2 = split
                r = int(torch.searchsorted(cur, at))
                o, mass, pairs = torch.empty_like(q), None, 0
                for rows, w_, s_, n_obs in ((slice(0, r), window, sink, 0),
                                            (slice(r, t), window2, sink2, min(policy.observe(l), t - r))):
                    if rows.stop > rows.start:
                        o[rows], m_ = _attend(q[rows], cur[rows], keys, values, w_.to(dev), s_.to(dev),
                                              cfg.attention_scale, n_obs, full=w_.cpu() >= n, paged=paged,
                                              sink_logits=sinks)
                        mass = m_ if n_obs else mass
                        pairs += visible_pairs(cur[rows], w_, s_, group)
        info["mass"] = mass
        if mass is not None:  # the scoring pass: the observed queries' q·k over every key, materialised
            flops.add_scoring(cfg, policy.observe(l) if split is None else min(policy.observe(l), t - r), n)
        chunk_id = policy.cross_chunks(l, cur)
        if chunk_id is not None:
            with record_function("recover.cross_mass"):
                info["cross"] = cross_chunk_mass(q, cur, keys, window.to(dev), sink.to(dev), cfg.attention_scale,
                                                 chunk_id.to(dev), sinks)
        with record_function("recover.o_proj"):
            h = adapter.layer_attention(l, h, o)
        with record_function("recover.select"):
            rows = policy.ffn_rows(l, cur, info)
        # sparse FFN (rows not None): only these rows; the others keep their residual (on MoE, plus
        # the shared expert)
        with record_function("recover.ffn" if rows is None else "recover.sparse_ffn"):
            h = adapter.layer_ffn(l, h, rows)
        n_ffn = t if rows is None else rows.numel()
        with record_function("recover.bookkeeping"):
            flops.add_layer(cfg, t, pairs, n_ffn)
            out_k.append(keys)
            out_v.append(values)
            keep = policy.keep_rows(l, cur, info)
            if keep is not None:
                dropped = torch.ones(t, dtype=torch.bool, device=dev)
                dropped[keep] = False
                if not bool(cached[cur[dropped]].all()):
                    raise ValueError(f"layer {l}: the policy dropped positions that have no cached K/V")
                h, cur = h[keep], cur[keep]
                run = _run(cur)
    if cur.numel() == 0 or int(cur[-1]) != n - 1:
        raise ValueError("recovery policy must compute the last position through every layer")
    logits = model.logits(body.norm(h[-1:]))[0]
    flops.add_lm_head(cfg)
    # Layers after a drop hold cached K/V for dropped positions: already in `keys` via clone.
    return Recovered(logits, out_k, out_v, flops if scored is None else scored.merge(flops))


def _correct(policy: Policy, layer: int, cur, cached, k, v, keys, values) -> None:
    """KV correction (``Policy.kv_correction``): before the recomputed rows are written, the cached
    K/V of the chunk tokens left out at this layer move by their chunk's mean offset."""
    corr = policy.kv_correction(layer, cur)
    if corr is None:
        return
    chunk_id, probe, correction = corr
    rest = cached & (chunk_id >= 0)
    rest[cur] = False
    rest = rest.nonzero().flatten()
    if rest.numel() == 0 or not bool(probe.any()):
        return
    keys[rest], values[rest] = correct_layer(k, v, keys[cur], values[cur], cur, probe, rest, chunk_id,
                                             lambda p: (keys[p], values[p]), correction)


def _run(pos: torch.Tensor) -> tuple[int, int] | None:
    """(start, end) when the sorted positions are one contiguous range, else None."""
    if pos.numel() == 0:
        return None
    lo, hi = (int(x) for x in pos[[0, -1]].tolist())
    return (lo, hi + 1) if hi + 1 - lo == pos.numel() else None


def _attend(q, q_pos, keys, values, window, sink, scale, n_obs, full=None, paged=False, sink_logits=None):
    """q [R, Hq, D] at positions q_pos over keys/values [N, Hkv, D] under (window, sink) per KV head,
    with the learned sink logits [Hq] (or None) in every softmax.

    Returns o [R, Hq, D] and, for the last n_obs queries, the attention mass each key receives
    (summed over those queries and all heads; float32 [N]) or None. ``full`` (bool [Hkv], on the
    host) marks heads that see their whole causal past: when (nearly) every position is a query
    (and there are no sink logits, which SDPA has no place for) they go through one causal SDPA
    (flash attention on a GPU). The other heads run the SegPaged kernel on a GPU (the buffers
    viewed as pages), a masked SDPA (an explicit softmax with sink logits) elsewhere."""
    r, hq, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    g = hq // hkv
    j = torch.arange(n, device=q.device)[None, None, :]
    w, s = window[:, None, None], sink[:, None, None]
    if (full is not None and sink_logits is None and bool(full.any())
            and r * _CAUSAL_MIN_SHARE[1] >= n * _CAUSAL_MIN_SHARE[0]):
        out = _attend_split(q, q_pos, keys, values, window, sink, scale, full, paged)
    elif paged:
        out = _attend_paged(q, q_pos, keys, values, window, sink, scale, sink_logits=sink_logits)
    elif sink_logits is not None:
        out = _attend_sinks(q, q_pos, keys, values, j, w, s, scale, sink_logits)
    else:
        out = _attend_masked(q, q_pos, keys, values, j, w, s, scale, g)
    mass = None
    if n_obs:
        with record_function("recover.attention_mass"):
            mass = observation_mass(q[-n_obs:], q_pos[-n_obs:], keys, window, sink, scale, sink_logits)
    return out, mass


def observation_mass(q_obs, p_obs, keys, window, sink, scale, sink_logits=None) -> torch.Tensor:
    """The attention mass each key [N] receives from the queries q_obs [o, Hq, D] at positions
    p_obs under (window, sink) per KV head, summed over those queries and all heads (fp32)."""
    n = torch.tensor([keys.shape[0]], device=q_obs.device)
    weight = torch.ones(1, q_obs.shape[0], device=q_obs.device)
    return observation_mass_batched(q_obs[None], p_obs[None], keys[None], n, weight, window, sink, scale,
                                    sink_logits)[0]


def observation_mass_batched(q_obs, p_obs, keys, key_lens, weight, window, sink, scale,
                             sink_logits=None) -> torch.Tensor:
    """``observation_mass`` of R requests at once: queries q_obs [R, o, Hq, D] at p_obs [R, o]
    (``weight`` [R, o] is 1 for a query that counts, 0 for padding) over keys [R, N, Hkv, D], of
    which row r has the first ``key_lens[r]``; sink_logits [Hq] or None. float32 [R, N] (0 past
    a row's keys)."""
    r, o, hq, d = q_obs.shape
    n, hkv = keys.shape[1], keys.shape[2]
    g = hq // hkv
    j = torch.arange(n, device=q_obs.device)[None, None, None, :]
    w, s = window.to(q_obs.device)[None, :, None, None], sink.to(q_obs.device)[None, :, None, None]
    mask = visible(p_obs[:, None, :, None], j, w, s) & (j < key_lens[:, None, None, None])  # [R, Hkv, o, N]
    scores = torch.einsum("rohgd,rkhd->rhgok", q_obs.reshape(r, o, hkv, g, d), keys).float() * scale  # fp32 softmax
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sink_logits is None:
        probs = scores.softmax(dim=-1)
    else:
        probs = softmax_with_sinks(scores, sink_logits.float().view(1, hkv, g, 1, 1))
    return (probs * weight[:, None, None, :, None]).sum(dim=(1, 2, 3))


def cross_chunk_mass(q, q_pos, keys, window, sink, scale, chunk_id, sink_logits=None) -> torch.Tensor:
    """Per query row: the attention mass it gives keys of chunks other than its own (keys outside
    any chunk, e.g. the prefix, count as its own context: its cache saw them), averaged over the KV
    heads that see the whole context here (all heads if none does); sink_logits [Hq] or None.
    float32 [R]; 0 for rows outside chunks."""
    n = keys.shape[0]
    heads = (window >= n).nonzero().flatten()
    if heads.numel() and sink_logits is None:
        return _cross_mass_causal(q, q_pos, keys, heads, scale, chunk_id)
    if heads.numel():  # with sink logits: those heads' softmax materialised
        g = q.shape[1] // keys.shape[1]
        qh = _query_heads(heads, g)
        return _cross_mass_blocked(q[:, qh], q_pos, keys[:, heads], window[heads], sink[heads], scale, chunk_id,
                                   sink_logits[qh])
    return _cross_mass_blocked(q, q_pos, keys, window, sink, scale, chunk_id, sink_logits)


def _cross_mass_causal(q, q_pos, keys, heads, scale, chunk_id) -> torch.Tensor:
    """``cross_chunk_mass`` over full-context heads as attention itself: with one-hot chunk
    indicators as the values, SDPA's output row is the mass the query gives each chunk, so the
    scores are never materialised (flash / memory-efficient kernels on a GPU). Column 1 + c is
    chunk c (column 0: keys outside chunks), in groups of D columns (one call up to D - 1 chunks).
    The other chunks' columns are summed, never "all minus own": a row that sees no other chunk
    gets exactly 0, as the materialised softmax gives, so ties rank the same way."""
    r, hq, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    g, dev = hq // hkv, q.device
    own = chunk_id[q_pos]
    out = torch.zeros(r, dtype=torch.float32, device=dev)
    if not bool((own >= 0).any()):
        return out
    qh = q.view(r, hkv, g, d)[:, heads].reshape(r, -1, d).transpose(0, 1)[None]  # [1, h*g, R, D]
    kh = keys[:, heads].transpose(0, 1)[None]  # [1, h, N, D]
    col = chunk_id + 1  # key -> its column
    padded = r * _CAUSAL_MIN_SHARE[1] >= n * _CAUSAL_MIN_SHARE[0]
    if padded:  # (nearly) every position is a query: zero rows at the others, one causal call
        qp = qh.new_zeros(1, qh.shape[1], n, d)
        qp[:, :, q_pos] = qh
    for c0 in range(0, int(chunk_id.max()) + 2, d):
        sel = (col >= c0) & (col < c0 + d)  # keys whose column is in this group (no host sync)
        values = torch.zeros(n, d, dtype=q.dtype, device=dev).scatter_(
            1, (col - c0).clamp(0, d - 1)[:, None], sel[:, None].to(q.dtype))
        v = values[None, None].expand(1, kh.shape[1], n, d)
        if padded:
            o = F.scaled_dot_product_attention(qp, kh, v, is_causal=True, scale=scale, enable_gqa=True)[0][:, q_pos]
        else:  # a few rows: block by block under an explicit causal mask
            o = torch.cat([F.scaled_dot_product_attention(
                qh[:, :, r0:r0 + _QUERY_BLOCK], kh, v, scale=scale, enable_gqa=True,
                attn_mask=torch.arange(n, device=dev)[None, :] <= q_pos[r0:r0 + _QUERY_BLOCK, None])[0]
                for r0 in range(0, r, _QUERY_BLOCK)], dim=1)
        cols = torch.arange(c0, c0 + d, device=dev)[None, :]
        other_chunks = (cols >= 1) & (cols != own[:, None] + 1)  # [R, D]
        out += (o.float().mean(0) * other_chunks).sum(-1)  # mean over the heads, then the other chunks
    return torch.where(own >= 0, out, torch.zeros((), device=dev))


def _cross_mass_blocked(q, q_pos, keys, window, sink, scale, chunk_id, sink_logits=None) -> torch.Tensor:
    """``cross_chunk_mass`` when no head sees the whole context (or there are sink logits): every
    head under its own (window, sink), the softmax materialised in fp32 query block by query block."""
    r, hq, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    g = hq // hkv
    k = keys.float()  # [N, h, D]
    w, s = window[:, None, None], sink[:, None, None]
    j = torch.arange(n, device=q.device)[None, None, :]
    out = torch.zeros(r, dtype=torch.float32, device=q.device)
    key_chunk = chunk_id[None, :]
    for r0 in range(0, r, _QUERY_BLOCK):
        pos = q_pos[r0:r0 + _QUERY_BLOCK]
        own = chunk_id[pos]
        if not bool((own >= 0).any()):
            continue
        qb = q[r0:r0 + _QUERY_BLOCK].view(-1, hkv, g, d).float()  # [b, h, g, D]
        p = pos[None, :, None]
        mask = visible(p, j, w, s)  # [h, b, N]
        scores = torch.einsum("bhgd,nhd->hgbn", qb, k) * scale
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        if sink_logits is None:
            probs = scores.softmax(dim=-1)
        else:
            probs = softmax_with_sinks(scores, sink_logits.float().view(hkv, g, 1, 1))
        other = (key_chunk >= 0) & (key_chunk != own[:, None])  # [b, N]
        mass = (probs * other[None, None]).sum(-1).mean(dim=(0, 1))  # [b]
        out[r0:r0 + _QUERY_BLOCK] = torch.where(own >= 0, mass, torch.zeros((), device=q.device))
    return out


# The causal SDPA path computes every position as a query (missing rows are zero-padded), so it
# is taken only when at least this share (4/5) of the positions are queries anyway.
_CAUSAL_MIN_SHARE = (4, 5)


def _attend_split(q, q_pos, keys, values, window, sink, scale, full, paged):
    """Full-context heads: one causal SDPA; the others: the kernel (or masked SDPA) on their own."""
    r, hq, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    g = hq // hkv
    dev = q.device
    kv_full = full.nonzero().flatten().to(dev)
    q_full = _query_heads(kv_full, g)
    everyone = kv_full.numel() == hkv
    qf = q if everyone else q[:, q_full]
    kf, vf = (keys, values) if everyone else (keys[:, kv_full], values[:, kv_full])
    if r < n:  # queries at some positions only: pad the rest with zeros, keep only real rows
        padded = qf.new_zeros(n, qf.shape[1], d)
        padded[q_pos] = qf
        qf = padded
    o = F.scaled_dot_product_attention(qf.transpose(0, 1)[None], kf.transpose(0, 1)[None],
                                       vf.transpose(0, 1)[None], is_causal=True, scale=scale,
                                       enable_gqa=True)[0].transpose(0, 1)
    if r < n:
        o = o[q_pos]
    if everyone:
        return o
    out = torch.empty_like(q)
    out[:, q_full] = o
    kv_rest = (~full).nonzero().flatten().to(dev)
    q_rest = _query_heads(kv_rest, g)
    qr = q[:, q_rest].contiguous()
    if paged:
        o = _attend_paged(qr, q_pos, keys, values, window[kv_rest], sink[kv_rest], scale, heads=kv_rest)
    else:
        j = torch.arange(n, device=dev)[None, None, :]
        o = _attend_masked(qr, q_pos, keys[:, kv_rest], values[:, kv_rest], j,
                           window[kv_rest][:, None, None], sink[kv_rest][:, None, None], scale, g)
    out[:, q_rest] = o
    return out


def _query_heads(kv_heads: torch.Tensor, g: int) -> torch.Tensor:
    """The query heads of these KV heads (g per KV head, consecutive)."""
    return (kv_heads[:, None] * g + torch.arange(g, device=kv_heads.device)).flatten()


PAGE = 64


def kv_buffer(n: int, n_kv: int, head_dim: int, dtype, device) -> torch.Tensor:
    """A zeroed [n, Hkv, D] K or V buffer whose storage is padded to whole pages, so the kernel
    can read it in place as pages (see _paged_view)."""
    return torch.zeros(-(-n // PAGE) * PAGE, n_kv, head_dim, dtype=dtype, device=device)[:n]


def _paged_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, Hkv, D] as SegPaged pages without a copy: page (lp, h) starts at token lp*PAGE of
    head h, so physical page id lp*PAGE*Hkv + h, page stride D and slot stride Hkv*D."""
    n, hkv, d = x.shape
    n_pages = -(-n // PAGE)
    if not x.is_contiguous() or x.untyped_storage().nbytes() < n_pages * PAGE * hkv * d * x.element_size():
        x = kv_buffer(n, hkv, d, x.dtype, x.device).copy_(x)  # not page-padded: one copy
    pages = x.as_strided(((n_pages - 1) * PAGE * hkv + hkv, PAGE, d), (d, hkv * d, 1))  # ids up to the last
    table = (torch.arange(n_pages, device=x.device)[None, :] * (PAGE * hkv)
             + torch.arange(hkv, device=x.device)[:, None]).to(torch.int32)[None]  # [1, Hkv, n_pages]
    return pages, table


def _attend_paged(q, q_pos, keys, values, window, sink, scale, heads=None, sink_logits=None):
    """The SegPaged prefill kernel reading the request's K/V buffers in place (only the KV heads
    ``heads`` when given: q then holds just their query heads, and sink_logits theirs)."""
    from ..kernels import segpaged_attention

    k_pages, table = _paged_view(keys)
    v_pages, _ = _paged_view(values)
    if heads is not None:
        table = table[:, heads].contiguous()
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    return segpaged_attention(q, k_pages, v_pages, table, cu, cu.new_tensor([keys.shape[0]]), window, sink,
                              scale, max_q_len=q.shape[0], q_pos=q_pos, sink_logits=sink_logits)


def _attend_masked(q, q_pos, keys, values, j, w, s, scale, g):
    r = q.shape[0]
    kb, vb = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, Hkv, N, D]
    out = torch.empty_like(q)
    for r0 in range(0, r, _QUERY_BLOCK):
        p = q_pos[r0:r0 + _QUERY_BLOCK][None, :, None]
        mask = visible(p, j, w, s)  # [Hkv, rows, N]
        qb = q[r0:r0 + _QUERY_BLOCK].transpose(0, 1)[None]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask.repeat_interleave(g, dim=0)[None],
                                            scale=scale, enable_gqa=True)
        out[r0:r0 + _QUERY_BLOCK] = ob[0].transpose(0, 1)
    return out


# Score elements per query block of the explicit softmax ([Hq, rows, N] fp32, 64 MiB).
_SCORE_ELEMS = 2**24


def _attend_sinks(q, q_pos, keys, values, j, w, s, scale, sink_logits):
    """``_attend_masked`` with learned sink logits [Hq]: the softmax materialised in fp32 (SDPA has
    no term without a value), in query blocks that bound the scores' memory."""
    r, hq, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    g = hq // hkv
    kf, vf = keys.float().transpose(0, 1), values.float().transpose(0, 1)  # [Hkv, N, D]
    sinks = sink_logits.float().view(hkv, g, 1, 1)
    out = torch.empty_like(q)
    rows = max(1, _SCORE_ELEMS // (hq * n))
    for r0 in range(0, r, rows):
        p = q_pos[r0:r0 + rows][None, :, None]
        mask = visible(p, j, w, s)  # [Hkv, rows, N]
        qb = q[r0:r0 + rows].float().view(-1, hkv, g, d)
        scores = torch.einsum("bhgd,hnd->hgbn", qb, kf) * scale
        probs = softmax_with_sinks(scores.masked_fill(~mask[:, None], float("-inf")), sinks)
        out[r0:r0 + rows] = torch.einsum("hgbn,hnd->bhgd", probs, vf).reshape(-1, hq, d).to(q.dtype)
    return out
