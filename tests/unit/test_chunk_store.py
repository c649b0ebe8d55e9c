"""ChunkStore: content keys, two-tier LRU, budgets, pinning by acquire, fingerprint isolation."""

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from redknot.cache import ChunkKV, chunk_key
from oracles.chunk_store import ChunkStore

FP = "model-a|bf16|rope10000|tok1"
L, H, D = 2, 2, 4
UNIT = 2 * L * H * D * 4  # bytes of a 1-token float32 entry (k + v)

_gen = torch.Generator().manual_seed(0)


def make(n=1, dtype=torch.float32, start=7):
    """Random (non-zero) entry of n tokens; n * UNIT bytes in float32."""
    k = torch.randn(L, n, H, D, generator=_gen).to(dtype)
    v = torch.randn(L, n, H, D, generator=_gen).to(dtype)
    return ChunkKV(tuple(range(100, 100 + n)), start, k, v, compute_s=0.5)


def same(a, b):
    return a.k.dtype == b.k.dtype and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def check(store):
    """Budgets hold and byte counters match the entries actually stored."""
    s = store.stats()
    assert s["bytes_device"] <= store.device_budget_bytes
    assert s["bytes_cpu"] <= store.cpu_budget_bytes
    assert s["bytes_device"] == sum(e.nbytes for e in store._dev.values())
    assert s["bytes_cpu"] == sum(e.nbytes for e in store._cpu.values())
    assert not set(store._dev) & set(store._cpu)
    assert set(store._refs) <= set(store._dev)  # acquired entries stay on the device tier


# ---------------------------------------------------------------- keys

def test_key_properties():
    k = chunk_key(FP, [1, 2, 3], [4, 5])
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == chunk_key(FP, (1, 2, 3), torch.tensor([4, 5]))  # same ids, any container
    assert k != chunk_key(FP + "x", [1, 2, 3], [4, 5])
    assert k != chunk_key(FP, [1, 2, 9], [4, 5])
    assert k != chunk_key(FP, [1, 2, 3], [4, 6])
    # Length prefixes: moving the prefix/chunk boundary changes the key.
    assert chunk_key(FP, [1, 2], [3]) != chunk_key(FP, [1], [2, 3])
    assert chunk_key(FP, [], [1]) != chunk_key(FP, [1], [])
    assert ChunkStore(FP, 0).key([1], [2]) == chunk_key(FP, [1], [2])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=4), st.lists(st.integers(0, 2**40), max_size=4),
       st.lists(st.integers(0, 2**40), max_size=4), st.lists(st.integers(0, 2**40), max_size=4))
def test_key_injective(p1, c1, p2, c2):
    assert (chunk_key(FP, p1, c1) == chunk_key(FP, p2, c2)) == ((p1, c1) == (p2, c2))


def test_key_bad_ids():
    with pytest.raises(ValueError, match="prefix_ids"):
        chunk_key(FP, [[1, 2]], [3])
    with pytest.raises(ValueError, match="chunk_ids"):
        chunk_key(FP, [1], [0.5])


# ---------------------------------------------------------------- LRU and tiers

def test_lru_order_on_device_tier():
    s = ChunkStore(FP, device_budget_bytes=3 * UNIT)  # no CPU tier: evicted = dropped
    a, b, c, d = (make() for _ in range(4))
    for name, e in zip("abc", (a, b, c)):
        assert s.put(name, e)
    assert s.get("a") is not None  # a becomes most recent; b is now LRU
    assert s.put("d", d)
    assert not s.contains("b") and all(s.contains(x) for x in "acd")
    assert s.stats()["evictions"] == 1
    check(s)


def test_spill_and_promote_keep_values_and_dtype():
    s = ChunkStore(FP, device_budget_bytes=UNIT, cpu_budget_bytes=2 * UNIT)
    a, b = make(dtype=torch.bfloat16), make(dtype=torch.bfloat16)  # each UNIT/2 bytes
    c = make()  # UNIT bytes: pushes a and b out
    ref = {n: ChunkKV(e.token_ids, e.start, e.k.clone(), e.v.clone()) for n, e in zip("abc", (a, b, c))}
    for n, e in zip("abc", (a, b, c)):
        assert s.put(n, e)
    st_ = s.stats()
    assert (st_["entries_device"], st_["entries_cpu"], st_["spills"]) == (1, 2, 2)
    assert same(s._cpu["a"], ref["a"]) and same(s._cpu["b"], ref["b"])
    got = s.get("a")  # CPU hit: promoted, c spilled to make room
    assert same(got, ref["a"]) and got.token_ids == a.token_ids and got.start == a.start
    assert "a" in s._dev and "c" in s._cpu and "b" in s._cpu
    assert s.stats()["cpu_hits"] == 1
    check(s)


def test_cpu_tier_lru_and_oversize_drop():
    s = ChunkStore(FP, device_budget_bytes=2 * UNIT, cpu_budget_bytes=UNIT)
    s.put("big", make(2))
    s.put("x", make())  # big -> does not fit the CPU tier: dropped
    assert not s.contains("big") and s.stats()["evictions"] == 1
    s.put("y", make())
    s.put("z", make())  # x -> CPU
    s.put("w", make())  # y -> CPU, x dropped (CPU LRU)
    assert list(s._cpu) == ["y"] and s.stats()["evictions"] == 2
    check(s)


def test_oversize_entry_rejected():
    s = ChunkStore(FP, device_budget_bytes=UNIT, cpu_budget_bytes=10 * UNIT)
    assert s.put("a", make())
    assert not s.put("big", make(2))
    assert not s.contains("big") and s.contains("a") and len(s) == 1
    assert s.stats()["rejected"] == 1
    check(s)


def test_put_existing_key_keeps_one_copy():
    s = ChunkStore(FP, 2 * UNIT, 2 * UNIT)
    e = make()
    assert s.put("a", e) and s.put("a", make())
    assert len(s) == 1 and same(s.get("a"), e)
    s.put("b", make()); s.put("c", make()); s.put("d", make())  # a -> CPU
    assert "a" in s._cpu
    assert s.put("a", e) and "a" in s._dev and "a" not in s._cpu  # re-put supersedes the CPU copy
    check(s)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "acq", "rel", "clear"]),
                          st.integers(0, 7), st.integers(1, 4)), max_size=40),
       st.integers(0, 8), st.integers(0, 8))
def test_budgets_never_exceeded(ops, dev_units, cpu_units):
    s = ChunkStore(FP, dev_units * UNIT, cpu_units * UNIT)
    held = []
    for op, i, n in ops:
        key = f"k{i}"
        if op == "put":
            s.put(key, make(n))
        elif op == "get":
            s.get(key)
        elif op == "acq":
            try:
                s.acquire(key)
                held.append(key)
            except KeyError:
                pass
        elif op == "rel" and held:
            s.release(held.pop())
        elif op == "clear":
            s.clear()
        check(s)
        assert all(s.contains(k) for k in held)


# ---------------------------------------------------------------- acquire / release

def test_acquired_entries_are_never_evicted():
    s = ChunkStore(FP, device_budget_bytes=2 * UNIT, cpu_budget_bytes=4 * UNIT)
    a = make()
    s.put("a", a)
    assert same(s.acquire("a"), a)
    for i in range(5):  # churn: a is LRU but pinned
        assert s.put(f"x{i}", make())
        assert "a" in s._dev
    s.acquire("a")  # refcount 2
    assert not s.put("big", make(2))  # only room would come from evicting a: rejected instead
    assert s.stats()["rejected"] == 1 and "a" in s._dev
    s.release("a")
    assert not s.put("big", make(2))  # still acquired once
    s.release("a")
    assert s.put("big", make(2)) and "a" in s._cpu  # now it may be spilled
    check(s)


def test_acquire_promotes_and_release_errors():
    s = ChunkStore(FP, device_budget_bytes=UNIT, cpu_budget_bytes=UNIT)
    a = make()
    s.put("a", a)
    s.put("b", make())  # a -> CPU
    assert same(s.acquire("a"), a) and "a" in s._dev and "b" in s._cpu
    with pytest.raises(KeyError, match="no room"):
        s.acquire("b")  # a is pinned and fills the device tier
    assert same(s.get("b"), s._cpu["b"])  # still served: a device copy, left on the CPU tier
    with pytest.raises(KeyError, match="not in the store"):
        s.acquire("nope")
    with pytest.raises(ValueError, match="not acquired"):
        s.release("b")
    s.release("a")
    with pytest.raises(ValueError, match="not acquired"):
        s.release("a")  # one release too many
    check(s)


def test_clear_keeps_acquired():
    s = ChunkStore(FP, 3 * UNIT, 3 * UNIT)
    for n in "abcd":
        s.put(n, make())
    s.acquire("c")
    s.clear()
    assert len(s) == 1 and s.contains("c")
    check(s)


# ---------------------------------------------------------------- fingerprints

def test_fingerprint_isolation():
    a = ChunkStore(FP, 4 * UNIT, 4 * UNIT)
    b = ChunkStore("model-b", 4 * UNIT, 4 * UNIT)
    assert a.key([1], [2]) != b.key([1], [2])
    key = a.key([1], [2])
    a.put(key, make())
    a.put("other", make())
    a._cpu["spilled"] = a._dev.pop("other")  # something on each tier
    b._dev, b._cpu = a._dev, a._cpu  # hand b the same key space
    assert b.get(key) is None and b.get("spilled") is None
    assert not b.contains(key) and len(a) == 2
    assert b.stats()["misses"] == 2 and b.stats()["hits"] == 0
    with pytest.raises(KeyError):
        b.acquire(key)
    # An entry stamped by model a cannot be put into a store of model b.
    with pytest.raises(ValueError, match="fingerprint"):
        ChunkStore("model-b", 4 * UNIT).put(key, a._dev[key])


# ---------------------------------------------------------------- stats

def test_stats_values():
    s = ChunkStore(FP, device_budget_bytes=2 * UNIT, cpu_budget_bytes=UNIT)
    s.put("a", make()); s.put("b", make()); s.put("c", make())  # a -> CPU
    assert s.get("b") is not None  # device hit
    assert s.get("a") is not None  # CPU hit; c is LRU -> CPU
    assert s.get("zz") is None
    assert not s.put("huge", make(3))
    assert s.stats() == {
        "hits": 2, "misses": 1, "cpu_hits": 1, "evictions": 0, "spills": 2, "rejected": 1,
        "entries_device": 2, "entries_cpu": 1, "bytes_device": 2 * UNIT, "bytes_cpu": UNIT,
        "device_budget_bytes": 2 * UNIT, "cpu_budget_bytes": UNIT, "hit_rate": 2 / 3,
    }
    assert ChunkStore(FP, 0).stats()["hit_rate"] == 0.0


# ---------------------------------------------------------------- validation

def test_chunkkv_basics():
    e = make(3, dtype=torch.float16)
    assert e.num_tokens == 3 and e.nbytes == 3 * UNIT // 2
    f = e.to("cpu")
    assert same(e, f) and f.token_ids == e.token_ids and f.compute_s == 0.5


def test_bad_inputs():
    k = torch.randn(L, 2, H, D)
    with pytest.raises(ValueError, match="ChunkKV.k"):
        ChunkKV((1, 2), 0, k[0], k[0])  # 3-D
    with pytest.raises(ValueError, match="ChunkKV.v"):
        ChunkKV((1, 2), 0, k, torch.randn(L, 2, H, D + 1))
    with pytest.raises(ValueError, match="ChunkKV.token_ids"):
        ChunkKV((1, 2, 3), 0, k, k.clone())
    with pytest.raises(ValueError, match="ChunkKV.start"):
        ChunkKV((1, 2), -1, k, k.clone())
    with pytest.raises(ValueError, match="ChunkKV.k"):
        ChunkKV((1, 2), 0, k.numpy(), k)
    with pytest.raises(ValueError, match="device_budget_bytes"):
        ChunkStore(FP, -1)
    with pytest.raises(ValueError, match="cpu_budget_bytes"):
        ChunkStore(FP, 10, -1)
    with pytest.raises(ValueError, match="ChunkKV"):
        ChunkStore(FP, 10).put("a", (k, k))


# ---------------------------------------------------------------- threads and CUDA

def test_threads_smoke():
    s = ChunkStore(FP, 6 * UNIT, 6 * UNIT)
    entries = [make() for _ in range(16)]
    errors = []

    def worker(seed):
        try:
            for j in range(300):
                i = (seed * 7 + j) % 16
                key = f"k{i}"
                if s.get(key) is None:
                    s.put(key, entries[i])
                else:
                    try:
                        got = s.acquire(key)
                    except KeyError:
                        continue  # evicted between get and acquire: a legal race outcome
                    assert same(got, entries[i])
                    s.release(key)
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not s._refs
    check(s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cpu_tier_is_pinned():
    s = ChunkStore(FP, UNIT, UNIT, device="cuda")
    a = make()
    s.put("a", a)
    s.put("b", make())
    assert s._cpu["a"].k.is_pinned() and s._dev["b"].k.is_cuda
    assert same(s.get("a").to("cpu"), a)
