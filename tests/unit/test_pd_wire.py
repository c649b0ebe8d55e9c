"""The PD handoff's wire format and the pool's adopt: ranges round-trip, headers reject any change,
checksums catch a flipped byte, adopt takes exactly the held pages."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from redknot.cache import PagePool, PoolExhausted
from redknot.config import GLOBAL_WINDOW
from redknot.pd.wire import (HandoffHeader, HandoffRejected, fold64, held_to_ranges, payload_digest,
                             positions_to_ranges, ranges_to_held, ranges_to_positions)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 200), st.integers(1, 16), st.integers(0, 2**32 - 1))
def test_page_ranges_round_trip(L, H, n, ps, seed):
    rng = np.random.default_rng(seed)
    P = -(-n // ps)
    held = rng.random((L, H, P)) < 0.5
    counts, bounds = held_to_ranges(held, ps, n)
    assert np.array_equal(ranges_to_held(counts, bounds, (L, H, P), ps, n), held)
    assert (bounds[1::2] <= n).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 100), st.integers(0, 2**32 - 1))
def test_selected_positions_round_trip(L, H, n, seed):
    rng = np.random.default_rng(seed)
    sel = np.full((L, H, n), -1, np.int64)
    for l in range(L):
        for h in range(H):
            pos = np.sort(rng.choice(n, rng.integers(0, n + 1), replace=False))
            sel[l, h, :len(pos)] = pos
    back = ranges_to_positions(*positions_to_ranges(sel), (L, H), n)
    w = max(back.shape[2], sel.shape[2])
    pad = lambda a: np.pad(a, ((0, 0), (0, 0), (0, w - a.shape[2])), constant_values=-1)  # noqa: E731
    assert np.array_equal(pad(back), pad(sel))


def test_bad_ranges_are_rejected():
    counts = np.array([2], np.uint32)
    with pytest.raises(HandoffRejected, match="overlap"):
        ranges_to_held(counts, np.array([0, 32, 16, 48], np.int64), (1, 1, 3), 16, 48)
    with pytest.raises(HandoffRejected, match="outside"):
        ranges_to_held(np.array([1], np.uint32), np.array([0, 64], np.int64), (1, 1, 3), 16, 48)
    with pytest.raises(HandoffRejected, match="page boundary"):
        ranges_to_held(np.array([1], np.uint32), np.array([3, 16], np.int64), (1, 1, 3), 16, 48)


def header(**kw):
    held = np.ones((2, 2, 3), bool)
    held[0, 1, 1] = False
    counts, bounds = held_to_ranges(held, 16, 40)
    base = dict(lease="L1", fingerprint="f" * 32, plan="headsparse", plan_hash="abc", dtype="bfloat16", page_size=16,
                head_dim=8, num_layers=2, num_kv_heads=2, num_tokens=40, tokens_hash=7, counts=counts, bounds=bounds,
                logits=np.arange(5, dtype="<f4").tobytes(), logits_dtype="float32", payload_bytes=2 * 11 * 16 * 8 * 2,
                digest=123)
    return HandoffHeader(**{**base, **kw})


def test_header_round_trips_and_rejects_corruption():
    h = header()
    back = HandoffHeader.decode(h.encode())
    assert back.plan == "headsparse" and back.num_tokens == 40 and back.digest == 123
    assert np.array_equal(back.held(), h.held()) and back.first_logits().tolist() == [0, 1, 2, 3, 4]
    buf = bytearray(h.encode())
    buf[-3] ^= 1
    with pytest.raises(HandoffRejected, match="checksum"):
        HandoffHeader.decode(bytes(buf))
    with pytest.raises(HandoffRejected, match="magic"):
        HandoffHeader.decode(b"XXXX" + bytes(buf[4:]))


def test_checksums_catch_a_flipped_byte():
    x = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    for algo in ("xxh3-64", "fold64"):
        a = payload_digest(x, algo)
        y = x.clone()
        y[1234] ^= 4
        assert payload_digest(y, algo) != a and payload_digest(x.clone(), algo) == a
    # fold64 does not depend on how the words are chunked
    import redknot.pd.wire as wire

    whole = fold64(x)
    old, wire.FOLD_CHUNK_WORDS = wire.FOLD_CHUNK_WORDS, 7
    try:
        assert fold64(x) == whole
    finally:
        wire.FOLD_CHUNK_WORDS = old


def test_adopt_takes_exactly_the_held_pages():
    window = np.array([[GLOBAL_WINDOW, 32]])
    pool = PagePool(20, 16, 4, window, np.array([[0, 4]]))
    pool.add_plan("headsparse", window, np.array([[0, 4]]))
    pool.add_sequence(1, "headsparse")
    held = np.array([[[True, True, True, True], [True, False, True, True]]])
    pages = pool.adopt(1, held, 60)
    assert pages.size == 7 and pool.num_free_pages == 13 and pool.length(1) == 60
    assert np.array_equal(pool.table(1) >= 0, held)
    assert pool.trim(1) == 0  # nothing it holds is dead for its plan
    pool.add_sequence(2, "headsparse")
    with pytest.raises(PoolExhausted):
        pool.adopt(2, np.ones((1, 2, 8), bool), 128)
    assert pool.num_free_pages == 13  # the failed call took nothing
    pool.free_sequence(1)
    assert pool.num_free_pages == 20
