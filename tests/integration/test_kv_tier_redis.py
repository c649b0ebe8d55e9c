"""The Redis tier against a redis-server the tests start on loopback, and against none at all."""

import logging
import time

import numpy as np
import pytest
import torch

from redknot.cache.tiers import KVEntry, Layout, tier_key
from redknot.cache.tiers.redis import CircuitBreaker, RedisTier

redis = pytest.importorskip("redis")

L, H, D = 2, 3, 8
LAYOUT = Layout("fp", "plan", "bfloat16", 16, D, L, H)


def make(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, n, H, D, generator=g).bfloat16()
    v = torch.randn(L, n, H, D, generator=g).bfloat16()
    ck = f"chunk-{seed}"
    return KVEntry.build(tier_key(ck, LAYOUT), ck, LAYOUT, range(n), 3, k, v)


@pytest.fixture
def tier(redis_server):
    t = RedisTier(redis_server, prefix=f"test:{time.monotonic_ns()}:")
    yield t
    t.close()


def test_redis_tier_round_trips_one_value_per_entry(tier):
    e = make()
    tier.put(e)
    assert tier.client.get(tier._name(e.key)) == b"".join(e.encode())  # header and bytes in one value
    got = tier.get(e.key, LAYOUT)
    assert torch.equal(got.payload, e.payload) and tier.stats.hits == 1
    part = tier.get(e.key, LAYOUT, np.array([2, 3, 4]))
    assert torch.equal(part.payload, e.select([2, 3, 4]).payload)
    assert tier.stats.bytes_saved == 3 * e.header.segment_bytes
    assert tier.get("ab" * 16, LAYOUT) is None and tier.stats.misses == 1


def test_a_flipped_byte_in_redis_is_rejected_and_deleted(tier):
    e = make(seed=1)
    tier.put(e)
    name = tier._name(e.key)
    value = bytearray(tier.client.get(name))
    value[-3] ^= 0x10
    tier.client.set(name, bytes(value))
    assert tier.get(e.key, LAYOUT, np.array([0])) is not None  # head 0 is intact: a partial read passes
    assert tier.get(e.key, LAYOUT, np.array([5])) is None  # the damaged head is caught
    assert tier.stats.rejected == 1 and not tier.client.exists(name)
    tier.put(e)
    tier.client.setrange(name, 40, b"\xff\xff")  # header damage
    assert tier.get(e.key, LAYOUT) is None and tier.stats.rejected == 2 and not tier.client.exists(name)


def test_ttl_expires_entries(redis_server):
    t = RedisTier(redis_server, ttl_s=0.2, prefix="ttl:")
    e = make(seed=2)
    t.put(e)
    assert 0 < t.client.pttl(t._name(e.key)) <= 200
    time.sleep(0.3)
    assert t.get(e.key, LAYOUT) is None


def test_a_dead_redis_is_skipped_quickly_and_retried_after_backoff(dead_redis_url, caplog):
    now = [0.0]
    t = RedisTier(dead_redis_url, breaker=CircuitBreaker(base_s=5.0, clock=lambda: now[0]))
    e = make(seed=3)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        t.put(e)  # fails once (connection refused), opens the circuit
        for _ in range(20):
            assert t.get(e.key, LAYOUT) is None
            t.put(e)
    assert time.monotonic() - start < 2.0
    assert t.stats.errors == 1 and t.stats.skipped == 40
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    now[0] = 5.0  # past the backoff: one retry, which fails and doubles it
    assert t.get(e.key, LAYOUT) is None and t.stats.errors == 2 and t.breaker.backoff == 10.0


def test_an_entry_is_sent_once_and_again_after_the_server_dropped_it(tier):
    e = make(seed=4)
    tier.put(e)
    tier.put(e)
    assert tier.stats.puts == 1 and tier.stats.bytes_written == e.payload.numel()
    tier.client.delete(tier._name(e.key))  # the server's maxmemory policy evicted it
    assert tier.get(e.key, LAYOUT) is None
    tier.put(e)
    assert tier.stats.puts == 2 and tier.get(e.key, LAYOUT) is not None


def test_a_redis_that_accepts_but_never_answers_costs_one_timeout():
    import socket

    with socket.socket() as silent:  # the kernel accepts connections; nobody ever replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        t = RedisTier(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_s=0.2)
        e = make(seed=5)
        start = time.monotonic()
        assert t.get(e.key, LAYOUT) is None
        t.put(e)
        assert t.get(e.key, LAYOUT) is None
        assert time.monotonic() - start < 1.5  # one timeout, then the open circuit skips
        assert t.stats.errors == 1 and t.stats.skipped == 2 and t.info()["circuit_open"]
