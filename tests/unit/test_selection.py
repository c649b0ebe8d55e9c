"""Retrieval-head selection (redknot.cache.selection) against float64 oracles, and at the
attention level: a retrieval head whose top-p is 1 equals a global head, through the torch
reference and through the Triton kernels (interpreter on CPU)."""

import os

DEVICE = os.environ.get("REDKNOT_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import math

import pytest
import torch

from redknot.cache import selection as S
from redknot.config import GLOBAL_WINDOW
from redknot.kernels.reference import segpaged_attention_ref


def _random_heads(seed, R=6, M=12, N=90, D=16, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, M, D, generator=g) * spread
    k = torch.randn(R, N, D, generator=g)
    q_pos = torch.sort(torch.randint(N // 2, N, (M,), generator=g)).values
    return q, k, q_pos


@pytest.mark.parametrize("seed", range(4))
def test_attention_mass_equals_float64(seed):
    q, k, q_pos = _random_heads(seed)
    g = torch.Generator().manual_seed(100 + seed)
    visible = torch.rand(q.shape[0], q.shape[1], k.shape[1], generator=g) < 0.7
    visible[0, 0] = False  # a row that sees nothing adds nothing
    for vis in (None, visible):
        got = S.attention_mass(q, k, q_pos, 0.3, vis)
        ref = S.attention_mass_ref(q, k, q_pos, 0.3, vis)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    # each row that sees something contributes exactly 1
    rows_seen = (torch.arange(k.shape[1])[None, None] <= q_pos[None, :, None]) & visible
    torch.testing.assert_close(S.attention_mass(q, k, q_pos, 0.3, visible).sum(1).double(),
                               rows_seen.any(-1).sum(-1).double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9, 0.99, 1.0])
def test_select_top_p_equals_float64_reference(seed, top_p):
    q, k, q_pos = _random_heads(seed)
    R, N = q.shape[0], k.shape[1]
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(1, 40, (R,), generator=g)
    sink = torch.randint(0, 6, (R,), generator=g)
    length = torch.randint(N - 20, N + 1, (R,), generator=g)
    mass64 = S.attention_mass_ref(q, k, q_pos, 0.3)
    pos, lens = S.select_top_p(mass64, length, window, sink, top_p)
    for r in range(R):
        ref = S.select_top_p_ref(mass64[r], int(length[r]), int(window[r]), int(sink[r]), top_p)
        assert pos[r, :lens[r]].tolist() == ref
        assert (pos[r, lens[r]:] == -1).all()
    # the device path (fp32 mass) agrees with the float64 one wherever the target is not on a knife edge
    pos32, lens32 = S.select_top_p(S.attention_mass(q, k, q_pos, 0.3), length, window, sink, top_p)
    for r in range(R):
        ref = S.select_top_p_ref(mass64[r], int(length[r]), int(window[r]), int(sink[r]), top_p)
        got = pos32[r, :lens32[r]].tolist()
        if got != ref:  # only on a knife edge: one token more or less, the target within fp32 rounding
            small, large = sorted((got, ref), key=len)
            assert len(large) - len(small) == 1 and set(small) <= set(large)
            n = int(length[r])
            m = mass64[r, :n]
            far = S.distant_mask(n, torch.tensor([n]), window[r:r + 1], sink[r:r + 1])[0]
            covered = m.sum() - m[far].sum() + m[small].sum()
            assert abs(float(covered - top_p * m.sum())) < 1e-5 * float(m.sum())


def test_select_top_p_properties():
    q, k, q_pos = _random_heads(7, R=5, N=120)
    mass = S.attention_mass(q, k, q_pos, 0.25)
    window, sink, length = torch.full((5,), 16), torch.full((5,), 4), torch.full((5,), 120)
    far = S.distant_mask(120, length, window, sink)
    prev = None
    for top_p in (0.2, 0.5, 0.8, 0.95, 1.0):
        pos, lens = S.select_top_p(mass, length, window, sink, top_p)
        for r in range(5):
            chosen = pos[r, :lens[r]].long()
            assert far[r, chosen].all()  # only distant tokens
            assert (chosen[1:] > chosen[:-1]).all()  # sorted, unique
            covered = mass[r].sum() - mass[r][far[r]].sum() + mass[r][chosen].sum()
            assert covered >= top_p * mass[r].sum() - 1e-4  # covers top_p
            if lens[r] > 0:  # and no smaller set would: dropping the lightest chosen token misses the target
                assert covered - mass[r][chosen].min() < top_p * mass[r].sum() + 1e-6
        if prev is not None:
            assert (lens >= prev).all()  # monotone in top_p
        prev = lens
    assert (lens == far.sum(1)).all()  # top_p = 1: every distant token
    capped, clen = S.select_top_p(mass, length, window, sink, 1.0, max_sel=7)
    assert (clen == 7).all() and capped.shape[1] == 7
    for r in range(5):  # the cap keeps the heaviest tokens
        kept = mass[r][capped[r].long()]
        rest = mass[r][far[r]].sort(descending=True).values
        torch.testing.assert_close(kept.sort(descending=True).values, rest[:7])


def test_select_top_p_rejects_bad_input():
    with pytest.raises(ValueError, match="top_p"):
        S.select_top_p(torch.ones(2, 10), 10, [3, 3], [0, 0], 0.0)
    with pytest.raises(ValueError, match="length"):
        S.select_top_p(torch.ones(2, 10), 11, [3, 3], [0, 0], 0.5)
    with pytest.raises(ValueError, match=r"\[R, N\]"):
        S.select_top_p(torch.ones(10), 10, [3], [0], 0.5)
    with pytest.raises(ValueError, match="q_pos"):
        S.attention_mass(torch.ones(2, 3, 4), torch.ones(2, 5, 4), torch.arange(4), 1.0)


def test_select_pages_and_positions():
    mass = torch.tensor([[5.0, 1.0, 3.0, 3.0, 0.5], [0.0, 2.0, 1.0, 9.0, 4.0]])
    cand = torch.tensor([[True, True, True, True, False], [False, True, True, False, True]])
    keep = S.select_pages(mass, cand, torch.tensor([2, 5]))
    assert keep.tolist() == [[True, False, True, False, False], [False, True, True, False, True]]
    pos, lens = S.pages_to_positions(keep, 4, limit=torch.tensor([20, 18]))
    assert pos[0, :lens[0]].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert pos[1, :lens[1]].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16, 17]
    torch.testing.assert_close(S.page_mass(torch.arange(10.0)[None], 4), torch.tensor([[6.0, 22.0, 17.0]]))


@pytest.mark.parametrize("seed", range(4))
def test_pages_to_positions_equals_every_position_of_the_kept_pages(seed):
    g = torch.Generator().manual_seed(seed)
    R, P, ps = 5, 9, 4
    keep = torch.rand(R, P, generator=g) < 0.4
    keep[0] = False  # a head keeping nothing
    limit = torch.randint(0, P * ps + 1, (R,), generator=g)
    for lim in (None, limit):
        pos, lens = S.pages_to_positions(keep, ps, width=P * ps + 3, limit=lim)
        assert pos.shape == (R, P * ps + 3) and pos.dtype == torch.int32
        for r in range(R):
            want = [p * ps + i for p in range(P) if keep[r, p] for i in range(ps)
                    if lim is None or p * ps + i < int(lim[r])]
            assert pos[r, :lens[r]].tolist() == want and (pos[r, lens[r]:] == -1).all()
    with pytest.raises(ValueError, match="does not fit width"):
        S.pages_to_positions(torch.ones(1, 3, dtype=torch.bool), ps, width=5)


# ---------------------------------------------------------------- at the attention level

def _paged_case(seed, seqs, hkv, hq, d, page):
    """Shuffled pages holding every position of every head (a retrieval head before selection)."""
    g = torch.Generator().manual_seed(seed)
    B = len(seqs)
    max_pages = max(math.ceil(n / page) for _, n in seqs)
    num = B * hkv * max_pages + 2
    perm = torch.randperm(num, generator=g)
    k_pages = torch.randn(num, page, d, generator=g)
    v_pages = torch.randn(num, page, d, generator=g)
    bt = perm[:B * hkv * max_pages].view(B, hkv, max_pages).to(torch.int32)
    q = torch.randn(sum(ql for ql, _ in seqs), hq, d, generator=g) * 2
    cu = torch.tensor([0] + [sum(ql for ql, _ in seqs[:i + 1]) for i in range(B)], dtype=torch.int32)
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    return q, k_pages, v_pages, bt, cu, lens


def _selection_for(k_pages, bt, lens, q, cu, window, sink, top_p, page, hq):
    """Per (sequence, KV head) selection from the last queries of each sequence, batched."""
    B, hkv, _ = bt.shape
    g = hq // hkv
    d = k_pages.shape[2]
    sels, nsels = [], []
    for b in range(B):
        n = int(lens[b])
        j = torch.arange(n)
        keys = k_pages[bt[b][:, j // page].long(), j % page]  # [Hkv, n, D]
        rows = q[cu[b]:cu[b + 1]]  # [m, Hq, D]
        m = rows.shape[0]
        qq = rows.view(m, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * m, d)
        q_pos = (n - m + torch.arange(m)).repeat(g)
        mass = S.attention_mass(qq, keys, q_pos, d ** -0.5)
        pos, ln = S.select_top_p(mass, n, window, sink, top_p, width=int(lens.max()))
        sels.append(pos)
        nsels.append(ln)
    return torch.stack(sels), torch.stack(nsels)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("seqs", [[(1, 70), (1, 45)], [(5, 70), (3, 33)]])
def test_retrieval_head_with_top_p_one_equals_a_global_head(kernel, seqs):
    hkv, hq, d, page = 2, 4, 16, 16
    q, k_pages, v_pages, bt, cu, lens = _paged_case(0, seqs, hkv, hq, d, page)
    window, sink = torch.tensor([9, 5], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    glob_w, glob_s = torch.full((hkv,), GLOBAL_WINDOW, dtype=torch.int32), torch.zeros(hkv, dtype=torch.int32)
    max_q = max(ql for ql, _ in seqs)
    sel, nsel = _selection_for(k_pages, bt, lens, q, cu, window, sink, 1.0, page, hq)
    sel_lo, nsel_lo = _selection_for(k_pages, bt, lens, q, cu, window, sink, 0.5, page, hq)
    if kernel == "torch":
        attend = segpaged_attention_ref
    else:
        pytest.importorskip("triton")
        from redknot.kernels.segpaged import segpaged_attention

        def attend(*args, **kw):  # on the test device (compiled on a GPU), compared on the CPU
            move = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
            return segpaged_attention(*map(move, args), **{k: move(v) for k, v in kw.items()}).cpu()
    dense = attend(q, k_pages, v_pages, bt, cu, lens, glob_w, glob_s, max_q_len=max_q)
    retr = attend(q, k_pages, v_pages, bt, cu, lens, window, sink, max_q_len=max_q,
                  sel_pos=sel.contiguous(), sel_lens=nsel.contiguous())
    torch.testing.assert_close(retr, dense, atol=1e-5, rtol=1e-5)
    # a smaller top-p really drops keys (the test can fail)
    part = attend(q, k_pages, v_pages, bt, cu, lens, window, sink, max_q_len=max_q,
                  sel_pos=sel_lo.contiguous(), sel_lens=nsel_lo.contiguous())
    assert (nsel_lo < nsel).all()
    assert (part - dense).abs().max() > 1e-3
    # and the kernel's selected output equals the torch reference under the same selection
    ref = segpaged_attention_ref(q, k_pages, v_pages, bt, cu, lens, window, sink, max_q_len=max_q,
                                 sel_pos=sel_lo, sel_lens=nsel_lo)
    torch.testing.assert_close(part, ref, atol=1e-5, rtol=1e-5)
