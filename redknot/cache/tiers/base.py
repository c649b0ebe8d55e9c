"""What every tier below the GPU pool offers, and the counters it keeps."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .entry import KVEntry, Layout


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0  # entries written
    evictions: int = 0  # entries dropped to stay within the tier's bound
    rejected: int = 0  # entries read back corrupt or mismatched: dropped, never returned
    errors: int = 0  # operations that failed (I/O, connection); the caller went on without the tier
    skipped: int = 0  # operations not tried (tier disabled or its circuit open)
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_saved: int = 0  # payload bytes partial (per-head) reads left unread

    def as_dict(self) -> dict:
        return asdict(self)


class Tier:
    """A bounded store of serialized KV entries keyed by ``tier_key``.

    ``get`` returns a verified entry or None (a corrupt one is dropped and counted as rejected);
    ``put`` never raises for a full or failing tier: it stores, evicts, or skips and counts."""

    name = "tier"

    def __init__(self):
        self.stats = TierStats()

    def get(self, key: str, layout: Layout, heads: np.ndarray | None = None) -> KVEntry | None:
        raise NotImplementedError

    def put(self, entry: KVEntry) -> list[KVEntry]:
        """Store ``entry``; returns the entries evicted to make room (a tier above spills them)."""
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def info(self) -> dict:
        """Counters plus what the tier holds now."""
        return self.stats.as_dict()

    def close(self) -> None:
        pass
