"""ChunkCache over tiers, at the pool level: write-down, load-back, and what a load may not do."""

import numpy as np
import pytest
import torch

from redknot.cache import ChunkKV, PagePool
from redknot.cache.chunk_cache import ChunkCache
from redknot.cache.tiers import KVOffloadConfig, tier_key
from redknot.config import GLOBAL_WINDOW

L, H, D, PS = 2, 3, 8, 4


def make_pool(pages=64):
    return PagePool(pages, PS, D, torch.full((L, H), GLOBAL_WINDOW), torch.zeros(L, H, dtype=torch.long))


def chunk(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(tuple(range(seed, seed + n)), 5, torch.randn(L, n, H, D, generator=g),
                   torch.randn(L, n, H, D, generator=g))


def tiers(policy="write_back", cpu_bytes=1 << 20):
    return KVOffloadConfig(cpu_bytes=cpu_bytes, write_policy=policy, write_behind=False).build()


def same(got: ChunkKV, want: ChunkKV) -> bool:
    return (got.token_ids == want.token_ids and got.start == want.start and torch.equal(got.k, want.k)
            and torch.equal(got.v, want.v))


def test_an_evicted_entry_is_loaded_back_into_pool_pages():
    pool = make_pool()
    cache = ChunkCache(pool, "fp", tiers=tiers())
    c = chunk()
    cache.put("a", c)
    assert cache.stats()["tiers"]["cpu"]["entries"] == 0  # write-back: nothing below yet
    cache.evict(1)
    assert "a" not in cache and pool.num_free_pages == pool.num_pages
    assert cache.stats()["tiers"]["cpu"]["entries"] == 1
    assert same(cache.get("a"), c)
    assert "a" in cache and cache.tier_hits == {"cpu": 1} and cache.misses == 1
    assert pool.num_free_pages == pool.num_pages - L * H * 3
    cache.evict(1)  # the CPU tier still holds it: no second copy
    assert cache.written_down == 1


def test_write_through_writes_at_insert_and_clear_leaves_the_tiers_alone():
    pool = make_pool()
    t = tiers("write_through")
    cache = ChunkCache(pool, "fp", tiers=t)
    c = chunk()
    cache.put("a", c)
    assert t.cpu.contains(tier_key("a", cache.layout)) and cache.written_down == 1
    cache.clear()
    assert same(cache.get("a"), c)
    assert cache.get("nothing") is None and cache.tier_misses == 1


def test_a_load_takes_only_free_pages_and_evicts_no_entry():
    """A lookup's entry is not pinned until its caller retains it, so a later lookup's load must
    not evict it: with too few free pages the load is a miss (the caller computes)."""
    pool = make_pool(pages=L * H * 3 * 2)
    cache = ChunkCache(pool, "fp", tiers=tiers())
    cache.put("a", chunk(seed=1))
    cache.evict(1)
    cache.put("b", chunk(seed=2))
    cache.put("c", chunk(seed=3))  # the pool is full
    b = cache.lookup("b")
    assert cache.lookup("a") is None and cache.tier_no_room == 1
    assert "b" in cache and "c" in cache and cache.peek("b") is b


def test_a_load_may_pass_the_cap_until_the_next_insert():
    pool = make_pool()
    cache = ChunkCache(pool, "fp", max_bytes=L * H * 3 * pool.bytes_per_page, tiers=tiers())
    cache.put("a", chunk(seed=1))
    cache.put("b", chunk(seed=2))  # the cap holds one entry: a goes down
    assert "a" not in cache
    b = cache.lookup("b")
    assert cache.lookup("a") is not None and "b" in cache and cache.peek("b") is b  # b stays (its caller may read it)
    assert cache.num_pages() == 2 * L * H * 3
    cache.put("c", chunk(seed=3))
    assert cache.num_pages() == L * H * 3 and list(cache._entries) == ["c"]


def test_a_failing_tier_never_stops_an_eviction(monkeypatch):
    pool = make_pool()
    t = tiers()
    cache = ChunkCache(pool, "fp", tiers=t)

    def broken(*_a, **_k):
        raise MemoryError("no host memory")

    monkeypatch.setattr(t, "store", broken)
    cache.put("a", chunk())
    assert cache.evict(1) == L * H * 3 and cache.write_errors == 1
    assert cache.get("a") is None


def test_a_corrupt_tier_entry_is_a_miss():
    pool = make_pool()
    t = tiers()
    cache = ChunkCache(pool, "fp", tiers=t)
    cache.put("a", chunk())
    cache.evict(1)
    entry = t.cpu._entries[tier_key("a", cache.layout)]
    entry.payload[5] ^= 0x01
    assert cache.get("a") is None and t.cpu.stats.rejected == 1 and pool.num_free_pages == pool.num_pages


def test_keys_differ_by_page_size_and_plan():
    a = ChunkCache(make_pool(), "fp", tiers=tiers())
    other_ps = PagePool(64, 8, D, torch.full((L, H), GLOBAL_WINDOW), torch.zeros(L, H, dtype=torch.long))
    other_plan = PagePool(64, PS, D, torch.full((L, H), 16), torch.zeros(L, H, dtype=torch.long))
    caches = [a] + [ChunkCache(p, fp, tiers=tiers()) for p, fp in ((other_ps, "fp"), (other_plan, "fp"),
                                                                   (make_pool(), "fp2"))]
    keys = {tier_key("a", c.layout) for c in caches}
    assert len(keys) == 4


def test_persist_writes_every_pool_entry_down():
    t = tiers()
    cache = ChunkCache(make_pool(), "fp", tiers=t)
    cache.put("a", chunk(seed=1))
    cache.put("b", chunk(seed=2))
    assert cache.persist() == 2 and len(t.cpu) == 2
    with pytest.raises(ValueError, match="every"):
        cache.insert("x", (1,), 0, np.full((L, H, 1), -1, np.int32), 0)


def test_a_zero_cap_cache_loads_nothing_and_an_overflow_is_trimmed_on_refusal():
    pool = make_pool()
    t = tiers()
    writer = ChunkCache(pool, "fp", tiers=t)
    writer.put("a", chunk())
    writer.evict(1)  # "a" is in the CPU tier only
    zero = ChunkCache(pool, "fp", max_bytes=0, tiers=t)
    assert zero.lookup("a") is None and zero.tier_no_room == 1 and len(zero) == 0
    assert pool.num_free_pages == pool.num_pages
    capped = ChunkCache(pool, "fp", max_bytes=L * H * 3 * pool.bytes_per_page, tiers=t)
    capped.put("b", chunk(seed=2))
    capped.lookup("b")
    assert capped.lookup("a") is not None and capped.num_pages() == 2 * L * H * 3  # past the cap
    assert not capped.put("big", chunk(n=20, seed=4))  # refused (larger than the cap); the overflow goes
    assert capped.num_pages() == L * H * 3 and list(capped._entries) == ["a"]


def test_a_failing_fetch_is_a_miss(monkeypatch):
    t = tiers()
    cache = ChunkCache(make_pool(), "fp", tiers=t)

    def broken(*_a, **_k):
        raise OSError("the tier's machine went away")

    monkeypatch.setattr(t, "fetch", broken)
    assert cache.lookup("a") is None and cache.fetch_errors == 1 and cache.stats()["tiers"]["fetch_errors"] == 1


class _Copy:
    """A device-to-host copy that ends when the test says so (``synchronize`` waits for it)."""
    def __init__(self):
        import threading
        self.done = threading.Event()

    def synchronize(self):
        assert self.done.wait(10)


def test_write_downs_only_enqueue_and_a_full_queue_drops_them():
    from redknot.cache.tiers import KVEntry, Layout

    stack = KVOffloadConfig(cpu_bytes=1 << 20).build()
    stack = type(stack)(stack.cpu, None, None, write_behind=True, max_pending_downs=1)
    layout = Layout("fp", "plan", "float32", PS, D, L, H)
    c = chunk()

    def build(key):
        return lambda: KVEntry.build(key, key, layout, c.token_ids, c.start, c.k, c.v)
    copies = [_Copy() for _ in range(3)]
    import time
    t0 = time.perf_counter()
    assert stack.store_later("a", build("a"), copies[0])
    while stack._down.qsize():  # the down thread took "a" and waits for its copy
        time.sleep(0.01)
    assert stack.store_later("b", build("b"), copies[1])  # queued
    assert not stack.store_later("c", build("c"), copies[2])  # full: dropped, not waited for
    assert time.perf_counter() - t0 < 5 and stack.downs_dropped == 1
    assert stack.has("a") and stack.has("b") and not stack.has("c")
    for x in copies:
        x.done.set()
    stack.flush()
    assert stack.cpu.contains("a") and stack.cpu.contains("b") and not stack.cpu.contains("c")
    assert stack.fetch("b", layout)[0].header.chunk_key == "b" and stack.downs_done == 2
    stack.close()
