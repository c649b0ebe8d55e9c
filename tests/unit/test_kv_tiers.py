"""Tiers under the GPU pool: the entry format, the CPU and disk tiers, the stack that moves entries."""

import errno
import logging
import os
import time

import numpy as np
import pytest
import torch

from redknot.cache.tiers import CorruptEntry, KVEntry, KVOffloadConfig, Layout, TierStack, tier_key
from redknot.cache.tiers.cpu import CpuTier
from redknot.cache.tiers.disk import DiskTier
from redknot.cache.tiers.entry import PREAMBLE, decode, decode_header
from redknot.cache.tiers.redis import CircuitBreaker

L, H, D = 2, 3, 8
LAYOUT = Layout("fp", "plan", "float32", 16, D, L, H)


def make(n=5, seed=0, layout=LAYOUT, chunk="chunk"):
    g = torch.Generator().manual_seed(seed)
    dtype = layout.torch_dtype
    k = torch.randn(L, n, H, D, generator=g).to(dtype)
    v = torch.randn(L, n, H, D, generator=g).to(dtype)
    ck = f"{chunk}-{seed}"
    return KVEntry.build(tier_key(ck, layout), ck, layout, range(100, 100 + n), 7, k, v), k, v


def blob(entry):
    return bytearray(b"".join(entry.encode()))


# ---------------------------------------------------------------- entry


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_entry_round_trips_bit_exact(dtype):
    layout = Layout("fp", "plan", dtype, 16, D, L, H)
    e, k, v = make(layout=layout)
    got = decode(blob(e), e.key, layout)
    gk, gv = got.kv()
    assert torch.equal(gk, k.transpose(1, 2)) and torch.equal(gv, v.transpose(1, 2))
    assert got.header.token_ids == tuple(range(100, 105)) and got.header.start == 7
    assert len(blob(e)) == e.nbytes


def test_key_covers_every_layout_field_and_the_chunk():
    keys = {tier_key("c", LAYOUT), tier_key("d", LAYOUT)}
    for field, value in [("fingerprint", "fp2"), ("plan", "p2"), ("dtype", "bfloat16"), ("page_size", 32),
                         ("head_dim", 16), ("num_layers", 3), ("num_kv_heads", 4)]:
        keys.add(tier_key("c", Layout(**{**LAYOUT.__dict__, field: value})))
    assert len(keys) == 9


def test_a_flipped_payload_byte_is_rejected_and_names_its_head():
    e, _, _ = make()
    b = blob(e)
    seg = e.header.segment_bytes
    b[len(b) - 4 * seg + 3] ^= 1  # inside head 2 * 3 - 4 = flat head 2
    with pytest.raises(CorruptEntry, match="segment 2"):
        decode(b, e.key, LAYOUT)


def test_header_damage_truncation_and_mismatches_are_rejected():
    e, _, _ = make()
    b = blob(e)
    bad = bytearray(b)
    bad[PREAMBLE.size + 5] ^= 0xFF
    with pytest.raises(CorruptEntry, match="header checksum"):
        decode(bad, e.key, LAYOUT)
    with pytest.raises(CorruptEntry, match="truncated|bytes"):
        decode(b[:-1], e.key, LAYOUT)
    with pytest.raises(CorruptEntry, match="truncated"):
        decode(b[:10], e.key, LAYOUT)
    with pytest.raises(CorruptEntry, match="magic"):
        decode(b"XXXX" + b[4:], e.key, LAYOUT)
    with pytest.raises(CorruptEntry, match="key"):
        decode(b, tier_key("other", LAYOUT), LAYOUT)
    with pytest.raises(CorruptEntry, match="layout"):
        decode(b, e.key, Layout("fp2", "plan", "float32", 16, D, L, H))


def test_partial_entries_hold_and_verify_only_their_heads():
    e, k, _ = make()
    part = e.select([1, 4])
    assert part.payload.numel() == 2 * e.header.segment_bytes
    part.verify()
    seg = part.payload.view(torch.float32).view(2, 2, 5, D)  # [heads, K/V, n, D]
    assert torch.equal(seg[0, 0], k[0, :, 1]) and torch.equal(seg[1, 0], k[1, :, 1])  # (l0, h1), (l1, h1)
    part.payload[0] ^= 1
    with pytest.raises(CorruptEntry):
        part.verify()


# ---------------------------------------------------------------- CPU tier


def test_cpu_tier_is_bounded_lru_and_spills_what_it_evicts():
    entries = [make(seed=i)[0] for i in range(4)]
    tier = CpuTier(max_bytes=3 * entries[0].nbytes)
    assert tier.put(entries[0]) == [] and tier.put(entries[1]) == [] and tier.put(entries[2]) == []
    assert tier.get(entries[0].key, LAYOUT) is not None  # 0 is now the most recent
    evicted = tier.put(entries[3])
    assert [e.key for e in evicted] == [entries[1].key]
    assert tier.bytes <= tier.max_bytes and len(tier) == 3
    big = make(n=50, seed=99)[0]
    assert tier.put(big) == [big] and not tier.contains(big.key)  # larger than the tier: passed below
    assert tier.get("00", LAYOUT) is None and tier.stats.misses == 1


def test_cpu_tier_rejects_a_corrupted_entry_and_drops_it():
    e, _, _ = make()
    tier = CpuTier(1 << 20)
    tier.put(e)
    e.payload[11] ^= 0x40
    assert tier.get(e.key, LAYOUT) is None
    assert tier.stats.rejected == 1 and not tier.contains(e.key) and tier.bytes == 0
    e2, _, _ = make(seed=1)
    tier.put(e2)
    assert tier.get(e2.key, Layout("other", "plan", "float32", 16, D, L, H)) is None  # another model
    assert tier.stats.rejected == 2


# ---------------------------------------------------------------- disk tier


def files(d):
    return sorted(p.name for p in d.rglob("*") if p.is_file())


def test_disk_tier_round_trip_partial_read_and_bound(tmp_path):
    entries = [make(seed=i)[0] for i in range(3)]
    tier = DiskTier(tmp_path, max_bytes=2 * entries[0].nbytes)
    for e in entries[:2]:
        tier.put(e)
    part = tier.get(entries[1].key, LAYOUT, np.array([0, 5]))
    assert torch.equal(part.payload, entries[1].select([0, 5]).payload)
    assert tier.stats.bytes_saved == 4 * entries[1].header.segment_bytes
    full = tier.get(entries[0].key, LAYOUT)
    assert torch.equal(full.payload, entries[0].payload)
    tier.put(entries[2])  # entry 1 is the least recently read: its file goes
    assert not tier.contains(entries[1].key) and tier.contains(entries[0].key) and tier.contains(entries[2].key)
    assert tier.bytes <= tier.max_bytes and len(files(tmp_path)) == 2
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.rkv")) == tier.bytes


def test_disk_tier_is_found_again_after_a_restart_in_lru_order(tmp_path):
    entries = [make(seed=i)[0] for i in range(3)]
    tier = DiskTier(tmp_path, max_bytes=3 * entries[0].nbytes)
    for e in entries:
        tier.put(e)
        time.sleep(0.02)  # distinct access times
    tier.get(entries[0].key, LAYOUT)  # 0 becomes the most recent
    again = DiskTier(tmp_path, max_bytes=3 * entries[0].nbytes)
    assert again.recovered == 3 and again.bytes == tier.bytes
    got = again.get(entries[2].key, LAYOUT)
    assert torch.equal(got.payload, entries[2].payload)
    again.put(make(seed=9)[0])  # evicts the least recent: 1 (0 and 2 were read later)
    assert not again.contains(entries[1].key) and again.contains(entries[0].key)
    smaller = DiskTier(tmp_path, max_bytes=entries[0].nbytes)  # a smaller bound at start trims to it
    assert len(smaller) == 1 and len(files(tmp_path)) == 1


def test_disk_tier_rejects_a_flipped_byte_and_a_truncated_file(tmp_path):
    a, b = make(seed=1)[0], make(seed=2)[0]
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(a)
    tier.put(b)
    path_a = tier._path(a.key)
    data = bytearray(path_a.read_bytes())
    data[-7] ^= 0x01
    path_a.write_bytes(data)
    assert tier.get(a.key, LAYOUT) is None and not path_a.exists() and tier.stats.rejected == 1
    path_b = tier._path(b.key)
    path_b.write_bytes(path_b.read_bytes()[:-100])
    assert tier.get(b.key, LAYOUT) is None and not path_b.exists() and tier.stats.rejected == 2
    assert tier.bytes == 0 and len(tier) == 0


def test_disk_tier_start_drops_damaged_files_and_stale_temporaries(tmp_path):
    good, torn = make(seed=1)[0], make(seed=2)[0]
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(good)
    tier.put(torn)
    p = tier._path(torn.key)
    p.write_bytes(p.read_bytes()[:PREAMBLE.size + 20])  # a torn write (power loss without fsync)
    stale = p.with_name(f".{torn.key}.123.abcd.tmp")
    stale.write_bytes(b"half an entry")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = p.with_name(f".{torn.key}.456.abcd.tmp")  # a live writer's: left alone
    fresh.write_bytes(b"in progress")
    again = DiskTier(tmp_path, 1 << 20)
    assert again.recovered == 1 and again.stats.rejected == 1
    assert not p.exists() and not stale.exists() and fresh.exists()
    assert again.get(good.key, LAYOUT) is not None


def test_disk_write_is_atomic_when_the_writer_dies_mid_file(tmp_path, monkeypatch):
    e = make()[0]
    tier = DiskTier(tmp_path, 1 << 20)

    def die(*_):
        raise OSError(errno.EIO, "the writer died before the rename")

    monkeypatch.setattr(os, "replace", die)
    tier.put(e)
    monkeypatch.undo()
    assert files(tmp_path) == [] and not tier.contains(e.key) and tier.stats.errors == 1
    assert tier.get(e.key, LAYOUT) is None and tier.disabled is None  # an I/O error is not a full disk
    tier.put(e)
    assert tier.get(e.key, LAYOUT) is not None


def test_a_full_disk_disables_the_tier_with_one_warning(tmp_path, monkeypatch, caplog):
    tier = DiskTier(tmp_path, 1 << 20)
    real_open = open

    def full(path, mode="r", *a, **kw):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.WARNING):
        tier.put(make(seed=1)[0])
        tier.put(make(seed=2)[0])
    monkeypatch.undo()
    assert tier.disabled and tier.stats.errors == 1 and tier.stats.skipped == 1
    assert sum("disabled" in r.message for r in caplog.records) == 1 and files(tmp_path) == []


def test_processes_sharing_a_directory_find_each_others_entries(tmp_path):
    a, b = DiskTier(tmp_path, 1 << 20), DiskTier(tmp_path, 1 << 20)
    e = make()[0]
    a.put(e)
    assert b.get(e.key, LAYOUT) is not None and len(b) == 1
    a.delete(e.key)
    assert b.get(e.key, LAYOUT) is None and len(b) == 0  # evicted elsewhere: a miss, forgotten


# ---------------------------------------------------------------- the stack


def test_stack_spills_cpu_evictions_to_disk_and_promotes_disk_hits(tmp_path):
    entries = [make(seed=i)[0] for i in range(3)]
    stack = KVOffloadConfig(cpu_bytes=2 * entries[0].nbytes, disk_dir=str(tmp_path), disk_bytes=1 << 20,
                            write_behind=False).build()
    for e in entries:
        stack.store(e)
    assert not stack.cpu.contains(entries[0].key) and stack.disk.contains(entries[0].key)
    assert not stack.disk.contains(entries[2].key)  # still in the CPU tier only (write-back)
    got, tier = stack.fetch(entries[0].key, LAYOUT)
    assert tier == "disk" and torch.equal(got.payload, entries[0].payload)
    assert stack.cpu.contains(entries[0].key)  # promoted; it pushed entry 1 down
    assert stack.disk.contains(entries[1].key)
    assert stack.fetch(entries[0].key, LAYOUT)[1] == "cpu"
    stack.store(make(seed=7)[0], through=True)
    assert stack.disk.contains(make(seed=7)[0].key)  # write-through reaches disk at once
    assert stack.fetch("ab" * 16, LAYOUT) is None


def test_write_behind_entries_are_found_before_they_land_and_flush_waits(tmp_path, monkeypatch):
    stack = KVOffloadConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20).build()
    slow_put = stack.disk.put

    def slow(entry):
        time.sleep(0.2)
        return slow_put(entry)

    monkeypatch.setattr(stack.disk, "put", slow)
    e = make()[0]
    stack.store(e)
    assert stack.has(e.key)
    got, tier = stack.fetch(e.key, LAYOUT)
    assert tier == "pending" and torch.equal(got.payload, e.payload)
    stack.flush()
    assert stack.disk.contains(e.key) and stack.info()["pending_writes"] == 0
    stack.close()


def test_offload_config_checks_its_fields():
    with pytest.raises(ValueError, match="disk_bytes"):
        KVOffloadConfig(disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="write_policy"):
        KVOffloadConfig(cpu_bytes=1, write_policy="sometimes")
    with pytest.raises(ValueError, match="unknown kv_offload option"):
        KVOffloadConfig.of({"cpu_byte": 1})
    assert KVOffloadConfig.of({"cpu_bytes": 5}).cpu_bytes == 5
    assert KVOffloadConfig().build() is None


def test_circuit_breaker_backs_off_doubling_and_closes_on_success():
    now = [0.0]
    cb = CircuitBreaker(base_s=1.0, max_s=3.0, clock=lambda: now[0])
    assert cb.allow() and cb.failure()  # first failure: warn
    assert not cb.allow()
    now[0] = 1.0
    assert cb.allow() and not cb.failure() and cb.backoff == 2.0  # a failed retry: longer, no new warning
    now[0] = 2.9
    assert not cb.allow()
    now[0] = 3.0
    cb.failure()
    assert cb.backoff == 3.0  # capped
    cb.success()
    assert cb.allow() and cb.backoff == 0.0


def test_header_decodes_from_its_own_bytes():
    e = make()[0]
    h = decode_header(e.header.encode())
    assert h.key == e.key and np.array_equal(h.head_checksums, e.header.head_checksums)
