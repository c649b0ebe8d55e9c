"""Selected sets of retrieval heads and heavy-hitter (H2O) heads, batched over heads.

A retrieval head sees its sink, its recent window and a selected set of distant tokens
(docs/segpaged.md). The set is chosen from attention mass: the softmax probabilities a few
queries give every key, summed over the queries (and over the query heads of the KV head's GQA
group). Two scorers feed the same mass function:

* ``snapkv``: the observation window, i.e. the last prompt queries (SnapKV);
* ``h2o``: every query seen so far, accumulated (Heavy-Hitter Oracle); in decode, the engine adds
  the mass of decode queries to the prompt's.

``select_top_p`` then picks, for every head at once, the fewest distant tokens (outside sink and
window) that together with what sink and window already cover hold ``top_p`` of the mass, and
writes them as the kernels' ``sel_pos`` / ``sel_lens``. ``select_pages`` is the page-granular
form used under a decode budget: the ``n`` distant pages of largest accumulated mass.

Everything runs on the mass tensor's device with no loop over heads; the float64 functions at
the end are the readable oracles tests compare against.
"""

from __future__ import annotations

import math

import torch

from .. import visibility
from ..kernels.reference import softmax_with_sinks

# Scores of one chunk of heads take at most this many bytes (fp32 [R, M, N]).
_CHUNK_BYTES = 256 << 20


def attention_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float,
                   visible: torch.Tensor | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Summed softmax probabilities per key, for R heads at once.

    q [R, M, D]: M query rows per head (e.g. group x observation queries), k [R, N, D]: the head's
    keys at positions 0..N-1, q_pos int [M] or [R, M]: each row's position (a row sees key j iff
    j <= q_pos, and ``visible`` [R, M, N] bool if given, e.g. the head's own visibility rule and
    which keys are stored); ``sink_logits`` [R, M]: each row's learned sink logit, in its softmax
    denominator (gpt-oss). Returns float32 [R, N]: sum over rows of p(row -> j); a row that sees
    nothing adds nothing. Math in fp32; heads are processed in chunks to bound memory."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention_mass: q must be [R, M, D] and k [R, N, D]; got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    R, M, _ = q.shape
    N = k.shape[1]
    q_pos = q_pos.to(q.device).long()
    if q_pos.dim() == 1 and q_pos.shape[0] == M:
        q_pos = q_pos.expand(R, M)
    if q_pos.shape != (R, M):
        raise ValueError(f"attention_mass: q_pos must be [M] or [R, M] with M={M}, got {tuple(q_pos.shape)}")
    if visible is not None and visible.shape != (R, M, N):
        raise ValueError(f"attention_mass: visible must be [R, M, N] = {(R, M, N)}, got {tuple(visible.shape)}")
    out = torch.zeros(R, N, dtype=torch.float32, device=q.device)
    if R == 0 or M == 0 or N == 0:
        return out
    step = max(1, _CHUNK_BYTES // max(1, 4 * M * N))
    j = torch.arange(N, device=q.device)
    for r0 in range(0, R, step):  # chunks of heads, not one head at a time
        r1 = min(R, r0 + step)
        s = torch.einsum("rmd,rnd->rmn", q[r0:r1].float(), k[r0:r1].float()) * scale
        seen = j[None, None, :] <= q_pos[r0:r1, :, None]
        if visible is not None:
            seen = seen & visible[r0:r1]
        s = s.masked_fill(~seen, float("-inf"))
        if sink_logits is None:
            p = torch.softmax(s, dim=-1)
        else:
            p = softmax_with_sinks(s, sink_logits[r0:r1, :, None].float())
        out[r0:r1] = torch.nan_to_num(p, nan=0.0).sum(1)  # rows seeing nothing: NaN -> 0
    return out


def distant_mask(n: int, length: torch.Tensor, window: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """bool [R, n]: key j < length is distant for the head's next query (at p = length): neither
    a sink token (j < sink) nor inside the window (length - j < window)."""
    j = torch.arange(n, device=window.device)[None, :]
    length = length.to(window.device).long().reshape(-1, 1)
    return (j < length) & ~visibility.visible(length, j, window.long()[:, None], sink.long()[:, None])


def select_top_p(mass: torch.Tensor, length, window, sink, top_p, max_sel: int | None = None,
                 width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fewest distant tokens covering ``top_p`` of every head's mass, for R heads at once.

    mass [R, N] (from ``attention_mass``); length: int or [R] (keys at positions >= length are
    ignored); window, sink: [R] (the head's plan once selected); top_p: float or [R] in (0, 1].
    A head keeps sink + window, whose mass counts toward the target; then distant tokens in
    decreasing mass until sink + window + selection hold at least ``top_p`` of the head's total
    mass. top_p >= 1 selects every distant token. ``max_sel`` caps each set (the largest-mass
    tokens are kept). Returns sel_pos int32 [R, width] (sorted, -1 padded; width defaults to the
    largest set) and sel_lens int32 [R]."""
    if mass.dim() != 2:
        raise ValueError(f"select_top_p: mass must be [R, N], got {tuple(mass.shape)}")
    R, N = mass.shape
    dev = mass.device
    window = torch.as_tensor(window, device=dev).long().reshape(-1).expand(R)
    sink = torch.as_tensor(sink, device=dev).long().reshape(-1).expand(R)
    length = torch.as_tensor(length, device=dev).long().reshape(-1).expand(R)
    top_p = torch.as_tensor(top_p, dtype=torch.float64, device=dev).reshape(-1).expand(R)
    if ((top_p <= 0) | (top_p > 1)).any():
        raise ValueError("select_top_p: top_p must be in (0, 1]")
    if (length > N).any():
        raise ValueError(f"select_top_p: length {int(length.max())} > the {N} keys of mass")
    far = distant_mask(N, length, window, sink)
    m = mass.double().clamp_min(0)
    m = torch.where(torch.arange(N, device=dev)[None, :] < length[:, None], m, 0.0)
    total = m.sum(1)
    covered = torch.where(far, 0.0, m).sum(1)
    vals, order = torch.where(far, m, -1.0).sort(dim=1, descending=True, stable=True)
    n_far = far.sum(1)
    before = vals.clamp_min(0).cumsum(1) - vals.clamp_min(0)  # mass selected before each candidate
    # candidate i is taken iff the target is still not reached without it (and it is distant)
    need = (covered[:, None] + before < top_p[:, None] * total[:, None]) & (torch.arange(N, device=dev) < n_far[:, None])
    k = torch.where(top_p >= 1, n_far, need.sum(1))
    if max_sel is not None:
        k = k.clamp_max(int(max_sel))
    return _positions(order, k, width)


def _positions(order: torch.Tensor, k: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k[r] entries of each row of ``order``, sorted ascending, -1 padded to width."""
    R, N = order.shape
    big = torch.iinfo(torch.int64).max
    taken = torch.arange(N, device=order.device)[None, :] < k[:, None]
    pos = torch.where(taken, order, big).sort(dim=1).values
    w = int(k.max()) if width is None and R else (width or 0)
    if w > N:
        pos = torch.cat([pos, torch.full((R, w - N), big, dtype=pos.dtype, device=pos.device)], 1)
    pos = pos[:, :w]
    if (k > w).any():
        raise ValueError(f"selection of {int(k.max())} tokens does not fit width {w}")
    pos = torch.where(pos == big, -1, pos)
    return pos.to(torch.int32), k.to(torch.int32)


def page_mass(mass: torch.Tensor, page_size: int) -> torch.Tensor:
    """[R, N] per-key mass -> [R, ceil(N / page_size)] per-page mass."""
    R, N = mass.shape
    P = -(-N // page_size)
    pad = torch.zeros(R, P * page_size - N, dtype=mass.dtype, device=mass.device)
    return torch.cat([mass, pad], 1).view(R, P, page_size).sum(-1)


def select_pages(mass: torch.Tensor, candidate: torch.Tensor, n_pages) -> torch.Tensor:
    """bool [R, P]: for each head the ``n_pages`` candidate pages of largest mass (ties: the
    earlier page), all candidates when there are fewer. mass [R, P], candidate bool [R, P],
    n_pages int or [R]."""
    R, P = mass.shape
    n = torch.as_tensor(n_pages, device=mass.device).long().reshape(-1).expand(R).clamp_min(0)
    vals = torch.where(candidate, mass.double(), -math.inf)
    order = vals.sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(P, device=mass.device).expand(R, P).contiguous())
    return candidate & (rank < n[:, None])


def pages_to_positions(keep: torch.Tensor, page_size: int, width: int | None = None,
                       limit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [R, P] pages -> (sel_pos int32 [R, width] sorted -1 padded, sel_lens int32 [R]):
    every position of each kept page (below ``limit`` [R] if given). Only pages are ordered (a
    stable sort of [R, P]); positions follow from them in order."""
    R, P = keep.shape
    dev = keep.device
    n_pages = keep.sum(1)
    m = int(n_pages.max()) if R else 0
    pages = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :m]  # kept pages first, ascending
    pos = (pages[:, :, None] * page_size + torch.arange(page_size, device=dev)).flatten(1)  # [R, m * page_size]
    ok = (torch.arange(m, device=dev)[None, :] < n_pages[:, None]).repeat_interleave(page_size, dim=1)
    if limit is not None:  # positions ascend along a row, so what the limit cuts is its tail
        ok = ok & (pos < torch.as_tensor(limit, device=dev).long().reshape(-1, 1))
    k = ok.sum(1)
    w = int(k.max()) if width is None and R else (width or 0)
    if (k > w).any():
        raise ValueError(f"selection of {int(k.max())} tokens does not fit width {w}")
    pos = torch.where(ok, pos, -1)
    if w > pos.shape[1]:
        pos = torch.cat([pos, torch.full((R, w - pos.shape[1]), -1, dtype=pos.dtype, device=dev)], 1)
    return pos[:, :w].to(torch.int32), k.to(torch.int32)


# ------------------------------------------------------------------ float64 oracles

def attention_mass_ref(q, k, q_pos, scale, visible=None, sink_logits=None) -> torch.Tensor:
    """attention_mass in float64, one head and one row at a time (sink_logits [R, M]: each row's
    extra denominator term)."""
    R, M, _ = q.shape
    N = k.shape[1]
    out = torch.zeros(R, N, dtype=torch.float64)
    q_pos = q_pos.long().expand(R, M) if q_pos.dim() == 1 else q_pos.long()
    for r in range(R):
        for m in range(M):
            seen = torch.arange(N) <= q_pos[r, m]
            if visible is not None:
                seen &= visible[r, m].cpu()
            if not seen.any():
                continue
            s = (k[r].double().cpu() @ q[r, m].double().cpu()) * scale
            s[~seen] = -math.inf
            if sink_logits is None:
                out[r] += torch.softmax(s, 0)
            else:
                e = torch.exp(s - s.max())
                out[r] += e / (e.sum() + torch.exp(sink_logits[r, m].double().cpu() - s.max()))
    return out


def select_top_p_ref(mass, length: int, window: int, sink: int, top_p: float) -> list[int]:
    """select_top_p for one head in plain Python (float64): sorted selected positions."""
    m = [max(0.0, float(x)) for x in mass[:length]]
    far = [j for j in range(length) if not visibility.visible(length, j, window, sink)]
    total = sum(m)
    have = total - sum(m[j] for j in far)
    if top_p >= 1:
        return far
    chosen = []
    for j in sorted(far, key=lambda j: (-m[j], j)):
        if have >= top_p * total:
            break
        chosen.append(j)
        have += m[j]
    return sorted(chosen)
