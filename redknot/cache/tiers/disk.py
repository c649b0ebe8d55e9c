"""The disk tier: one file per entry under a directory, bounded, LRU by access time, restart-safe.

An entry is written to a temporary name in its final directory and renamed into place, so a
crash leaves either the whole file or none (a stray temporary is removed at the next start). At
start the index is rebuilt by reading every file's header; a file whose header is unreadable,
names another key, or whose size disagrees with its header is deleted. Access time is the file's
mtime (set on every hit), so LRU order survives a restart. Reads verify the per-head checksums of
what they read; a mismatch deletes the file. A full disk disables the tier with one warning.
Several processes may share a directory: a key another process wrote is found on a miss, and a
file another process evicted reads as a miss (byte accounting is per process).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from .base import Tier
from .entry import PREAMBLE, CorruptEntry, KVEntry, Layout, decode_header, head_ranges, header_length

log = logging.getLogger(__name__)

SUFFIX = ".rkv"
STALE_TEMP_S = 600  # a temporary file this old belongs to a writer that died


class DiskTier(Tier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, max_bytes: int, fsync: bool = False, pin: bool = False):
        """``fsync``: flush each file to the device before renaming it (survives power loss, not
        only a crash of the process; without it a torn file fails its checksum and is dropped)."""
        super().__init__()
        if max_bytes < 0:
            raise ValueError(f"disk tier max_bytes must be >= 0, got {max_bytes}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.fsync, self.pin = int(max_bytes), fsync, pin
        self.disabled: str | None = None  # why the tier stopped writing (a full disk)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self.recovered = self._scan()

    # ------------------------------------------------------------------ index

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"a tier key is lowercase hex, got {key!r}")
        return self.dir / key[:2] / (key + SUFFIX)

    def _scan(self) -> int:
        """Rebuild the index from the files' headers; returns entries found."""
        found = []
        now = time.time()
        for sub in sorted(p for p in self.dir.iterdir() if p.is_dir() and len(p.name) == 2):
            for f in sub.iterdir():
                try:
                    st = f.stat()
                    if f.name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TEMP_S:
                            f.unlink(missing_ok=True)
                        continue
                    if not f.name.endswith(SUFFIX):
                        continue
                    key = f.name[:-len(SUFFIX)]
                    if self._read_header(f, key, st.st_size) is None:
                        continue
                    found.append((st.st_mtime, key, st.st_size))
                except OSError as e:
                    log.warning("disk tier: cannot read %s at start (%s); left as it is", f, e)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        with self._lock:
            self._evict_to(self.max_bytes)
        return len(found)

    def _read_header(self, path: Path, key: str, size: int):
        """(header, payload offset) of a file, or None after deleting a bad one."""
        try:
            with open(path, "rb") as f:
                pre = f.read(PREAMBLE.size)
                n = header_length(pre)
                header = decode_header(pre + f.read(n))
            if header.key != key:
                raise CorruptEntry(f"file of key {key} holds {header.key}")
            off = PREAMBLE.size + n
            if size != off + header.payload_bytes:
                raise CorruptEntry(f"file of {size} bytes, its header says {off + header.payload_bytes}")
        except CorruptEntry as e:
            log.warning("disk tier: dropping %s: %s", path, e)
            self.stats.rejected += 1
            path.unlink(missing_ok=True)
            return None
        return header, off

    def _evict_to(self, limit: int) -> None:
        while self._index and self._bytes > limit:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self.stats.evictions += 1
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as e:
                log.warning("disk tier: cannot delete %s: %s", key, e)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    # ------------------------------------------------------------------ Tier

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        return self._bytes

    def contains(self, key: str) -> bool:
        return key in self._index or self._path(key).is_file()

    def get(self, key: str, layout: Layout, heads: np.ndarray | None = None) -> KVEntry | None:
        path = self._path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            self._forget(key)
            self.stats.misses += 1
            return None
        except OSError as e:
            self.stats.errors += 1
            log.warning("disk tier: cannot open %s: %s", path, e)
            return None
        try:
            with f:
                size = os.fstat(f.fileno()).st_size
                pre = f.read(PREAMBLE.size)
                n = header_length(pre)
                header = decode_header(pre + f.read(n))
                header.check(key, layout)
                off = PREAMBLE.size + n
                if size != off + header.payload_bytes:
                    raise CorruptEntry(f"file of {size} bytes, its header says {off + header.payload_bytes}")
                want = np.arange(layout.heads) if heads is None else np.asarray(heads, dtype=np.int64)
                payload = torch.empty(header.segment_bytes * want.size, dtype=torch.uint8, pin_memory=self.pin)
                buf, pos = payload.numpy(), 0
                for start, length, _ in head_ranges(want, header.segment_bytes, off):
                    f.seek(start)
                    if f.readinto(memoryview(buf[pos:pos + length])) != length:
                        raise CorruptEntry("file ends inside its payload")
                    pos += length
            entry = KVEntry(header, payload, None if heads is None else want)
            entry.verify()
        except CorruptEntry as e:
            log.warning("disk tier: dropping %s: %s", path, e)
            self.stats.rejected += 1
            self.delete(key)
            return None
        except OSError as e:
            self.stats.errors += 1
            log.warning("disk tier: cannot read %s: %s", path, e)
            return None
        with self._lock:
            if key not in self._index:  # written by another process sharing the directory
                self._index[key] = size
                self._bytes += size
                self._evict_to(self.max_bytes)
            else:
                self._index.move_to_end(key)
        try:
            os.utime(path)  # the access time LRU order is rebuilt from after a restart
        except OSError:
            pass
        self.stats.hits += 1
        self.stats.bytes_read += payload.numel()
        self.stats.bytes_saved += header.payload_bytes - payload.numel()
        return entry

    def put(self, entry: KVEntry) -> list[KVEntry]:
        if self.disabled:
            self.stats.skipped += 1
            return []
        key = entry.key
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
        size = entry.nbytes
        if size > self.max_bytes:
            self.stats.skipped += 1
            return []
        path = self._path(key)
        tmp = path.with_name(f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with self._lock:  # room first, so the bound holds while the file is written
                self._evict_to(self.max_bytes - size)
            with open(tmp, "wb") as f:
                for part in entry.encode():
                    f.write(part)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.stats.errors += 1
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.disabled = f"disk full at {self.dir}"
                log.warning("disk tier disabled: %s (%s); entries go to the other tiers or are recomputed",
                            self.disabled, e)
            else:
                log.warning("disk tier: cannot write %s: %s", path, e)
            return []
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._bytes += size
            self._evict_to(self.max_bytes)
        self.stats.puts += 1
        self.stats.bytes_written += entry.payload.numel()
        return []

    def delete(self, key: str) -> None:
        self._forget(key)
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            log.warning("disk tier: cannot delete %s: %s", key, e)

    def info(self) -> dict:
        return {**self.stats.as_dict(), "entries": len(self._index), "bytes": self._bytes,
                "max_bytes": self.max_bytes, "disabled": self.disabled}
