"""The CPU tier: serialized entries in host memory (pinned where CUDA is available), LRU, bounded."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .base import Tier
from .entry import CorruptEntry, KVEntry, Layout


class CpuTier(Tier):
    name = "cpu"

    def __init__(self, max_bytes: int, verify: bool = True):
        """``verify``: check checksums on every read (the bytes never left this process, but a
        wrong entry must never reach the pool; off saves one hash pass per fetch)."""
        super().__init__()
        if max_bytes < 0:
            raise ValueError(f"CPU tier max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self.verify = int(max_bytes), verify
        self._entries: OrderedDict[str, KVEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def contains(self, key: str) -> bool:
        return key in self._entries

    def touch(self, key: str) -> bool:
        """Mark ``key`` most recently used; False when absent."""
        with self._lock:
            if key not in self._entries:
                return False
            self._entries.move_to_end(key)
            return True

    def get(self, key: str, layout: Layout, heads: np.ndarray | None = None) -> KVEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
        try:
            entry.header.check(key, layout)
            out = entry if heads is None else entry.select(heads)
            if self.verify:
                out.verify()
        except CorruptEntry:
            self.stats.rejected += 1
            self.delete(key)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += out.payload.numel()
        self.stats.bytes_saved += entry.payload.numel() - out.payload.numel()
        return out

    def put(self, entry: KVEntry) -> list[KVEntry]:
        if entry.heads is not None:
            raise ValueError("the CPU tier keeps whole entries only")
        size = entry.nbytes
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
                return []
            if size > self.max_bytes:
                self.stats.skipped += 1
                return [entry]  # too large to keep here: straight to the tier below
            evicted = []
            while self._bytes + size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                self.stats.evictions += 1
                evicted.append(old)
            self._entries[entry.key] = entry
            self._bytes += size
            self.stats.puts += 1
            self.stats.bytes_written += entry.payload.numel()
        return evicted

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def info(self) -> dict:
        return {**self.stats.as_dict(), "entries": len(self._entries), "bytes": self._bytes,
                "max_bytes": self.max_bytes}
