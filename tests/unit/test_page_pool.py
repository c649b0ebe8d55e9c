"""PagePool: allocation, refcounts, per-head trimming (docs/segpaged.md visibility rule)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from redknot.cache import PagePool, PoolExhausted
from redknot.cache.pool import GLOBAL_WINDOW

G = GLOBAL_WINDOW


def brute_needed(n, W, S, ps):
    """bool [ceil(n/ps)]: logical pages holding a position a query at p = n (or later) can see.

    Straight from the rule `j < S or p - j < W`, position by position. Positions >= n in the last
    page are written by later steps, so that page is needed too.
    """
    j = np.arange(math.ceil(n / ps) * ps)  # every position, page by page
    return ((j >= n) | (j < S) | (n - j < W)).reshape(-1, ps).any(axis=1)


def check_pool(pool, shared=False, trimmed=True):
    """Every sequence stores its visible pages (exactly those once trimmed); refcounts and the
    free list add up."""
    refs = np.zeros(pool.num_pages, np.int64)
    for sid, s in pool._seqs.items():
        tbl = pool.table(sid)
        n = pool.length(sid)
        for l in range(pool.num_layers):
            for h in range(pool.num_kv_heads):
                need = brute_needed(n, pool.window[l, h], pool.sink[l, h], pool.page_size)
                stored = tbl[l, h] >= 0
                assert (stored[need]).all(), f"seq {sid} l{l} h{h} n{n}: visible page missing"
                if trimmed:
                    np.testing.assert_array_equal(stored, need, err_msg=f"seq {sid} l{l} h{h} n{n}")
        assert (s.table[:, :, tbl.shape[2]:] == -1).all()
        np.add.at(refs, tbl[tbl >= 0], 1)
    if not shared:  # private pages: every physical page appears once
        assert refs.max(initial=0) <= 1
        np.testing.assert_array_equal(refs, pool._ref)
    free = pool._free[:pool.num_free_pages]
    assert len(set(free.tolist())) == free.size
    assert (pool._ref[free] == 0).all()
    assert pool.num_free_pages + (pool._ref > 0).sum() == pool.num_pages


def mixed_pool(num_pages=4096, ps=4):
    window = torch.tensor([[G, 8, 20, G], [5, G, 1, 33]])
    sink = torch.tensor([[0, 4, 0, 0], [2, 0, 3, 1]])
    return PagePool(num_pages, ps, head_dim=8, window=window, sink=sink)


def test_alloc_and_free_global():
    pool = PagePool(64, 4, 8, window=np.full((2, 2), G), sink=np.zeros((2, 2)))
    pool.add_sequence(7)
    pool.ensure(7, 10)  # 3 pages per head
    assert pool.length(7) == 10
    assert pool.num_free_pages == 64 - 12
    assert pool.trim(7) == 0  # global heads never lose pages
    tbl = pool.table(7)
    assert tbl.shape == (2, 2, 3) and len(set(tbl.ravel().tolist())) == 12
    pool.ensure(7, 12)  # fills the partial page: no new page
    assert pool.num_free_pages == 64 - 12
    pool.ensure(7, 13)
    assert pool.num_free_pages == 64 - 16
    check_pool(pool)
    pool.free_sequence(7)
    assert pool.num_free_pages == 64 and (pool._ref == 0).all()
    assert pool.bytes_per_page == 2 * 4 * 8 * 4


def test_exhaustion_is_all_or_nothing():
    pool = mixed_pool(num_pages=20, ps=4)
    pool.add_sequence(0)
    pool.ensure(0, 8)  # 2 pages x 8 heads = 16
    before = (pool.num_free_pages, pool.table(0).copy(), pool._ref.copy())
    with pytest.raises(PoolExhausted, match="needs 8 pages, only 4"):
        pool.ensure(0, 9)
    assert isinstance(PoolExhausted("x"), RuntimeError)
    assert pool.num_free_pages == before[0] and pool.length(0) == 8
    np.testing.assert_array_equal(pool.table(0), before[1])
    np.testing.assert_array_equal(pool._ref, before[2])
    pool.add_sequence(1)
    with pytest.raises(PoolExhausted):
        pool.ensure(1, 1)
    assert pool.length(1) == 0 and pool.num_free_pages == 4
    assert pool.trim(0) == 1  # the window-1 head drops page 1
    pool.free_sequence(0)  # now it fits
    pool.ensure(1, 1)
    check_pool(pool)


def test_decode_loop_local_bounded_global_grows():
    pool = mixed_pool()
    ps = pool.page_size
    bound = -(-pool.sink // ps) + -(-pool.window // ps) + 1
    pool.add_sequence(0)
    pool.ensure(0, 37)
    pool.trim(0)
    prev_global = pool.occupancy()["global"]
    local_max = 0
    for n in range(38, 38 + 300):
        free0 = pool.num_free_pages
        need = pool.pages_needed(n, n - 1)
        pool.ensure(0, n)
        assert free0 - pool.num_free_pages == need.peak
        pool.trim(0)
        assert free0 - pool.num_free_pages == need.kept
        per_head = (pool.table(0) >= 0).sum(-1)
        loc = ~pool.is_global
        assert (per_head[loc] <= bound[loc]).all()
        assert (per_head[pool.is_global] == math.ceil(n / ps)).all()
        occ = pool.occupancy()
        assert occ["global"] >= prev_global
        prev_global = occ["global"]
        local_max = max(local_max, occ["local"])
        assert occ["global"] + occ["local"] + occ["free"] == occ["total"]
    assert occ["global"] == pool.is_global.sum() * math.ceil(n / ps)
    assert local_max <= bound[~pool.is_global].sum()
    check_pool(pool)
    pool.free_sequence(0)
    assert pool.num_free_pages == pool.num_pages


def test_pages_needed_prefill_chunks():
    pool = mixed_pool()
    pool.add_sequence(0)
    n = 0
    for step in [1, 7, 16, 3, 64, 1, 1, 100, 5]:
        free0 = pool.num_free_pages
        need = pool.pages_needed(n + step, n)
        pool.ensure(0, n + step)
        assert free0 - pool.num_free_pages == need.peak
        pool.trim(0)
        assert free0 - pool.num_free_pages == need.kept
        n += step
    # From scratch equals the sum of the steps after trim.
    held = pool.num_pages - pool.num_free_pages
    assert pool.pages_needed(n).kept == held
    with pytest.raises(ValueError):
        pool.pages_needed(3, 5)


def test_free_sequence_returns_every_page():
    pool = mixed_pool(num_pages=1000)
    for sid, n in [(3, 50), (9, 1), (4, 17)]:
        pool.add_sequence(sid)
        pool.ensure(sid, n)
    check_pool(pool, trimmed=False)
    for sid in (3, 4, 9):
        pool.trim(sid)
    pool.ensure(9, 30)
    check_pool(pool, trimmed=False)
    pool.trim(9)
    check_pool(pool)
    for sid in (9, 3, 4):
        pool.free_sequence(sid)
    assert pool.num_free_pages == 1000 and (pool._ref == 0).all()
    assert sorted(pool._free.tolist()) == list(range(1000))
    with pytest.raises(KeyError, match="unknown sequence"):
        pool.length(3)


def test_shared_pages_survive_until_last_owner():
    pool = PagePool(100, 4, 8, window=np.array([[G, 3]]), sink=np.array([[0, 1]]))
    pool.add_sequence("chunk")
    pool.ensure("chunk", 10)  # 3 pages per head, last one partial
    pool.trim("chunk")
    tbl = pool.table("chunk")
    pages = tbl[tbl >= 0]
    pool.k_pages[torch.from_numpy(pages.astype(np.int64))] = 1.0 + torch.arange(pages.size)[:, None, None].float()
    used = pool.num_pages - pool.num_free_pages

    pool.add_sequence(1)
    pool.share(1, tbl, 10)
    assert pool.length(1) == 10 and (pool._ref[pages] == 2).all()
    assert pool.num_pages - pool.num_free_pages == used  # sharing allocates nothing
    pool.free_sequence("chunk")
    assert (pool._ref[pages] == 1).all()  # seq 1 still holds them
    pool.add_sequence(2)
    pool.share(2, pool.table(1), 10)

    # Appending to the shared partial page copies it first (copy on write).
    last = tbl[:, :, 2]
    pool.ensure(1, 11)
    new_last = pool.table(1)[:, :, 2]
    assert (new_last != last).all()
    torch.testing.assert_close(pool.k_pages[torch.from_numpy(new_last.ravel().astype(np.int64))],
                               pool.k_pages[torch.from_numpy(last.ravel().astype(np.int64))])
    assert (pool._ref[last] == 1).all()  # only seq 2 holds the original now
    np.testing.assert_array_equal(pool.table(1)[:, :, :2], tbl[:, :, :2])
    pool.trim(1)
    check_pool(pool, shared=True)

    # A chunk store can keep pages alive without a sequence.
    pool.retain(pool.table(2))
    pool.free_sequence(1)
    pool.free_sequence(2)
    assert (pool._ref[pages] == 1).all()
    pool.release(tbl)
    assert pool.num_free_pages == pool.num_pages
    with pytest.raises(ValueError, match="double free"):
        pool.release(tbl)


def test_share_at_page_offset_and_errors():
    pool = mixed_pool(num_pages=500)
    pool.add_sequence("c")
    pool.ensure("c", 8)
    pool.add_sequence(0)
    pool.ensure(0, 4)
    with pytest.raises(ValueError, match="must end at"):
        pool.share(0, pool.table("c"), 8, first_page=2)
    pool.share(0, pool.table("c"), 8, first_page=1)
    assert pool.length(0) == 12
    np.testing.assert_array_equal(pool.table(0)[:, :, 1:], pool.table("c"))
    with pytest.raises(ValueError, match="tables must be"):
        pool.share(0, np.zeros((1, 4, 2), np.int32), 8, first_page=3)
    with pytest.raises(ValueError, match="already exists"):
        pool.add_sequence(0)
    with pytest.raises(ValueError):
        pool.ensure(0, 3)
    with pytest.raises(ValueError, match="window"):
        PagePool(10, 4, 8, window=np.zeros((2, 2)), sink=np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"\[L, Hkv\]"):
        PagePool(10, 4, 8, window=np.ones((2, 2)), sink=np.zeros((2, 3)))


def test_block_tables_and_seq_lens():
    pool = mixed_pool(num_pages=2000, ps=4)
    lens = {10: 45, 11: 3, 12: 130}
    for sid, n in lens.items():
        pool.add_sequence(sid)
        pool.ensure(sid, n)
        pool.trim(sid)
    ids = [12, 10, 11]
    bt = pool.block_tables(ids)
    assert bt.dtype == torch.int32 and bt.shape == (2, 3, 4, math.ceil(130 / 4))
    np.testing.assert_array_equal(pool.seq_lens(ids).numpy(), [130, 45, 3])
    assert pool.seq_lens(ids).dtype == torch.int32
    valid = bt[bt >= 0]
    assert valid.unique().numel() == valid.numel()  # distinct physical pages
    for b, sid in enumerate(ids):
        n = lens[sid]
        for l in range(2):
            for h in range(4):
                need = brute_needed(n, pool.window[l, h], pool.sink[l, h], 4)
                row = bt[l, b, h].numpy()
                np.testing.assert_array_equal(row[:need.size] >= 0, need)
                assert (row[need.size:] == -1).all()  # padding past the sequence
    # Transient state (before trim) stores every page of the step, also for local heads.
    pool.ensure(11, 40)
    assert (pool.block_tables([11])[:, 0, :, :10] >= 0).all()


@settings(max_examples=60, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 3, 4, 8, 16]),
    L=st.integers(1, 3), H=st.integers(1, 4),
    data=st.data(),
)
def test_property_visible_pages_kept_dead_pages_freed(ps, L, H, data):
    windows = data.draw(st.lists(st.one_of(st.just(G), st.integers(1, 70)), min_size=L * H, max_size=L * H))
    sinks = data.draw(st.lists(st.integers(0, 20), min_size=L * H, max_size=L * H))
    steps = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    window = np.array(windows).reshape(L, H)
    sink = np.array(sinks).reshape(L, H)
    pool = PagePool(10_000, ps, 2, window=window, sink=sink)
    pool.add_sequence(0)
    n = 0
    for step in steps:
        free0 = pool.num_free_pages
        need = pool.pages_needed(n + step, n)
        pool.ensure(0, n + step)
        assert free0 - pool.num_free_pages == need.peak
        # Transient: every new position has a page in every head.
        tbl = pool.table(0)
        for lp in range(n // ps, math.ceil((n + step) / ps)):
            assert (tbl[:, :, lp] >= 0).all()
        n += step
        pool.trim(0)
        assert free0 - pool.num_free_pages == need.kept
        check_pool(pool)  # kept == exactly the pages a query at p = n can see
    pool.free_sequence(0)
    assert pool.num_free_pages == pool.num_pages


@pytest.mark.parametrize("n", [1, 5, 17, 40, 63])
def test_ensure_skipping_dead_pages_holds_what_ensure_then_trim_holds(n):
    window, sink = np.array([[G, 3], [9, 20]]), np.array([[0, 1], [4, 0]])
    a = PagePool(200, 4, 8, window=window, sink=sink)
    b = PagePool(200, 4, 8, window=window, sink=sink)
    a.add_sequence(1)
    a.ensure(1, n)
    a.trim(1)
    b.add_sequence(1)
    b.ensure(1, n, skip_dead=True)
    assert ((a.table(1) >= 0) == (b.table(1) >= 0)).all()
    assert a.num_free_pages == b.num_free_pages
    b.trim(1)
    assert b.num_free_pages == a.num_free_pages  # nothing left for trim to drop
    b.free_sequence(1)
    assert b.num_free_pages == b.num_pages


# ---------------------------------------------------------------- selected sets (retrieval heads)

def _selection_pool(num_pages=2000, ps=4):
    """Head plans of a retrieval run: before selection the retrieval heads (l0h1, l1h0) are global;
    the selected plan gives them their real window and sink."""
    before_w = np.array([[G, G, 6], [G, 9, G]])
    sink = np.array([[0, 0, 2], [0, 1, 0]])
    after_w = np.array([[G, 5, 6], [7, 9, G]])
    after_s = np.array([[0, 2, 2], [1, 1, 0]])
    pool = PagePool(num_pages, ps, 8, window=before_w, sink=sink)
    pool.add_plan("selected", after_w, after_s)
    return pool, after_w, after_s


def _sel_array(pool, sets, m=None):
    m = m or max([len(v) for v in sets.values()] + [1])
    sel = np.full((pool.num_layers, pool.num_kv_heads, m), -1, np.int64)
    for (l, h), pos in sets.items():
        sel[l, h, :len(pos)] = sorted(pos)
    return sel


def _check_refs(pool, shared=False):
    """Refcounts equal the references the sequences' tables hold (plus outside holders when
    shared), and the free list holds exactly the unreferenced pages."""
    refs = np.zeros(pool.num_pages, np.int64)
    for sid in pool._seqs:
        t = pool.table(sid)
        np.add.at(refs, t[t >= 0], 1)
    assert (refs <= pool._ref).all() if shared else (refs == pool._ref).all()
    free = pool._free[:pool.num_free_pages]
    assert len(set(free.tolist())) == free.size and (pool._ref[free] == 0).all()
    assert pool.num_free_pages + (pool._ref > 0).sum() == pool.num_pages


def _check_selected(pool, sid, W, S, sets):
    """Each head holds exactly its sink pages, its window pages and the pages of its selected tokens."""
    n, ps = pool.length(sid), pool.page_size
    tbl = pool.table(sid)
    for l in range(pool.num_layers):
        for h in range(pool.num_kv_heads):
            need = brute_needed(n, W[l, h], S[l, h], ps)
            for j in sets.get((l, h), []):
                need[j // ps] = True
            np.testing.assert_array_equal(tbl[l, h] >= 0, need, err_msg=f"l{l} h{h} n{n}")


def test_select_keeps_sink_window_and_selected_pages_and_frees_the_rest():
    pool, W, S = _selection_pool()
    pool.add_sequence(0)
    pool.ensure(0, 61)
    pool.trim(0)
    held = pool.pages_held(0)
    free0 = pool.num_free_pages
    with pytest.raises(ValueError, match="position 9 of layer 0 KV head 2 is no longer stored"):
        pool.select(0, _sel_array(pool, {(0, 2): [9]}))  # a local head's dropped page cannot come back
    sets = {(0, 1): [5, 6, 21, 40], (1, 0): [13], (0, 2): [57]}  # any head may keep a stored token
    released = pool.select(0, _sel_array(pool, sets), plan="selected")
    assert released > 0 and pool.num_free_pages == free0 + released
    assert pool.pages_held(0) == held - released
    assert pool.plan_of(0) == "selected"
    _check_selected(pool, 0, W, S, sets)
    _check_refs(pool)
    np.testing.assert_array_equal(pool.selection(0), _sel_array(pool, sets).astype(np.int32))
    # decode: windows move on, selected pages stay, everything else leaving a window is freed
    for n in range(62, 120):
        pool.ensure(0, n)
        pool.trim(0)
        _check_selected(pool, 0, W, S, sets)
    # a smaller set releases the pages it no longer names
    smaller = {(0, 1): [40]}
    free1 = pool.num_free_pages
    assert pool.select(0, _sel_array(pool, smaller)) == 4  # pages of 5/6 and 21 (l0h1), 13 (l1h0), 57 (l0h2)
    _check_selected(pool, 0, W, S, smaller)
    assert pool.num_free_pages == free1 + 4
    pool.free_sequence(0)
    assert pool.num_free_pages == pool.num_pages and (pool._ref == 0).all()


def test_select_pages_equals_select_of_those_pages_positions():
    """A decode budget's check gives some heads of several sequences every position of some
    pages (the positions from the device): the same pages held, sets, device rows and
    refcounts as ``select`` with those positions, other heads keep their sets; a page that is
    not stored is refused before anything changes."""
    from redknot.cache.selection import pages_to_positions

    pools = []
    for _ in range(2):
        pool, W, S = _selection_pool()
        pool.attach_device_tables(max_seqs=3, max_len=256)
        pool.attach_selection(max_sel=32)
        for sid in (0, 1):
            pool.add_sequence(sid)
            pool.ensure(sid, 61)
            pool.select(sid, _sel_array(pool, {(0, 1): [5, 21, 40], (1, 0): [13 + sid]}), plan="selected")
        pools.append(pool)
    a, b = pools
    ls, hs = np.array([1, 0]), np.array([0, 1])  # l1h0, l0h1 take whole pages; l0h2 keeps nothing
    keep = np.zeros((2, 2, 16), bool)
    keep[0, 0, [3, 13]] = keep[0, 1, [1, 5]] = keep[1, 0, [3]] = keep[1, 1, [10, 14]] = True
    for sid in (0, 1):  # the reference: the pages' positions through select
        sets = {(1, 0): [], (0, 1): []}
        for r, key in enumerate([(1, 0), (0, 1)]):
            sets[key] = [p * 4 + i for p in np.nonzero(keep[sid, r])[0] for i in range(4)]
        a.select(sid, _sel_array(a, sets), plan="selected")
    with pytest.raises(ValueError, match="page 9 of layer 0 KV head 1 is not stored"):
        bad = keep.copy()
        bad[1, 1, 9] = True  # released when the first select dropped it
        pos, lens = pages_to_positions(torch.from_numpy(bad.reshape(4, 16)), 4)
        b.select_pages([0, 1], ls, hs, bad, pos, lens)
    pos, lens = pages_to_positions(torch.from_numpy(keep.reshape(4, 16)), 4)
    released = b.select_pages([0, 1], ls, hs, keep, pos, lens, plan="selected")
    assert released > 0
    slots = torch.tensor([a.slot(0), a.slot(1)])
    for sid in (0, 1):
        np.testing.assert_array_equal(a.table(sid), b.table(sid))
        np.testing.assert_array_equal(a.selection(sid), b.selection(sid))
    for x, y in zip(a.selection_tables(slots), b.selection_tables(slots)):
        torch.testing.assert_close(x, y)
    np.testing.assert_array_equal(a._ref, b._ref)
    _check_refs(b)
    for n in range(62, 90):  # the kept pages stay while the windows move on
        for pool in pools:
            pool.ensure(0, n)
            pool.trim(0)
        np.testing.assert_array_equal(a.table(0), b.table(0))
    b.select(1, _sel_array(b, {(1, 0): [13]}))  # select replaces the page sets, whole device rows too
    sel, lens = b.selection_tables(torch.tensor([b.slot(1)]))
    assert sel[1, 0, 0].tolist() == [13] + [-1] * 31 and (sel[0, 0] == -1).all() and lens.sum() == 1
    for sid in (0, 1):
        b.free_sequence(sid)
    assert b.num_free_pages == b.num_pages


def test_select_never_writes_or_frees_shared_pages():
    pool, W, S = _selection_pool()
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    pool.add_sequence(1)  # the owner of a prefix (a cache would hold it the same way: one reference)
    pool.ensure(1, 48)
    prefix = pool.table(1)
    pool.add_sequence(2)
    pool.share(2, prefix, 48)
    pool.ensure(2, 70)
    snap_k, snap_v = pool.k_pages.clone(), pool.v_pages.clone()
    ids = prefix[prefix >= 0]
    refs = pool._ref[ids].copy()
    assert (refs == 2).all()
    pool.select(2, _sel_array(pool, {(0, 1): [3], (1, 0): [50]}), plan="selected")
    # the shared prefix pages lost sequence 2's reference at most: still held by 1, never rewritten
    assert (pool._ref[ids] >= 1).all() and (pool._ref[ids] <= 2).all()
    assert (pool._ref[ids] < 2).any()  # some were dropped by 2
    free_ids = set(pool._free[:pool.num_free_pages].tolist())
    assert not free_ids & set(ids.tolist())
    assert torch.equal(pool.k_pages[torch.from_numpy(ids.astype(np.int64))],
                       snap_k[torch.from_numpy(ids.astype(np.int64))])
    assert torch.equal(pool.v_pages, snap_v)  # select writes nothing at all
    _check_refs(pool)
    pool.free_sequence(2)
    np.testing.assert_array_equal(pool._ref[ids], 1)
    pool.free_sequence(1)
    assert pool.num_free_pages == pool.num_pages


def test_selection_device_table_follows_select_and_free():
    pool, W, S = _selection_pool()
    pool.attach_device_tables(max_seqs=3, max_len=256)
    pool.attach_selection(max_sel=8)
    for sid in (0, 1):
        pool.add_sequence(sid)
        pool.ensure(sid, 40)
    pool.select(1, _sel_array(pool, {(0, 1): [2, 30], (1, 0): [7]}), plan="selected")
    slots = torch.tensor([0, pool.slot(0), pool.slot(1)])
    sel, lens = pool.selection_tables(slots)
    assert sel.shape == (2, 3, 3, 8) and lens.shape == (2, 3, 3)
    assert (lens[:, :2] == 0).all() and (sel[:, :2] == -1).all()  # padding slot and unselected sequence
    assert sel[0, 2, 1, :2].tolist() == [2, 30] and lens[0, 2, 1] == 2 and lens[1, 2, 0] == 1
    pool.select(1, _sel_array(pool, {(1, 0): [7]}), plan="selected")  # a narrower set: the old columns go
    sel, lens = pool.selection_tables(slots)
    assert (sel[0, 2] == -1).all() and sel[1, 2, 0].tolist() == [7] + [-1] * 7 and lens[0, 2, 1] == 0
    slot = pool.slot(1)
    pool.free_sequence(1)
    assert (pool.device_sel[:, slot] == -1).all() and (pool.device_sel_lens[:, slot] == 0).all()
    with pytest.raises(ValueError, match="device table holds 8"):
        pool.select(0, _sel_array(pool, {(0, 1): list(range(0, 36, 4))}))


def test_select_rejects_bad_sets():
    pool, W, S = _selection_pool()
    pool.add_sequence(0)
    pool.ensure(0, 30)
    with pytest.raises(ValueError, match="sorted"):
        pool.select(0, np.array([[[5, 3]] * 3] * 2))
    with pytest.raises(ValueError, match="padding"):
        pool.select(0, np.array([[[-1, 3]] * 3] * 2))
    with pytest.raises(ValueError, match=r"\[L=2, Hkv=3, m\]"):
        pool.select(0, np.zeros((2, 2, 1)))
    with pytest.raises(ValueError, match="unknown head plan"):
        pool.select(0, np.full((2, 3, 1), -1), plan="nope")
    with pytest.raises(KeyError):
        pool.select(9, np.full((2, 3, 1), -1))
