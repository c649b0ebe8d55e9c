"""The tiers under the GPU pool, in order: CPU, disk, Redis; and how entries move between them.

``store`` puts an entry into the CPU tier (or the first tier there is); what the CPU tier evicts
spills to disk; Redis is written through, and so is disk for a new entry under write-through. Tiers are inclusive: an entry stays in
a lower tier when it moves up, so evicting it again from the pool costs no copy when the CPU
tier still holds it (``has`` tells the pool so). ``fetch`` looks in CPU, disk, then Redis and
promotes a hit from disk or Redis into the CPU tier.

Writes to disk and Redis run on one background thread (``write_behind``), off the caller's step
loop; an entry on its way there is still found by ``fetch``. ``flush`` waits for them.

``store_later`` takes an entry whose bytes are still on their way to the host (a device-to-host
copy on a side stream, an event marking its end): a second thread waits for the copy, checksums
the entry and stores it, so the step loop only enqueues. Its queue is bounded; when it is full the
write-down is dropped (counted in ``downs_dropped``), never waited for. ``fetch`` of a key on its
way down waits for it (at most ``down_wait_s``).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .base import Tier
from .cpu import CpuTier
from .entry import KVEntry, Layout

log = logging.getLogger(__name__)
WRITE_POLICIES = ("write_through", "write_back")


@dataclass
class KVOffloadConfig:
    """Tiers for document KV under the GPU pool (each off when its size or address is unset).

    ``cpu_bytes``: host memory (pinned where CUDA is available); ``disk_dir``/``disk_bytes``: one
    file per entry under a directory that survives restarts; ``redis_url``: a Redis/Valkey server
    (``redis://host:port/db``) shared by replicas, entries expiring after ``redis_ttl_s`` if set."""
    cpu_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    redis_url: str | None = None
    redis_ttl_s: float | None = None
    redis_timeout_s: float = 0.5
    # "write_through": a document's KV goes down as soon as it is computed (a restart or another
    # replica finds it); "write_back": only when the pool evicts it
    write_policy: str = "write_through"
    verify_cpu: bool = True
    disk_fsync: bool = False
    write_behind: bool = True  # disk and Redis writes on a background thread
    # a request whose documents are below the pool waits while they load on a background thread
    # (others keep running); off: loaded synchronously in its admission
    async_loads: bool = True
    per_head_fetch: bool = True  # an asynchronous load reads only the heads the request's plan can see
    load_timeout_s: float = 10.0  # a load taking longer is given up: the documents are computed

    def __post_init__(self):
        for name in ("cpu_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"kv_offload.{name} must be >= 0, got {getattr(self, name)}")
        if self.disk_dir and self.disk_bytes <= 0:
            raise ValueError("kv_offload.disk_dir needs disk_bytes > 0 (the tier's bound)")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("kv_offload.disk_bytes needs disk_dir")
        if self.redis_ttl_s is not None and self.redis_ttl_s <= 0:
            raise ValueError(f"kv_offload.redis_ttl_s must be > 0 or None, got {self.redis_ttl_s}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv_offload.write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.load_timeout_s <= 0:
            raise ValueError(f"kv_offload.load_timeout_s must be > 0, got {self.load_timeout_s}")
        if self.redis_timeout_s <= 0:
            raise ValueError(f"kv_offload.redis_timeout_s must be > 0, got {self.redis_timeout_s}")

    @classmethod
    def of(cls, value) -> "KVOffloadConfig | None":
        """From a KVOffloadConfig, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown kv_offload option(s): {', '.join(sorted(unknown))} "
                                 f"(known: {', '.join(cls.__dataclass_fields__)})")
            return cls(**value)
        raise TypeError(f"kv_offload must be a KVOffloadConfig, a dict or None, got {type(value).__name__}")

    @property
    def active(self) -> bool:
        return bool(self.cpu_bytes or self.disk_dir or self.redis_url)

    def build(self, pin: bool = False) -> "TierStack | None":
        if not self.active:
            return None
        cpu = CpuTier(self.cpu_bytes, self.verify_cpu) if self.cpu_bytes else None
        disk = redis = None
        if self.disk_dir:
            from .disk import DiskTier
            disk = DiskTier(self.disk_dir, self.disk_bytes, self.disk_fsync, pin)
        if self.redis_url:
            from .redis import RedisTier
            redis = RedisTier(self.redis_url, self.redis_ttl_s, self.redis_timeout_s, pin=pin)
        return TierStack(cpu, disk, redis, self.write_behind, write_policy=self.write_policy)


class TierStack:
    def __init__(self, cpu: CpuTier | None, disk: Tier | None, redis: Tier | None, write_behind: bool = True,
                 max_pending_bytes: int = 1 << 30, write_policy: str = "write_through", max_pending_downs: int = 64,
                 down_wait_s: float = 2.0):
        """``max_pending_bytes``: entries waiting for the writer thread at most; past it the
        caller writes itself, so a slow disk or server slows eviction instead of growing memory.
        ``max_pending_downs``: write-downs (``store_later``) waiting at most; past it they are dropped."""
        self.cpu, self.disk, self.redis = cpu, disk, redis
        self.max_pending_bytes = max_pending_bytes
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.write_policy = write_policy
        self._pending_bytes = 0
        self.tiers = [t for t in (cpu, disk, redis) if t is not None]
        self.fetches = self.fetch_hits = 0
        self._pending: dict[str, tuple[KVEntry, int]] = {}  # on their way to disk / Redis: (entry, writes queued)
        self._lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._thread = None
        self.down_wait_s = down_wait_s
        self.downs_done = self.downs_dropped = self.down_errors = 0
        self._inflight: dict[str, threading.Event] = {}  # keys on their way down (store_later)
        self._down: queue.Queue | None = None
        if write_behind:
            self._down = queue.Queue(maxsize=max(1, max_pending_downs))
            self._down_thread = threading.Thread(target=self._downer, name="kv-tier-down", daemon=True)
            self._down_thread.start()
        if write_behind and (disk is not None or redis is not None):
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._writer, name="kv-tier-writer", daemon=True)
            self._thread.start()
        if self._down is not None or self._queue is not None:
            ref = weakref.ref(self)
            atexit.register(lambda: (s := ref()) is not None and s.flush())  # a clean exit loses no write

    # ------------------------------------------------------------------ writes

    def has(self, key: str) -> bool:
        """The CPU tier holds ``key`` (now most recently used): storing it again copies nothing.
        Without a CPU tier: an earlier store of it is on its way down or done."""
        if key in self._inflight:
            return True
        if self.cpu is not None:
            return self.cpu.touch(key)
        with self._lock:
            if key in self._pending or key in self._inflight:
                return True
        return self.disk is not None and self.disk.contains(key)

    def store(self, entry: KVEntry, through: bool = False) -> None:
        """Keep an entry: in the CPU tier (what it evicts spills to disk) and in Redis; with
        ``through`` (a new entry under write-through) on disk at once too."""
        below = [entry] if self.cpu is None else self.cpu.put(entry)
        if through and entry not in below:
            below.append(entry)
        down = [(self.disk, e) for e in below if self.disk is not None]
        if self.redis is not None:
            down.append((self.redis, entry))
        for tier, e in down:
            self._write(tier, e)

    def store_later(self, key: str, build, event=None, through: bool = False) -> bool:
        """Store ``build()`` (a KVEntry for ``key``) once ``event`` (a device-to-host copy's end, or
        None) has passed, on the down thread (at once without ``write_behind``). False when the
        queue is full: the write-down is dropped."""
        if self._down is None:
            if event is not None:
                event.synchronize()
            self.store(build(), through)
            self.downs_done += 1
            return True
        with self._lock:
            if key in self._inflight:
                return True
            done = self._inflight[key] = threading.Event()
            try:
                self._down.put_nowait((key, build, event, through, done))
            except queue.Full:
                del self._inflight[key]
                self.downs_dropped += 1
                return False
        return True

    def _downer(self) -> None:
        while True:
            item = self._down.get()
            try:
                if item is None:
                    return
                key, build, event, through, done = item
                try:
                    if event is not None:
                        event.synchronize()
                    self.store(build(), through)
                    self.downs_done += 1
                except Exception as e:  # e.g. no host memory: the entry is only missing below
                    self.down_errors += 1
                    log.warning("kv tiers: write-down of %s failed: %s", key, e)
                finally:
                    with self._lock:
                        self._inflight.pop(key, None)
                    done.set()
            finally:
                self._down.task_done()

    def _write(self, tier: Tier, entry: KVEntry) -> None:
        if self._queue is None:
            self._put(tier, entry)
            return
        with self._lock:
            if self._pending_bytes + entry.nbytes > self.max_pending_bytes and self._pending:
                backlog = True  # the writer is behind: this caller writes itself (bounded memory)
            else:
                backlog = False
                held = self._pending.get(entry.key)
                self._pending[entry.key] = (entry, 1 if held is None else held[1] + 1)
                if held is None:
                    self._pending_bytes += entry.nbytes
        if backlog:
            self._put(tier, entry)
        else:
            self._queue.put((tier, entry))

    def _put(self, tier: Tier, entry: KVEntry) -> None:
        try:
            tier.put(entry)
        except Exception as e:  # a tier's own failures are counted inside; this is a bug guard
            tier.stats.errors += 1
            log.exception("%s tier: write of %s failed: %s", tier.name, entry.key, e)

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                tier, entry = item
                self._put(tier, entry)
                with self._lock:
                    held, n = self._pending[entry.key]
                    if n > 1:
                        self._pending[entry.key] = (held, n - 1)
                    else:
                        del self._pending[entry.key]
                        self._pending_bytes -= held.nbytes
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every write-down and every write to disk and Redis has been done."""
        if self._down is not None:
            self._down.join()
        if self._queue is not None:
            self._queue.join()

    # ------------------------------------------------------------------ reads

    def fetch(self, key: str, layout: Layout, heads: np.ndarray | None = None) -> tuple[KVEntry, str] | None:
        """(verified entry, tier name) from the first tier holding ``key``, or None; a whole-entry
        hit below the CPU tier is promoted into it."""
        self.fetches += 1
        down = self._inflight.get(key)
        if down is not None:  # on its way down: it is there in a moment
            down.wait(self.down_wait_s)
        with self._lock:
            pending = self._pending.get(key, (None,))[0]
        if pending is not None and self.cpu is not None and self.cpu.contains(key):
            pending = None  # the CPU tier has it: count the hit there
        if pending is not None:
            try:
                pending.header.check(key, layout)
            except ValueError:
                pending = None
            else:
                self.fetch_hits += 1
                return (pending if heads is None else pending.select(heads)), "pending"
        for tier in self.tiers:
            entry = tier.get(key, layout, heads)
            if entry is None:
                continue
            self.fetch_hits += 1
            if heads is None and self.cpu is not None and tier is not self.cpu:
                for e in self.cpu.put(entry):  # promoted; what it pushes out spills to disk
                    if self.disk is not None and not (e is entry and tier is self.disk):
                        self._write(self.disk, e)
            return entry, tier.name
        return None

    def info(self) -> dict:
        out = {"fetches": self.fetches, "fetch_hits": self.fetch_hits, "pending_writes": len(self._pending),
               "pending_bytes": self._pending_bytes, "downs_done": self.downs_done,
               "downs_dropped": self.downs_dropped, "down_errors": self.down_errors,
               "downs_pending": len(self._inflight)}
        for t in self.tiers:
            out[t.name] = t.info()
        return out

    def close(self) -> None:
        if self._down is not None:
            self._down.join()
            self._down.put(None)
            self._down_thread.join(timeout=5)
            self._down = None
        if self._queue is not None:
            self.flush()
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._queue = None
        for t in self.tiers:
            t.close()
