"""redknot.visibility: the rule, its closed-form counts, and the trim rule the page pool applies."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from redknot import visibility as V
from redknot.cache import PagePool

G = V.GLOBAL_WINDOW


def brute(p, j, w, s, sel=()):
    return j <= p and (j < s or p - j < w or j in sel)


@pytest.mark.parametrize("w,s", [(1, 0), (3, 2), (8, 0), (G, 0), (5, 9)])
def test_mask_is_the_rule(w, s):
    q, k = torch.arange(20), torch.arange(20)
    sel = torch.tensor([2, 11, -1])
    m = V.visibility_mask(q, k, w, s, sel)
    want = [[brute(p, j, w, s, (2, 11)) for j in range(20)] for p in range(20)]
    assert m.tolist() == want


@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(0, 6), st.integers(1, 50))
@settings(max_examples=60, deadline=None)
def test_visible_pairs_counts_the_mask(windows, sink, n):
    q = torch.arange(n)
    want = sum(int(V.visibility_mask(q, q, w, sink).sum()) for w in windows)
    got = V.visible_pairs(q, torch.tensor(windows), torch.tensor([sink] * len(windows)), group=1)
    assert got == want
    assert V.visible_pairs(q, torch.tensor(windows), torch.tensor([sink] * len(windows)), group=3) == 3 * want


def test_visible_keys_of_the_last_query():
    w, s = torch.tensor([[G, 4, 100]]), torch.tensor([[0, 2, 4]])
    got = V.visible_keys(w, s, context=50)
    last = torch.tensor([49])
    want = [int(V.visibility_mask(last, torch.arange(50), int(wi), int(si)).sum()) for wi, si in zip(w[0], s[0])]
    assert got[0].tolist() == want


@given(st.integers(1, 90), st.integers(1, 6), st.data())
@settings(max_examples=60, deadline=None)
def test_kept_pages_match_the_page_pool(n, ps, data):
    """The pages PagePool keeps after trim are exactly kept_page_mask's, for every head."""
    windows = np.array(data.draw(st.lists(st.sampled_from([1, 2, 3, 5, 8, 13, 40, G]), min_size=6, max_size=6)))
    sinks = np.array(data.draw(st.lists(st.integers(0, 9), min_size=6, max_size=6)))
    window, sink = windows.reshape(2, 3), np.where(windows == G, 0, sinks).reshape(2, 3)
    pool = PagePool(4096, ps, head_dim=4, window=window, sink=sink)
    pool.add_sequence(0)
    steps = data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=20))
    length = 0
    for k in steps:  # grow as the engine does: a chunk, then trim
        length = min(n, length + k)
        pool.ensure(0, length)
        pool.trim(0)
        stored = pool.table(0) >= 0
        np.testing.assert_array_equal(stored, V.kept_page_mask(length, window, sink, ps))
        np.testing.assert_array_equal(stored.sum(-1), V.kept_pages(length, window, sink, ps))
        if length == n:
            break


def test_bytes():
    assert V.bytes_per_page(64, 128, 2) == 2 * 64 * 128 * 2
    pool = PagePool(8, 4, 8, window=np.full((1, 1), G), sink=np.zeros((1, 1)))
    assert pool.bytes_per_page == V.bytes_per_page(4, 8, pool.k_pages.element_size())
    b = V.bytes_per_head(100, np.array([G, 10]), np.array([0, 4]), 16, 8, 2)
    assert b.tolist() == [7 * V.bytes_per_page(16, 8, 2), V.kept_pages(100, 10, 4, 16) * V.bytes_per_page(16, 8, 2)]
