"""The Redis/Valkey tier (redis-py): one value per entry, header and bytes together.

One value holds the whole serialized entry, so its metadata and data can never disagree; a
partial read fetches the header, then only the wanted heads' byte ranges (GETRANGE). The server's
own ``maxmemory`` policy evicts (a value it dropped reads as a miss); ``ttl_s`` sets an expiry.

A tier that is down or slow never fails a request: every call has short socket timeouts and no
client retries, and after a failure a circuit breaker skips the tier (counted as ``skipped``)
for a backoff that doubles up to ``max_backoff_s``; the first call after it tries again, and a
success closes the circuit. One warning per opening.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from .base import Tier
from .entry import PREAMBLE, CorruptEntry, KVEntry, Layout, decode, decode_header, head_ranges, header_length

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Closed until a failure; then open for ``backoff`` seconds (doubling per failed retry)."""

    def __init__(self, base_s: float = 0.5, max_s: float = 30.0, clock=time.monotonic):
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self.backoff = 0.0
        self.open_until = 0.0
        self.opened = 0  # times it opened
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return self.clock() >= self.open_until

    def success(self) -> None:
        with self._lock:
            self.backoff = 0.0
            self.open_until = 0.0

    def failure(self) -> bool:
        """Open (or reopen, longer); True when it was closed before (time to warn)."""
        with self._lock:
            was_closed = self.backoff == 0.0
            self.backoff = self.base_s if was_closed else min(self.max_s, 2 * self.backoff)
            self.open_until = self.clock() + self.backoff
            self.opened += 1
            return was_closed


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, ttl_s: float | None = None, timeout_s: float = 0.5, connect_timeout_s: float = 0.2,
                 prefix: str = "redknot:kv:", pin: bool = False, client=None, breaker: CircuitBreaker | None = None):
        super().__init__()
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.RedisError, OSError)
        self._oom = redis.ResponseError
        self.url, self.prefix, self.pin = url, prefix, pin
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._lock = threading.Lock()
        # no client-side retries: a dead server costs one short timeout, then the breaker skips it
        self.client = client or redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                     socket_connect_timeout=connect_timeout_s,
                                                     retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                                                     health_check_interval=0)
        self.breaker = breaker or CircuitBreaker()
        # keys this process wrote or read here lately: an entry evicted again is not sent twice
        self._known: OrderedDict[str, None] = OrderedDict()
        self.max_known = 1 << 16

    def _remember(self, key: str, present: bool) -> None:
        with self._lock:
            if present:
                self._known[key] = None
                self._known.move_to_end(key)
                while len(self._known) > self.max_known:
                    self._known.popitem(last=False)
            else:
                self._known.pop(key, None)

    def _name(self, key: str) -> str:
        return self.prefix + key

    def _call(self, what: str, fn):
        """fn() or None when the tier is skipped or fails (counted; the breaker opens on failure)."""
        if not self.breaker.allow():
            self.stats.skipped += 1
            return None
        try:
            out = fn()
        except self._oom as e:  # the server refused a write (maxmemory with noeviction): not down
            self.stats.errors += 1
            log.warning("redis tier: %s refused by the server: %s", what, e)
            return None
        except self._errors as e:
            self.stats.errors += 1
            if self.breaker.failure():
                log.warning("redis tier at %s unavailable (%s: %s); skipping it for %.1f s, then retrying",
                            self.url, what, e, self.breaker.backoff)
            return None
        self.breaker.success()
        return out

    # ------------------------------------------------------------------ Tier

    def contains(self, key: str) -> bool:
        return bool(self._call("exists", lambda: self.client.exists(self._name(key))))

    def get(self, key: str, layout: Layout, heads: np.ndarray | None = None) -> KVEntry | None:
        name = self._name(key)
        if heads is None:
            blob = self._call("get", lambda: self.client.get(name))
            if blob is None:
                self.stats.misses += 1
                self._remember(key, False)  # expired or evicted by the server: write it again next time
                return None
            try:
                entry = decode(blob, key, layout, self.pin)
            except CorruptEntry as e:
                return self._reject(key, e)
            self.stats.bytes_read += entry.payload.numel()
        else:
            entry = self._get_heads(key, layout, np.asarray(heads, dtype=np.int64))
            if entry is None:
                return None
        self.stats.hits += 1
        self._remember(key, True)
        return entry

    def _get_heads(self, key: str, layout: Layout, heads: np.ndarray) -> KVEntry | None:
        name = self._name(key)
        pre = self._call("getrange", lambda: self.client.getrange(name, 0, PREAMBLE.size - 1))
        if not pre:
            self.stats.misses += 1
            self._remember(key, False)
            return None
        try:
            n = header_length(pre)
            body = self._call("getrange", lambda: self.client.getrange(name, PREAMBLE.size, PREAMBLE.size + n - 1))
            if body is None:
                return None
            header = decode_header(pre + body)
            header.check(key, layout)
            ranges = head_ranges(heads, header.segment_bytes, PREAMBLE.size + n)

            def fetch():
                pipe = self.client.pipeline(transaction=False)
                for start, length, _ in ranges:
                    pipe.getrange(name, start, start + length - 1)
                pipe.strlen(name)
                return pipe.execute()

            parts = self._call("getrange", fetch)
            if parts is None:
                return None
            if parts[-1] != PREAMBLE.size + n + header.payload_bytes:
                raise CorruptEntry(f"value of {parts[-1]} bytes, its header says "
                                   f"{PREAMBLE.size + n + header.payload_bytes}")
            payload = torch.empty(header.segment_bytes * heads.size, dtype=torch.uint8, pin_memory=self.pin)
            buf, pos = payload.numpy(), 0
            for (_, length, _), part in zip(ranges, parts):
                if len(part) != length:
                    raise CorruptEntry("value ends inside its payload")
                buf[pos:pos + length] = np.frombuffer(part, dtype=np.uint8)
                pos += length
            entry = KVEntry(header, payload, heads)
            entry.verify()
        except CorruptEntry as e:
            return self._reject(key, e)
        self.stats.bytes_read += payload.numel()
        self.stats.bytes_saved += header.payload_bytes - payload.numel()
        return entry

    def _reject(self, key: str, error: CorruptEntry) -> None:
        log.warning("redis tier: dropping %s: %s", key, error)
        self.stats.rejected += 1
        self.delete(key)
        return None

    def put(self, entry: KVEntry) -> list[KVEntry]:
        with self._lock:
            if entry.key in self._known:
                self._known.move_to_end(entry.key)
                return []
        blob = b"".join(entry.encode())
        name = self._name(entry.key)
        failed = self.stats.errors + self.stats.skipped
        # NX: an entry is immutable content; a replica that already wrote it wins
        ok = self._call("set", lambda: self.client.set(name, blob, px=self.ttl_ms, nx=True))
        if ok:
            self.stats.puts += 1
            self.stats.bytes_written += entry.payload.numel()
        if self.stats.errors + self.stats.skipped == failed:  # written now, or already there (NX)
            self._remember(entry.key, True)
        return []

    def delete(self, key: str) -> None:
        self._remember(key, False)
        self._call("delete", lambda: self.client.delete(self._name(key)))

    def info(self) -> dict:
        return {**self.stats.as_dict(), "circuit_open": not self.breaker.allow(), "circuit_opened": self.breaker.opened}

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass
