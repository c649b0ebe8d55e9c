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
