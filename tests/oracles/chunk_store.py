"""Two-tier LRU store of dense chunk K/V: the reference reuse prefill's chunk storage (test oracle).

A device tier (where the oracle reads from) and a CPU tier that catches what the device tier
evicts. Entries in use are pinned by reference counts and never evicted or moved.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

import torch

from redknot.cache.chunk_kv import ChunkKV, chunk_key


class ChunkStore:
    """Two-tier LRU cache of `ChunkKV` keyed by `chunk_key`. Thread-safe.

    Stats: `hits` counts every `get` that returned an entry, `cpu_hits` the subset served from the
    CPU tier; `evictions` counts entries dropped from the store (not device->CPU moves, which are
    `spills`); `rejected` counts `put`s that stored nothing. `acquire`/`release` do not count.
    """

    def __init__(self, fingerprint: str, device_budget_bytes: int, cpu_budget_bytes: int = 0,
                 device="cpu"):
        if device_budget_bytes < 0:
            raise ValueError(f"device_budget_bytes must be >= 0, got {device_budget_bytes}")
        if cpu_budget_bytes < 0:
            raise ValueError(f"cpu_budget_bytes must be >= 0, got {cpu_budget_bytes}")
        self.fingerprint = fingerprint
        self.device_budget_bytes = int(device_budget_bytes)
        self.cpu_budget_bytes = int(cpu_budget_bytes)
        self.device = torch.device(device)
        # Pinned host memory makes device<->host copies async-capable and faster; only for CUDA.
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._lock = threading.Lock()
        self._dev: OrderedDict[str, ChunkKV] = OrderedDict()  # LRU first, MRU last
        self._cpu: OrderedDict[str, ChunkKV] = OrderedDict()
        self._refs: dict[str, int] = {}  # acquired keys (always on the device tier)
        self._bytes_dev = 0
        self._bytes_cpu = 0
        self._hits = self._misses = self._cpu_hits = 0
        self._evictions = self._spills = self._rejected = 0

    # ------------------------------------------------------------------ public API

    def key(self, prefix_ids, chunk_ids) -> str:
        return chunk_key(self.fingerprint, prefix_ids, chunk_ids)

    def get(self, key: str) -> ChunkKV | None:
        """The entry on the device tier, or None. A CPU-tier hit is promoted to the device tier;
        if acquired entries leave no room for it, a device copy is returned and it stays on CPU."""
        with self._lock:
            if self._valid(self._dev, key):
                self._dev.move_to_end(key)
                self._hits += 1
                return self._dev[key]
            if self._valid(self._cpu, key):
                self._hits += 1
                self._cpu_hits += 1
                entry = self._promote(key)
                if entry is None:
                    self._cpu.move_to_end(key)
                    return self._cpu[key].to(self.device)
                return entry
            self._misses += 1
            return None

    def put(self, key: str, entry: ChunkKV) -> bool:
        """Store on the device tier (spilling LRU entries to the CPU tier). False if not stored:
        the entry exceeds the device budget, or acquired entries leave no room for it."""
        if not isinstance(entry, ChunkKV):
            raise ValueError(f"entry must be a ChunkKV, got {type(entry).__name__}")
        if entry.fingerprint is not None and entry.fingerprint != self.fingerprint:
            raise ValueError(f"entry.fingerprint {entry.fingerprint!r} does not match the store's "
                             f"{self.fingerprint!r}: K/V computed under another model")
        with self._lock:
            if key in self._dev:  # same key = same content: keep the stored one
                self._dev.move_to_end(key)
                return True
            if not self._fits_device(entry.nbytes):
                self._rejected += 1
                return False
            if key in self._cpu:  # stale copy of the same content; the new one supersedes it
                self._bytes_cpu -= self._cpu.pop(key).nbytes
            self._insert_device(key, dataclasses.replace(entry.to(self.device),
                                                         fingerprint=self.fingerprint))
            return True

    def acquire(self, key: str) -> ChunkKV:
        """Pin `key` for a running request (counted; pair with `release`) and return its
        device-tier entry, promoting it from the CPU tier if needed. KeyError if not available."""
        with self._lock:
            if self._valid(self._dev, key):
                entry = self._dev[key]
                self._dev.move_to_end(key)
            elif self._valid(self._cpu, key):
                entry = self._promote(key)
                if entry is None:
                    raise KeyError(f"chunk {key!r} is on the CPU tier and acquired entries leave "
                                   f"no room to bring it to the device tier")
            else:
                raise KeyError(f"chunk {key!r} is not in the store")
            self._refs[key] = self._refs.get(key, 0) + 1
            return entry

    def release(self, key: str) -> None:
        with self._lock:
            n = self._refs.get(key, 0)
            if n == 0:
                raise ValueError(f"release({key!r}): key is not acquired "
                                 f"(release without a matching acquire)")
            if n == 1:
                del self._refs[key]
            else:
                self._refs[key] = n - 1

    def contains(self, key: str) -> bool:
        with self._lock:
            return self._valid(self._dev, key) or self._valid(self._cpu, key)

    __contains__ = contains

    def __len__(self) -> int:
        with self._lock:
            return len(self._dev) + len(self._cpu)

    def clear(self) -> None:
        """Drop every entry that is not acquired (stats are kept)."""
        with self._lock:
            self._cpu.clear()
            self._bytes_cpu = 0
            for k in [k for k in self._dev if k not in self._refs]:
                self._bytes_dev -= self._dev.pop(k).nbytes

    def stats(self) -> dict:
        with self._lock:
            lookups = self._hits + self._misses
            return {
                "hits": self._hits, "misses": self._misses, "cpu_hits": self._cpu_hits,
                "evictions": self._evictions, "spills": self._spills, "rejected": self._rejected,
                "entries_device": len(self._dev), "entries_cpu": len(self._cpu),
                "bytes_device": self._bytes_dev, "bytes_cpu": self._bytes_cpu,
                "device_budget_bytes": self.device_budget_bytes,
                "cpu_budget_bytes": self.cpu_budget_bytes,
                "hit_rate": self._hits / lookups if lookups else 0.0,
            }

    # ------------------------------------------------------------------ internals (lock held)

    def _valid(self, tier: OrderedDict, key: str) -> bool:
        # Defence in depth: the key already includes the fingerprint, but an entry from another
        # model that reached this key space (shared tier, bug elsewhere) must still never match.
        e = tier.get(key)
        return e is not None and e.fingerprint == self.fingerprint

    def _fits_device(self, nbytes: int) -> bool:
        """Whether `nbytes` fits once every unacquired device entry is evicted."""
        pinned = sum(self._dev[k].nbytes for k in self._refs)
        return pinned + nbytes <= self.device_budget_bytes

    def _insert_device(self, key: str, entry: ChunkKV) -> None:
        """Insert at MRU after spilling LRU unacquired entries; caller checked `_fits_device`."""
        excess = self._bytes_dev + entry.nbytes - self.device_budget_bytes
        victims = []
        for k, e in self._dev.items():  # LRU first
            if excess <= 0:
                break
            if k not in self._refs:
                victims.append(k)
                excess -= e.nbytes
        for k in victims:
            self._spill(k, self._dev.pop(k))
        self._dev[key] = entry
        self._bytes_dev += entry.nbytes

    def _spill(self, key: str, entry: ChunkKV) -> None:
        """Move an entry evicted from the device tier to the CPU tier, or drop it."""
        self._bytes_dev -= entry.nbytes
        if entry.nbytes > self.cpu_budget_bytes:
            self._evictions += 1
            return
        while self._bytes_cpu + entry.nbytes > self.cpu_budget_bytes:
            _, old = self._cpu.popitem(last=False)
            self._bytes_cpu -= old.nbytes
            self._evictions += 1
        self._cpu[key] = self._to_host(entry)
        self._bytes_cpu += entry.nbytes
        self._spills += 1

    def _promote(self, key: str) -> ChunkKV | None:
        """Move a CPU-tier entry to the device tier; None (nothing moved) if it cannot fit."""
        entry = self._cpu[key]
        if not self._fits_device(entry.nbytes):
            return None
        del self._cpu[key]  # first, so the spills it causes can use its room
        self._bytes_cpu -= entry.nbytes
        dev = entry.to(self.device, non_blocking=self._pin)  # pinned source: async H2D is safe
        self._insert_device(key, dev)
        return dev

    def _to_host(self, entry: ChunkKV) -> ChunkKV:
        if not self._pin:
            return entry.to("cpu")

        def pinned(t):
            try:
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError:  # pinning can fail (limits, no driver): plain memory still works
                out = torch.empty(t.shape, dtype=t.dtype)
            return out.copy_(t)  # blocking: the host copy must be complete before anyone reads it

        return dataclasses.replace(entry, k=pinned(entry.k), v=pinned(entry.v))
