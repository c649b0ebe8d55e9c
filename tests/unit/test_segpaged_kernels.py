"""SegPagedAttention: torch reference vs dense oracle, Triton kernels vs reference.

Triton runs in the interpreter on CPU (TRITON_INTERPRET=1), so shapes are small. With
REDKNOT_TEST_DEVICE=cuda the same cases run compiled on a GPU.
"""

import math
import os

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

from redknot.kernels import (
    GLOBAL_WINDOW,
    dense_masked_attention,
    segpaged_attention_ref,
    segpaged_store_ref,
)

triton = pytest.importorskip("triton")
from redknot.kernels import segpaged  # noqa: E402

G = GLOBAL_WINDOW


# --------------------------------------------------------------------------------------------
# Random pools
# --------------------------------------------------------------------------------------------

def make_case(seqs, hq, hkv, d, page, windows, sinks, dtype=torch.float32, sel=None, seed=0,
              nan_tail=False, extra_pages=3):
    """A pool as redknot's page pool would leave it.

    seqs: [(q_len, seq_len)]; sel: optional [B][Hkv] lists of selected positions.
    Pages are shuffled (logical != physical); a local head keeps only its sink pages and the
    pages intersecting the window of the step's first query (-1 elsewhere); unused pages and
    slots hold garbage (random values; NaN past seq_len when nan_tail)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seqs)
    max_pages = max(math.ceil(sl / page) for _, sl in seqs) + 1  # spare column stays -1
    full_k = [torch.randn(sl, hkv, d, generator=gen) for _, sl in seqs]
    full_v = [torch.randn(sl, hkv, d, generator=gen) for _, sl in seqs]
    kept = []
    for b, (ql, sl) in enumerate(seqs):
        first = sl - ql
        n = math.ceil(sl / page)
        for h in range(hkv):
            lps = set(range(min(math.ceil(sinks[h] / page), n)))
            lps |= set(range(max(0, first - windows[h] + 1) // page, n))
            if sel is not None:
                lps |= {j // page for j in sel[b][h]}
            kept += [(b, h, lp) for lp in sorted(lps)]
    num_pages = len(kept) + extra_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    k_pages = torch.randn(num_pages, page, d, generator=gen) * 3
    v_pages = torch.randn(num_pages, page, d, generator=gen) * 3
    bt = torch.full((B, hkv, max_pages), -1, dtype=torch.int32)
    for i, (b, h, lp) in enumerate(kept):
        phys = perm[i]
        bt[b, h, lp] = phys
        lo, hi = lp * page, min((lp + 1) * page, seqs[b][1])
        k_pages[phys, : hi - lo] = full_k[b][lo:hi, h]
        v_pages[phys, : hi - lo] = full_v[b][lo:hi, h]
        if nan_tail and hi - lo < page:
            k_pages[phys, hi - lo:] = float("nan")
            v_pages[phys, hi - lo:] = float("nan")
    q_lens = [ql for ql, _ in seqs]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen)
    sel_pos = sel_lens = None
    if sel is not None:
        max_sel = max(1, max(len(s) for row in sel for s in row))
        sel_pos = torch.full((B, hkv, max_sel), -1, dtype=torch.int32)
        sel_lens = torch.zeros(B, hkv, dtype=torch.int32)
        for b in range(B):
            for h in range(hkv):
                s = sorted(sel[b][h])
                sel_pos[b, h, : len(s)] = torch.tensor(s, dtype=torch.int32)
                sel_lens[b, h] = len(s)
    return dict(
        q=q.to(dtype), k_pages=k_pages.to(dtype), v_pages=v_pages.to(dtype), block_tables=bt,
        cu_seqlens_q=cu, seq_lens=torch.tensor([sl for _, sl in seqs], dtype=torch.int32),
        window=torch.tensor(windows, dtype=torch.int32),
        sink=torch.tensor(sinks, dtype=torch.int32),
        max_q_len=max(q_lens), sel_pos=sel_pos, sel_lens=sel_lens,
        full_k=[x.to(dtype) for x in full_k], full_v=[x.to(dtype) for x in full_v], sel=sel,
    )


ATTN_KEYS = ("q", "k_pages", "v_pages", "block_tables", "cu_seqlens_q", "seq_lens", "window",
             "sink")


def _dev(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def run(fn, c, return_lse=True, sm_scale=None, **kw):
    """fn on case c; kw go to fn as they are (config= for the Triton kernel)."""
    out = fn(*[_dev(c[k]) for k in ATTN_KEYS], sm_scale=sm_scale, max_q_len=c["max_q_len"],
             sel_pos=_dev(c["sel_pos"]), sel_lens=_dev(c["sel_lens"]), return_lse=return_lse, **kw)
    return tuple(o.cpu() for o in out) if return_lse else out.cpu()


def dense(c):
    """Dense oracle, sequence by sequence, on contiguous K/V."""
    os_, ls_ = [], []
    cu = c["cu_seqlens_q"].tolist()
    for b in range(len(c["full_k"])):
        sel = None
        if c["sel"] is not None:
            sel = [torch.tensor(s, dtype=torch.long) for s in c["sel"][b]]
        o, lse = dense_masked_attention(c["q"][cu[b]:cu[b + 1]], c["full_k"][b], c["full_v"][b],
                                        c["window"], c["sink"], sel=sel, return_lse=True)
        os_.append(o)
        ls_.append(lse)
    return torch.cat(os_), torch.cat(ls_)


def close(a, b, tol):
    a, b = a.float().cpu(), b.float().cpu()
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# Cases: (seqs, hq, hkv, d, page, windows, sinks)
CASES = {
    # varlen: full prefill, chunked prefill (seq_len > q_len) and a q_len-1 row; GQA 2
    "varlen_gqa2": ([(37, 37), (50, 133), (1, 70)], 4, 2, 16, 16, [G, 20], [4, 0]),
    # GQA 1, head_dim 64, page 64, window 1 (sees only itself) + sink
    "gqa1_win1": ([(70, 200)], 2, 2, 64, 64, [1, G], [0, 3]),
    # GQA 4, window larger than the context, odd sinks
    "gqa4_bigwin": ([(29, 29), (45, 90)], 8, 2, 16, 16, [500, 7], [2, 5]),
    # GQA 8, head_dim 128 (small)
    "gqa8_d128": ([(20, 40)], 8, 1, 128, 16, [9], [1]),
    # mixed classes in one layer: global, local, window 1 without sink, local with big sink
    "mixed": ([(65, 190), (3, 3), (17, 61)], 8, 4, 16, 16, [G, 33, 1, 200], [4, 4, 0, 17]),
}


# --------------------------------------------------------------------------------------------
# Reference vs dense oracle
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_ref_matches_dense(name):
    c = make_case(*CASES[name], seed=1, nan_tail=True)
    o, lse = run(segpaged_attention_ref, c)
    o_d, lse_d = dense(c)
    close(o, o_d, 1e-5)
    close(lse, lse_d, 1e-5)


def test_ref_retrieval_matches_dense():
    sel = [[[3, 40, 41, 100], []], [[5], [0, 1, 2, 60, 61]]]
    c = make_case([(30, 150), (2, 70)], 4, 2, 16, 16, [10, 24], [2, 0], sel=sel, seed=2)
    o, lse = run(segpaged_attention_ref, c)
    o_d, lse_d = dense(c)
    close(o, o_d, 1e-5)
    close(lse, lse_d, 1e-5)


# --------------------------------------------------------------------------------------------
# Triton vs reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,blocks", [
    ("varlen_gqa2", (16, 16, 4, 1)),   # BLOCK_N == page: one lookup per tile
    ("varlen_gqa2", (32, 32, 4, 1)),   # BLOCK_N spans two pages: per-row lookup
    ("gqa1_win1", (32, 32, 4, 1)),     # BLOCK_N < page
    ("gqa4_bigwin", (16, 16, 4, 1)),
    ("gqa8_d128", (16, 16, 4, 1)),
    ("mixed", (32, 16, 4, 1)),
    ("mixed", None),                   # default (GPU) block sizes
])
def test_prefill_matches_ref(name, blocks):
    cfg = segpaged.KernelConfig(prefill=blocks)
    c = make_case(*CASES[name], seed=3, nan_tail=True)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


@pytest.mark.parametrize("name,blocks", [
    ("varlen_gqa2", (16, 16, 4, 1)),
    ("gqa1_win1", (32, 32, 4, 1)),   # BLOCK_N < page
    ("gqa4_bigwin", (16, 16, 4, 1)),
    ("gqa8_d128", (16, 16, 4, 1)),
    ("mixed", (32, 16, 4, 1)),
])
def test_prefill_tma_matches_ref(name, blocks):
    """The tensor-descriptor interior path against the reference (sinks, windows, varlen)."""
    cfg = segpaged.KernelConfig(prefill=blocks, tma=True)
    c = make_case(*CASES[name], seed=4, nan_tail=True)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_prefill_tma_random_configs(seed):
    """Random shapes through the descriptor path, checked against float64 attention too."""
    rng = torch.Generator().manual_seed(200 + seed)
    hkv, gqa, page = 1 + seed % 3, [1, 2, 4][seed], [16, 64, 32][seed]
    seqs = [(int(torch.randint(20, 90, (1,), generator=rng)), 0) for _ in range(2)]
    seqs = [(ql, ql + int(torch.randint(0, 120, (1,), generator=rng))) for ql, _ in seqs]
    windows = [G, 1 + 13 * seed, 50][:hkv]
    sinks = [0, 3, 16][:hkv]
    c = make_case(seqs, gqa * hkv, hkv, 16, page, windows, sinks, seed=seed, nan_tail=True)
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1), tma=True)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    c64 = dict(c, q=c["q"].double(), full_k=[k.double() for k in c["full_k"]],
               full_v=[v.double() for v in c["full_v"]])
    o_d, _ = dense(c64)
    cos = torch.nn.functional.cosine_similarity(o.double().flatten(), o_d.flatten(), dim=0)
    assert cos >= 0.99998
    close(o, o_d.float(), 1e-4)


def test_prefill_tma_rejects_what_it_cannot_serve():
    c = make_case(*CASES["varlen_gqa2"], seed=1)
    with pytest.raises(ValueError, match="must divide the page"):
        run(segpaged.segpaged_attention, c, config=segpaged.KernelConfig(prefill=(16, 32, 4, 1), tma=True))


def test_prefill_no_lse_and_scale():
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1))
    c = make_case(*CASES["gqa4_bigwin"], seed=4)
    o = run(segpaged.segpaged_attention, c, return_lse=False, sm_scale=0.3, config=cfg)
    o_r = run(segpaged_attention_ref, c, return_lse=False, sm_scale=0.3)
    close(o, o_r, 1e-4)


@pytest.mark.parametrize("seqs,hq,hkv,d,page,windows,sinks,per_split,min_tiles", [
    # q_len 1, GQA 4, several splits per head (2 tiles each)
    ([(1, 1), (1, 77), (1, 300)], 8, 2, 64, 16, [G, 40], [4, 0], 2, None),
    # q_len up to 4 (speculative decode), GQA 2, page 64, one tile per split
    ([(4, 130), (1, 9), (3, 200)], 4, 2, 16, 64, [17, G], [0, 2], 1, None),
    # GQA 8, head_dim 128, window 1, default split sizing
    ([(1, 150), (1, 33)], 8, 1, 128, 64, [1], [5], None, None),
    # GQA 1, mixed classes
    ([(2, 90), (1, 64)], 4, 4, 16, 16, [G, 1, 30, 100], [0, 0, 4, 64], 3, None),
    # tiles cut evenly over the splits: one tile a split, and three (some splits left empty)
    ([(1, 1), (1, 77), (2, 300)], 8, 2, 64, 16, [G, 40], [4, 0], None, 1),
    ([(1, 250), (3, 40)], 4, 2, 16, 16, [G, 100], [0, 4], None, 3),
])
def test_decode_matches_ref(seqs, hq, hkv, d, page, windows, sinks, per_split, min_tiles):
    cfg = segpaged.KernelConfig(decode=(16, 4, 1), decode_tiles_per_split=per_split,
                                decode_min_tiles_per_split=min_tiles)
    c = make_case(seqs, hq, hkv, d, page, windows, sinks, seed=5, nan_tail=True)
    assert c["max_q_len"] <= segpaged.DECODE_MAX_Q
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


@pytest.mark.parametrize("max_q_len", [30, 1])
def test_retrieval_matches_ref(max_q_len):
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1), decode=(16, 4, 1), decode_tiles_per_split=2)
    q_len = max_q_len
    sel = [[[3, 40, 41, 100, 140], []], [[5, 66], [0, 1, 2, 30, 60, 61]]]
    c = make_case([(q_len, 150), (1, 70)], 4, 2, 16, 16, [10, 24], [2, 0], sel=sel, seed=6)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


@pytest.mark.parametrize("max_q_len", [20, 1])
@pytest.mark.parametrize("page", [16, 8])
def test_selected_page_runs_match_ref(max_q_len, page):
    """Selected sets made of aligned runs of whole tiles (page-granular budgets) take the tile
    path; a ragged tail and a run overlapping the window still match the reference."""
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1), decode=(16, 4, 1), decode_tiles_per_split=2)
    runs = [list(range(16, 32)) + list(range(64, 80)) + [90, 91, 95],  # two runs + a ragged tail
            list(range(0, 16)) + list(range(112, 128)) + list(range(176, 192))]  # runs in the sink / window
    sel = [[runs[0], runs[1]], [list(range(32, 48)), [3, 17, 18]]]
    c = make_case([(max_q_len, 200), (1, 120)], 4, 2, 16, page, [24, 40], [4, 0], sel=sel, seed=9)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)
    o_d, lse_d = dense(c)
    close(o, o_d, 1e-4)


@pytest.mark.parametrize("max_q_len", [40, 1])
def test_bf16(max_q_len):
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1), decode=(16, 4, 1), decode_tiles_per_split=2)
    c = make_case([(max_q_len, 100), (1, 45)], 8, 2, 64, 16, [G, 20], [4, 0],
                  dtype=torch.bfloat16, seed=7)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    assert o.dtype == torch.bfloat16
    close(o, o_r, 2e-2)
    close(lse, lse_r, 2e-2)


@pytest.mark.parametrize("name", ["varlen_gqa2", "gqa4_bigwin"])
def test_prefill_merged_edge_loop(name):
    """All masked tiles of a block in one loop (merge_edges) computes the same thing."""
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1), merge_edges=True)
    c = make_case(*CASES[name], seed=12)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


@pytest.mark.parametrize("n_q", [1, 30])
def test_explicit_query_positions(n_q):
    """q_pos: a sorted subset of positions attends over the whole stored sequence (recovery)."""
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1))
    seq_len = 150
    c = make_case([(seq_len, seq_len)], 4, 2, 16, 16, [G, 20], [3, 0], seed=13)
    gen = torch.Generator().manual_seed(n_q)
    pos = torch.randperm(seq_len, generator=gen)[:n_q].sort().values
    pos[-1] = seq_len - 1
    c["q"] = c["q"][pos]
    c["cu_seqlens_q"] = torch.tensor([0, n_q], dtype=torch.int32)
    c["max_q_len"] = n_q
    q_pos = pos.to(torch.int32)
    o = segpaged.segpaged_attention(*[_dev(c[k]) for k in ATTN_KEYS], max_q_len=n_q, q_pos=_dev(q_pos),
                                    config=cfg).cpu()
    o_r = segpaged_attention_ref(*[c[k] for k in ATTN_KEYS], q_pos=q_pos)
    close(o, o_r, 1e-4)
    full = dense_masked_attention(make_case([(seq_len, seq_len)], 4, 2, 16, 16, [G, 20], [3, 0], seed=13)["q"],
                                  c["full_k"][0], c["full_v"][0], c["window"], c["sink"])
    close(o_r, full[pos], 1e-5)  # a subset of rows of the full prefill


@pytest.mark.parametrize("max_q_len", [40, 1])
def test_missing_pages_are_absent(max_q_len):
    """A -1 page inside the walked range contributes nothing, as in the reference. The pool never
    leaves one where a head can see (the fast interior path relies on that), so this holds for
    edge tiles, decode, and interior tiles with fast_interior off."""
    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1), decode=(16, 4, 1), decode_tiles_per_split=3,
                                fast_interior=False)
    c = make_case([(max_q_len, 160)], 4, 2, 16, 16, [G, 100], [4, 0], seed=10)
    c["block_tables"][0, 0, 2] = -1
    c["block_tables"][0, 1, 5] = -1
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


@pytest.mark.parametrize("seed", range(int(os.environ.get("SEGPAGED_FUZZ", 4))))
def test_random_configs(seed):
    """Seeded random shapes, windows, sinks and block sizes, both paths."""
    rng = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    decode = seed % 2 == 1
    gqa, hkv, page = pick([1, 2, 4, 8]), pick([1, 2, 3]), pick([16, 64])
    seqs = []
    for _ in range(rand(1, 3)):
        seq_len = rand(1, 200)
        q_len = rand(1, min(seq_len, 4 if decode else 70))
        seqs.append((q_len, seq_len))
    windows = [pick([G, 1, rand(1, 40), rand(1, 300)]) for _ in range(hkv)]
    sinks = [pick([0, rand(0, 20)]) for _ in range(hkv)]
    cfg = segpaged.KernelConfig(prefill=(pick([16, 32]), pick([16, 32]), 4, 1),
                                decode=(pick([16, 32]), 4, 1),
                                decode_tiles_per_split=pick([None, rand(1, 4)]),
                                decode_min_tiles_per_split=rand(1, 3), decode_max_q=4)
    c = make_case(seqs, gqa * hkv, hkv, 16, page, windows, sinks, seed=seed, nan_tail=True)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg)
    o_r, lse_r = run(segpaged_attention_ref, c)
    o_d, lse_d = dense(c)
    close(o_r, o_d, 1e-5)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


def test_bad_head_dim():
    c = make_case([(3, 3)], 2, 1, 48, 16, [G], [0])
    with pytest.raises(ValueError, match="power of 2"):
        run(segpaged.segpaged_attention, c)


# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page,dtype", [(16, torch.float32), (64, torch.bfloat16)])
def test_store_matches_ref(page, dtype):
    gen = torch.Generator().manual_seed(8)
    seqs = [(5, 40), (0, 10), (33, 33), (1, 140)]          # includes an empty sequence
    B, hkv, d = len(seqs), 2, 16
    max_pages = 4
    num_pages = B * hkv * max_pages + 2
    perm = torch.randperm(num_pages, generator=gen)[: B * hkv * max_pages]
    bt = perm.view(B, hkv, max_pages).to(torch.int32).clone()
    bt[torch.rand(bt.shape, generator=gen) < 0.3] = -1     # skipped pages
    if page == 16:
        bt = torch.cat([bt, torch.full((B, hkv, 6), -1, dtype=torch.int32)], -1)
    cu = torch.tensor([0] + [ql for ql, _ in seqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([sl for _, sl in seqs], dtype=torch.int32)
    k = torch.randn(int(cu[-1]), hkv, d, generator=gen).to(dtype)
    v = torch.randn(int(cu[-1]), hkv, d, generator=gen).to(dtype)
    kp = torch.randn(num_pages, page, d, generator=gen).to(dtype)
    vp = torch.randn(num_pages, page, d, generator=gen).to(dtype)
    kp_r, vp_r, kp_t, vp_t = kp.clone(), vp.clone(), _dev(kp.clone()), _dev(vp.clone())
    segpaged_store_ref(k, v, kp_r, vp_r, bt, cu, seq_lens)
    segpaged.segpaged_store(*map(_dev, (k, v)), kp_t, vp_t, *map(_dev, (bt, cu, seq_lens)))
    kp_t, vp_t = kp_t.cpu(), vp_t.cpu()
    assert not torch.equal(kp_r, kp)  # something was written
    assert torch.equal(kp_t, kp_r) and torch.equal(vp_t, vp_r)


def test_store_at_explicit_positions_matches_ref():
    """Rows stored at given positions (a recovery's scattered rows), not the sequence's last ones."""
    gen = torch.Generator().manual_seed(11)
    page, hkv, d, max_pages = 16, 2, 16, 5
    q_pos = [torch.tensor([0, 3, 17, 40, 41, 79]), torch.tensor([], dtype=torch.long), torch.tensor([2, 65])]
    B = len(q_pos)
    bt = torch.randperm(B * hkv * max_pages + 3, generator=gen)[:B * hkv * max_pages].view(B, hkv, max_pages)
    bt = bt.to(torch.int32).clone()
    bt[0, 1, 1] = -1  # a page a head does not keep: position 17 of head 1 is skipped
    cu = torch.tensor([0] + [p.numel() for p in q_pos]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([80, 10, 66], dtype=torch.int32)
    pos = torch.cat(q_pos).to(torch.int32)
    k = torch.randn(int(cu[-1]), hkv, d, generator=gen)
    v = torch.randn(int(cu[-1]), hkv, d, generator=gen)
    kp = torch.zeros(B * hkv * max_pages + 3, page, d)
    vp = torch.zeros_like(kp)
    kp_r, vp_r, kp_t, vp_t = kp.clone(), vp.clone(), _dev(kp.clone()), _dev(vp.clone())
    segpaged_store_ref(k, v, kp_r, vp_r, bt, cu, seq_lens, q_pos=pos)
    segpaged.segpaged_store(*map(_dev, (k, v)), kp_t, vp_t, *map(_dev, (bt, cu, seq_lens)), q_pos=_dev(pos))
    assert torch.equal(kp_t.cpu(), kp_r) and torch.equal(vp_t.cpu(), vp_r)
    for row, (b, p) in enumerate([(0, 0), (0, 3), (0, 17), (0, 40), (0, 41), (0, 79), (2, 2), (2, 65)]):
        for h in range(hkv):
            phys = int(bt[b, h, p // page])
            if phys < 0:
                continue
            assert torch.equal(kp_r[phys, p % page], k[row, h]) and torch.equal(vp_r[phys, p % page], v[row, h])
    assert int((kp_r.abs().sum(-1) > 0).sum()) == 8 * hkv - 1  # every row once, the skipped page not


def test_store_then_attend():
    """New tokens stored by the kernel are then attended to (chunked prefill step)."""
    seqs = [(24, 80), (1, 50)]
    c = make_case(seqs, 4, 2, 16, 16, [G, 12], [3, 0], seed=9)
    o_d, _ = dense(c)  # oracle on the CPU copy
    c = {key: _dev(val) for key, val in c.items()}
    cu = c["cu_seqlens_q"].tolist()
    # Wipe the new tokens from the pool, then store them back with the kernel.
    k_new = _dev(torch.cat([c["full_k"][b][sl - ql:] for b, (ql, sl) in enumerate(seqs)]))
    v_new = _dev(torch.cat([c["full_v"][b][sl - ql:] for b, (ql, sl) in enumerate(seqs)]))
    assert k_new.shape[0] == cu[-1]
    page = c["k_pages"].shape[1]
    for b, (ql, sl) in enumerate(seqs):
        for pos in range(sl - ql, sl):
            for h in range(2):
                phys = int(c["block_tables"][b, h, pos // page])
                if phys >= 0:
                    c["k_pages"][phys, pos % page] = 1e4
    segpaged.segpaged_store(k_new, v_new, c["k_pages"], c["v_pages"], c["block_tables"],
                            c["cu_seqlens_q"], c["seq_lens"])
    o = run(segpaged.segpaged_attention, c, return_lse=False)
    close(o, o_d, 1e-4)


# --------------------------------------------------------------------------------------------
# Learned attention sinks (gpt-oss): one logit per query head in the denominator, no value
# --------------------------------------------------------------------------------------------

def _sink_logits(hq, seed):
    # spread around the scores' scale: some heads dump most of their mass on the sink
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 3


def _eager_sinks_f64(q, k, v, window, sink, sink_logits):
    """transformers' gpt-oss eager attention in float64 for one sequence (the last q_len
    positions): logits, the sink column appended, the row max subtracted, softmax, sink dropped."""
    q_len, hq, d = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    p = torch.arange(n - q_len, n)[:, None]
    j = torch.arange(n)[None, :]
    mask = torch.stack([(j <= p) & ((j < int(sink[h])) | (p - j < int(window[h]))) for h in range(hkv)])
    mask = mask.repeat_interleave(g, 0)  # [Hq, Q, N]
    scores = torch.einsum("qhd,nhd->hqn", q.double(), k.double().repeat_interleave(g, 1)) * d**-0.5
    scores = scores.masked_fill(~mask, torch.finfo(torch.float64).min)
    logits = torch.cat([scores, sink_logits.double()[:, None, None].expand(hq, q_len, 1)], -1)
    probs = torch.softmax(logits - logits.max(-1, keepdim=True).values, -1)[..., :-1]
    return torch.einsum("hqn,nhd->qhd", probs, v.double().repeat_interleave(g, 1))


def test_sink_logits_float64():
    """Both references with sink logits equal transformers' eager formula in float64."""
    c = make_case(*CASES["mixed"], seed=20)
    sl = _sink_logits(8, 20)
    cu = c["cu_seqlens_q"].tolist()
    expect = torch.cat([_eager_sinks_f64(c["q"][cu[b]:cu[b + 1]], c["full_k"][b], c["full_v"][b], c["window"],
                                         c["sink"], sl) for b in range(len(c["full_k"]))])
    dense64 = torch.cat([dense_masked_attention(c["q"][cu[b]:cu[b + 1]].double(), c["full_k"][b].double(),
                                                c["full_v"][b].double(), c["window"], c["sink"], sink_logits=sl)
                         for b in range(len(c["full_k"]))])
    torch.testing.assert_close(dense64, expect, atol=1e-12, rtol=1e-12)
    o = run(segpaged_attention_ref, c, return_lse=False, sink_logits=sl)
    torch.testing.assert_close(o.double(), expect, atol=1e-5, rtol=1e-5)
    o_plain = run(segpaged_attention_ref, c, return_lse=False)
    assert (o - o_plain).abs().max() > 1e-2  # the sinks matter here


@pytest.mark.parametrize("name,blocks", [("varlen_gqa2", (16, 16, 4, 1)), ("mixed", (32, 16, 4, 1)),
                                         ("gqa4_bigwin", (16, 16, 4, 1))])
def test_prefill_sink_logits_match_ref(name, blocks):
    c = make_case(*CASES[name], seed=21, nan_tail=True)
    sl = _sink_logits(c["q"].shape[1], 21)
    cfg = segpaged.KernelConfig(prefill=blocks, merge_edges=name == "gqa4_bigwin")
    o, lse = run(segpaged.segpaged_attention, c, config=cfg, sink_logits=_dev(sl))
    o_r, lse_r = run(segpaged_attention_ref, c, sink_logits=sl)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)
    o_d, _ = dense(c)  # no sinks: the outputs must differ
    assert (o - o_d).abs().max() > 1e-2


@pytest.mark.parametrize("per_split", [1, None])
def test_decode_sink_logits_match_ref(per_split):
    """Split-KV decode: the sink enters once, in the merge, however many splits a head has."""
    cfg = segpaged.KernelConfig(decode=(16, 4, 1), decode_tiles_per_split=per_split)
    c = make_case([(1, 1), (3, 77), (1, 300)], 8, 2, 16, 16, [G, 40], [4, 0], seed=22, nan_tail=True)
    sl = _sink_logits(8, 22)
    o, lse = run(segpaged.segpaged_attention, c, config=cfg, sink_logits=_dev(sl))
    o_r, lse_r = run(segpaged_attention_ref, c, sink_logits=sl)
    close(o, o_r, 1e-4)
    close(lse, lse_r, 1e-4)


def test_sink_logits_explicit_positions_and_bf16():
    """Recovery rows (q_pos) and 16-bit inputs carry the sinks too; a gathered CPU decode agrees."""
    from redknot.kernels.reference import paged_decode_attention

    cfg = segpaged.KernelConfig(prefill=(16, 16, 4, 1), decode=(16, 4, 1), decode_tiles_per_split=2)
    c = make_case([(90, 90)], 8, 2, 64, 16, [G, 20], [3, 0], seed=23)
    sl = _sink_logits(8, 23)
    pos = torch.tensor([0, 5, 40, 41, 70, 89], dtype=torch.int32)
    keys = [k for k in ATTN_KEYS if k != "q"]
    cu = torch.tensor([0, 6], dtype=torch.int32)
    args = [c[k] if k != "cu_seqlens_q" else cu for k in keys]
    o = segpaged.segpaged_attention(_dev(c["q"][pos]), *map(_dev, args), max_q_len=6, q_pos=_dev(pos),
                                    config=cfg, sink_logits=_dev(sl)).cpu()
    o_r = segpaged_attention_ref(c["q"][pos], *args, q_pos=pos, sink_logits=sl)
    close(o, o_r, 1e-4)
    cb = make_case([(1, 100), (1, 45)], 8, 2, 64, 16, [G, 20], [4, 0], dtype=torch.bfloat16, seed=24)
    o, lse = run(segpaged.segpaged_attention, cb, config=cfg, sink_logits=_dev(sl))
    o_r, lse_r = run(segpaged_attention_ref, cb, sink_logits=sl)
    close(o, o_r, 2e-2)
    close(lse, lse_r, 2e-2)
    o_g = paged_decode_attention(cb["q"], cb["k_pages"], cb["v_pages"], cb["block_tables"], cb["seq_lens"],
                                 cb["window"], cb["sink"], 64**-0.5, 100, sink_logits=sl)
    close(o_g, o_r, 2e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="real head counts at bf16: compiled on a GPU (REDKNOT_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("window", [128, G])
@pytest.mark.parametrize("q_len", [1, 4, 700])
def test_sink_logits_bf16_gpt_oss_heads_on_gpu(window, q_len):
    """gpt-oss-20b's attention shape (64 query heads, 8 KV heads, head_dim 64) in bf16 with the
    built-in launch choices: sliding layers (window 128) and full ones, decode and prefill, against
    the reference on the same GPU."""
    seqs = [(q_len, 2000), (min(q_len, 300), 300), (1, 129)]
    c = make_case(seqs, 64, 8, 64, 64, [window] * 8, [0] * 8, dtype=torch.bfloat16, seed=30, nan_tail=True)
    sl = _sink_logits(64, 30)
    o, lse = run(segpaged.segpaged_attention, c, sink_logits=_dev(sl))
    o_r, lse_r = run(segpaged_attention_ref, c, sink_logits=_dev(sl))
    close(o, o_r, 2e-2)
    close(lse, lse_r, 2e-2)


# --------------------------------------------------------------------------------------------
# Decode with the merge folded into the split kernel (KernelConfig.decode_fused_merge)
# --------------------------------------------------------------------------------------------

def _fused_vs_two_kernel(c, tol, **kw):
    """The fused-merge decode equals the two-kernel decode and the reference on case c; returns
    the fused (o, lse). kw: decode= etc. for both KernelConfigs, and sink_logits."""
    sl = kw.pop("sink_logits", None)
    extra = {} if sl is None else {"sink_logits": sl}
    o_f, lse_f = run(segpaged.segpaged_attention, c, config=segpaged.KernelConfig(decode_fused_merge=True, **kw),
                     **{k: _dev(v) for k, v in extra.items()})
    o_2, lse_2 = run(segpaged.segpaged_attention, c, config=segpaged.KernelConfig(**kw),
                     **{k: _dev(v) for k, v in extra.items()})
    o_r, lse_r = run(segpaged_attention_ref, c, **extra)
    if DEVICE == "cpu":  # same fp32 merge, same order: bit for bit under the interpreter
        assert torch.equal(o_f, o_2) and torch.equal(lse_f, lse_2)
    else:  # compiled, the two launches may reduce in another order
        close(o_f, o_2, 1e-5 if c["q"].dtype == torch.float32 else 1e-2)
        close(lse_f, lse_2, 1e-5)
    close(o_f, o_r, tol)
    close(lse_f, lse_r, tol)
    return o_f, lse_f


def _assert_semaphores_zero(c):
    B, hkv = c["block_tables"].shape[:2]
    sem = segpaged._merge_semaphores(torch.device(DEVICE), B * hkv)
    assert sem.cpu().eq(0).all()


@pytest.mark.parametrize("seqs,hq,hkv,d,page,windows,sinks,per_split", [
    # q_len 1, GQA 4, one tile a split (many splits), a one-token sequence
    ([(1, 1), (1, 77), (1, 300)], 8, 2, 64, 16, [G, 40], [4, 0], 1),
    # q_len up to 4 with GQA 2, page 64, window + sink heads
    ([(4, 130), (1, 9), (3, 200)], 4, 2, 16, 64, [17, G], [0, 2], 1),
    # GQA 8, head_dim 128, window 1 + sink, built-in split count (some splits empty)
    ([(1, 150), (2, 33)], 8, 1, 128, 16, [1], [5], None),
    # GQA 1, mixed classes, three tiles a split
    ([(2, 90), (1, 64)], 4, 4, 16, 16, [G, 1, 30, 100], [0, 0, 4, 64], 3),
    # head_dim 64 with 16+ splits: the merge takes 4 rows a round, so 6 rows (GQA 2 x q_len 3)
    # take two rounds, the second half empty
    ([(3, 300), (1, 200)], 4, 2, 64, 16, [G, 40], [4, 0], 1),
])
def test_decode_fused_merge_matches_two_kernel(seqs, hq, hkv, d, page, windows, sinks, per_split):
    c = make_case(seqs, hq, hkv, d, page, windows, sinks, seed=40, nan_tail=True)
    _fused_vs_two_kernel(c, 1e-4, decode=(16, 4, 1), decode_tiles_per_split=per_split)
    _assert_semaphores_zero(c)


@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_fused_merge_selection_and_sink_logits(q_len):
    """H2O-style selections (aligned page runs and scattered positions) next to sink + window
    heads, learned sink logits in the merge, several splits a head."""
    sel = [[list(range(16, 32)) + list(range(64, 80)) + [90, 95], [3, 17, 18, 40]],
           [list(range(32, 48)), [0, 1, 2, 60, 61]]]
    c = make_case([(q_len, 200), (1, 120)], 8, 2, 16, 16, [24, 40], [4, 0], sel=sel, seed=41, nan_tail=True)
    _fused_vs_two_kernel(c, 1e-4, decode=(16, 4, 1), decode_tiles_per_split=1)
    _fused_vs_two_kernel(c, 1e-4, decode=(16, 4, 1), decode_tiles_per_split=1,
                         sink_logits=_sink_logits(8, 41))
    _assert_semaphores_zero(c)


def test_decode_fused_merge_no_lse_and_reuse():
    """Without return_lse, and a second call with new queries on the same semaphores: the
    counters were reset, so the second call's last split merges again."""
    cfg = segpaged.KernelConfig(decode=(16, 4, 1), decode_tiles_per_split=1, decode_fused_merge=True)
    c = make_case([(1, 100), (2, 45)], 8, 2, 16, 16, [G, 20], [4, 0], seed=42)
    B, hkv = c["block_tables"].shape[:2]
    sem = segpaged._merge_semaphores(torch.device(DEVICE), B * hkv)
    for step in range(2):
        c["q"] = torch.randn(c["q"].shape, generator=torch.Generator().manual_seed(step))
        o = run(segpaged.segpaged_attention, c, return_lse=False, config=cfg)
        close(o, run(segpaged_attention_ref, c, return_lse=False), 1e-4)
        assert segpaged._merge_semaphores(torch.device(DEVICE), B * hkv).data_ptr() == sem.data_ptr()
        assert sem.cpu().eq(0).all()


def test_decode_fused_merge_bf16():
    c = make_case([(1, 100), (1, 45)], 8, 2, 64, 16, [G, 20], [4, 0], dtype=torch.bfloat16, seed=43)
    o, _ = _fused_vs_two_kernel(c, 2e-2, decode=(16, 4, 1), decode_tiles_per_split=2)
    assert o.dtype == torch.bfloat16


@pytest.mark.skipif(DEVICE != "cuda", reason="a real H2O decode shape: compiled on a GPU (REDKNOT_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_fused_merge_h2o_shape_on_gpu(q_len):
    """32K context, 8 KV heads with GQA 4, head_dim 128, B=8, bf16, page 64, a 10% budget (sink 4,
    window 256, whole heavy-hitter pages): fused merge vs the two-kernel decode and the reference
    with the built-in launch choices, sink logits on the second pass, repeated to reuse the
    semaphores."""
    B, L, hkv, page, window = 8, 32768, 8, 64, 256
    gen = torch.Generator().manual_seed(44)
    heavy = (L // 10) // page - 1 - window // page
    sel = [[(torch.randperm(L // page - window // page - 2, generator=gen)[:heavy] + 1).sort().values
            for _ in range(hkv)] for _ in range(B)]
    sel = [[[int(p) * page + i for p in row for i in range(page)] for row in s] for s in sel]
    c = make_case([(q_len, L)] * B, 4 * hkv, hkv, 128, page, [window] * hkv, [4] * hkv,
                  dtype=torch.bfloat16, sel=sel, seed=44)
    for sl in (None, _sink_logits(4 * hkv, 44)):
        for _ in range(2):
            _fused_vs_two_kernel(c, 2e-2, sink_logits=sl)
    _assert_semaphores_zero(c)
