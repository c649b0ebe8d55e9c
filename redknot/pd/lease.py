"""Leases: a prefilled request's pages, kept in the prefill pool until a decode instance pulls them.

The engine thread creates a lease when an exported request finishes (the lease takes one reference
on each of the request's pages) and releases leases; a transport thread checks a lease out to send
it and marks it done. Pool bookkeeping is not thread-safe, so transport threads never touch the
pool's free list: a lease that is done (or has expired while nobody held it) waits in the store
until the engine thread ``collect``s it and drops its references. ``wake`` tells the engine's loop
that something is ready to collect.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Lease:
    lease_id: str
    pages: np.ndarray  # int32 [P]: pool pages, in the payload's order (layer, KV head, logical page)
    header: object  # wire.HandoffHeader, without the payload's size and checksum
    k_pages: object  # the pool's K and V page tensors the pages index
    v_pages: object
    head_class: np.ndarray  # str [L * Hkv]: each head's class ("global", "local", "retrieval")
    page_head: np.ndarray  # int [P]: the flat head index of each page
    expires: float
    busy: bool = False  # a transport is sending it
    done: bool = False  # pulled (or given up): its pages can go
    created: float = field(default_factory=time.monotonic)


class LeaseStore:
    def __init__(self, ttl_s: float = 30.0):
        self.ttl_s = ttl_s
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.wake = lambda: None  # set by the engine's front: something may be ready to collect
        self.created = self.pulled = self.expired = 0

    def add(self, lease: Lease) -> None:
        with self._lock:
            if lease.lease_id in self._leases:
                raise ValueError(f"lease {lease.lease_id!r} exists")
            self._leases[lease.lease_id] = lease
            self.created += 1

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def checkout(self, lease_id: str) -> Lease | None:
        """The lease, marked busy (it will not expire while sent), or None when unknown, expired,
        already pulled or being sent."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.busy or lease.done or lease.expires <= time.monotonic():
                return None
            lease.busy = True
            return lease

    def finish(self, lease: Lease, pulled: bool = True) -> None:
        """A transport is through with the lease: its pages may go (``pulled``: it was delivered)."""
        with self._lock:
            lease.busy, lease.done = False, True
            self.pulled += pulled
        self.wake()

    def give_back(self, lease: Lease) -> None:
        """A send failed before anything was delivered: the lease stays until pulled again or expired."""
        with self._lock:
            lease.busy = False

    def collect(self, now: float | None = None) -> list[Lease]:
        """Remove and return the leases whose pages can go: done, or expired and not being sent."""
        now = time.monotonic() if now is None else now
        with self._lock:
            out = [x for x in self._leases.values() if x.done or (not x.busy and x.expires <= now)]
            for x in out:
                del self._leases[x.lease_id]
                self.expired += not x.done
        return out

    def next_deadline(self) -> float | None:
        """When the next lease expires (time.monotonic()), or None."""
        with self._lock:
            return min((x.expires for x in self._leases.values() if not x.busy), default=None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def stats(self) -> dict:
        with self._lock:
            return {"active": len(self._leases), "pages": int(sum(x.pages.size for x in self._leases.values())),
                    "created": self.created, "pulled": self.pulled, "expired": self.expired}
