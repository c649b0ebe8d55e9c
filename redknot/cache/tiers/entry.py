"""The serialized form of one document's KV below the GPU pool: key, header and raw bytes.

Byte layout of an entry (the same on disk, in Redis and in the CPU tier)::

    preamble  "<4sHHIQ": magic b"RKKV", format version, flags (0), header length, xxh3-64 of the header
    header    msgpack map: keys, layout, token ids, shapes, per-head checksums (no pickle anywhere)
    payload   for each (layer, KV head) in order: K [n, D] then V [n, D], raw little-endian bytes

Each (layer, KV head) is one contiguous segment with its own xxh3-64 checksum, so a reader can
fetch and verify only the heads it needs (a byte range per head). ``payload_checksum`` is the
xxh3-64 of the per-head checksums: a whole read and a partial read check the same digests, and
the data is hashed once. Anything that does not match what the reader asked for (magic, version,
key, layout, shapes, a checksum) raises ``CorruptEntry``; callers drop the entry and recompute.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import asdict, dataclass

import msgpack
import numpy as np
import torch
import xxhash

MAGIC = b"RKKV"
VERSION = 1
PREAMBLE = struct.Struct("<4sHHIQ")
MAX_HEADER_BYTES = 64 << 20  # a header is token ids plus 8 bytes per head: far below this
_KEY_DOMAIN = b"redknot-tier-kv-v1"  # bump with VERSION when the key inputs change

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class CorruptEntry(ValueError):
    """An entry whose bytes or header do not match what was asked for; never returned to a reader."""


@dataclass(frozen=True)
class Layout:
    """What the bytes of a chunk's KV depend on beyond its tokens: the model, the head plan it was
    computed under, the dtype and the paging. Part of every key and checked on every read."""
    fingerprint: str
    plan: str  # digest of the (window, sink) plan the chunk was computed under
    dtype: str  # a DTYPES name
    page_size: int
    head_dim: int
    num_layers: int
    num_kv_heads: int

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Layout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def heads(self) -> int:
        return self.num_layers * self.num_kv_heads


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"no tier encoding for dtype {dtype}")


def plan_digest(window, sink) -> str:
    """A short stable name of a head plan (window and sink per (layer, KV head))."""
    w = np.ascontiguousarray(np.asarray(window, dtype="<i8"))
    s = np.ascontiguousarray(np.asarray(sink, dtype="<i8"))
    h = xxhash.xxh3_64(msgpack.packb([list(w.shape), w.tobytes(), s.tobytes()]))
    return h.hexdigest()


def tier_key(chunk_key: str, layout: Layout) -> str:
    """The content address of a chunk's KV in every tier: xxh3-128 over the chunk key (document and
    prefix tokens, model fingerprint and cache namespace, see ``chunk_kv.chunk_key``) and the
    layout (fingerprint again, head plan, dtype, page size, shapes)."""
    fields = asdict(layout)
    blob = msgpack.packb([_KEY_DOMAIN, chunk_key, [fields[k] for k in sorted(fields)]])
    return xxhash.xxh3_128(blob).hexdigest()


@dataclass(eq=False)  # identity: two headers are never compared field by field (arrays inside)
class EntryHeader:
    key: str
    chunk_key: str
    layout: Layout
    start: int  # canonical position of the first token
    token_ids: tuple[int, ...]
    segment_bytes: int  # one (layer, head): K then V
    head_checksums: np.ndarray  # uint64 [L * Hkv]
    payload_checksum: int

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def payload_bytes(self) -> int:
        return self.segment_bytes * self.layout.heads

    @functools.cached_property
    def encoded_size(self) -> int:
        return len(self.encode())

    def encode(self) -> bytes:
        """Preamble and msgpack header (the payload follows them)."""
        body = msgpack.packb({
            "key": self.key, "chunk_key": self.chunk_key, "layout": asdict(self.layout), "start": self.start,
            "token_ids": np.asarray(self.token_ids, dtype="<i8").tobytes(), "segment_bytes": self.segment_bytes,
            "head_checksums": self.head_checksums.astype("<u8").tobytes(), "payload_checksum": self.payload_checksum,
        })
        return PREAMBLE.pack(MAGIC, VERSION, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body

    def check(self, key: str, layout: Layout) -> None:
        """Raise CorruptEntry unless this header is the entry ``key`` under ``layout``."""
        if self.key != key:
            raise CorruptEntry(f"entry holds key {self.key}, {key} was asked for")
        if self.layout != layout:
            raise CorruptEntry(f"entry layout {self.layout} differs from the reader's {layout}")


def header_length(preamble: bytes) -> int:
    """Bytes of the msgpack header that follows a preamble (validates magic and version)."""
    if len(preamble) < PREAMBLE.size:
        raise CorruptEntry(f"truncated entry: {len(preamble)} bytes, a preamble is {PREAMBLE.size}")
    magic, version, _flags, n, _sum = PREAMBLE.unpack_from(preamble)
    if magic != MAGIC:
        raise CorruptEntry(f"not a KV entry (magic {magic!r})")
    if version != VERSION:
        raise CorruptEntry(f"entry format version {version}, this reader knows {VERSION}")
    if n > MAX_HEADER_BYTES:
        raise CorruptEntry(f"header length {n} is implausible")
    return n


def decode_header(buf) -> EntryHeader:
    """The header of an entry from its first PREAMBLE.size + header-length bytes (or more)."""
    view = memoryview(buf)
    n = header_length(bytes(view[:PREAMBLE.size]))
    body = bytes(view[PREAMBLE.size:PREAMBLE.size + n])
    if len(body) != n:
        raise CorruptEntry(f"truncated header: {len(body)} of {n} bytes")
    if xxhash.xxh3_64_intdigest(body) != PREAMBLE.unpack_from(view)[4]:
        raise CorruptEntry("header checksum mismatch")
    try:
        d = msgpack.unpackb(body)
        layout = Layout(**d["layout"])
        header = EntryHeader(str(d["key"]), str(d["chunk_key"]), layout, int(d["start"]),
                             tuple(np.frombuffer(d["token_ids"], dtype="<i8").tolist()), int(d["segment_bytes"]),
                             np.frombuffer(d["head_checksums"], dtype="<u8").copy(), int(d["payload_checksum"]))
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise CorruptEntry(f"unreadable header: {e}") from None
    item = layout.torch_dtype.itemsize
    if header.segment_bytes != 2 * header.n_tokens * layout.head_dim * item:
        raise CorruptEntry(f"segment of {header.segment_bytes} bytes does not hold K and V of "
                           f"{header.n_tokens} tokens x {layout.head_dim} {layout.dtype}")
    if header.head_checksums.size != layout.heads:
        raise CorruptEntry(f"{header.head_checksums.size} head checksums for {layout.heads} heads")
    if xxhash.xxh3_64_intdigest(header.head_checksums.astype("<u8").tobytes()) != header.payload_checksum:
        raise CorruptEntry("payload checksum does not match the per-head checksums")
    return header


def _empty(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _segment_sums(payload: torch.Tensor, segment_bytes: int) -> np.ndarray:
    """xxh3-64 of each segment of a uint8 payload (one (layer, head) each)."""
    rows = payload.numpy().reshape(-1, segment_bytes) if segment_bytes else np.zeros((payload.numel(), 0), np.uint8)
    return np.array([xxhash.xxh3_64_intdigest(r) for r in rows], dtype=np.uint64)


@dataclass(eq=False)  # identity, as tiers hold and pass them (``in`` on lists of entries)
class KVEntry:
    """One chunk's KV on the host: its header and the payload of all or some of its heads.

    ``heads``: the flat (layer * Hkv + head) indices the payload holds, in order (None: all)."""
    header: EntryHeader
    payload: torch.Tensor  # uint8, CPU (pinned where CUDA is available), segment_bytes per head held
    heads: np.ndarray | None = None

    @property
    def key(self) -> str:
        return self.header.key

    @property
    def nbytes(self) -> int:
        """Bytes a tier holds for it (preamble, header and payload)."""
        return self.payload.numel() + self.header.encoded_size

    @classmethod
    def build(cls, key: str, chunk_key: str, layout: Layout, token_ids, start: int, k: torch.Tensor,
              v: torch.Tensor, pin: bool = False) -> "KVEntry":
        """From K and V [L, n, Hkv, D] on any device (copied to the host once)."""
        kv = stack_kv(k, v, layout)
        payload = _empty(kv.numel() * kv.element_size(), pin)
        payload.view(kv.dtype).view(kv.shape).copy_(kv)
        return cls.from_payload(key, chunk_key, layout, token_ids, start, payload)

    @classmethod
    def from_payload(cls, key: str, chunk_key: str, layout: Layout, token_ids, start: int,
                     payload: torch.Tensor) -> "KVEntry":
        """From a host uint8 payload already in the entry's layout (``stack_kv``'s bytes): the
        checksums and the header are computed here (off the step loop, on a writer thread)."""
        n = len(token_ids)
        seg = 2 * n * layout.head_dim * layout.torch_dtype.itemsize
        if payload.numel() != seg * layout.heads:
            raise ValueError(f"payload of {payload.numel()} bytes, {seg * layout.heads} for {n} tokens of {layout}")
        sums = _segment_sums(payload, seg)
        header = EntryHeader(key, chunk_key, layout, int(start), tuple(int(t) for t in token_ids), seg, sums,
                             xxhash.xxh3_64_intdigest(sums.astype("<u8").tobytes()))
        return cls(header, payload)

    def verify(self) -> None:
        """Raise CorruptEntry unless every held head's bytes match its checksum."""
        h = self.header
        want = h.head_checksums if self.heads is None else h.head_checksums[self.heads]
        if self.payload.numel() != h.segment_bytes * want.size:
            raise CorruptEntry(f"payload of {self.payload.numel()} bytes, {h.segment_bytes * want.size} expected")
        got = _segment_sums(self.payload, h.segment_bytes)
        if not np.array_equal(got, want):
            bad = int(np.argmax(got != want))
            raise CorruptEntry(f"checksum mismatch in head segment {bad}")

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [L, Hkv, n, D] (views of the payload; the entry must hold every head)."""
        if self.heads is not None:
            raise ValueError("kv() needs an entry with every head")
        lay = self.header.layout
        x = self.payload.view(lay.torch_dtype).view(lay.num_layers, lay.num_kv_heads, 2, self.header.n_tokens,
                                                      lay.head_dim)
        return x[:, :, 0], x[:, :, 1]

    def select(self, heads) -> "KVEntry":
        """The same entry holding only ``heads`` (flat indices, sorted) of a full one; a view."""
        if self.heads is not None:
            raise ValueError("select() needs an entry with every head")
        heads = np.asarray(heads, dtype=np.int64)
        seg = self.header.segment_bytes
        payload = self.payload.view(-1, seg)[torch.from_numpy(heads)].reshape(-1) if seg else self.payload[:0]
        return KVEntry(self.header, payload, heads)

    def encode(self) -> list:
        """The entry's bytes as buffers to write in order: preamble + header, then the payload."""
        if self.heads is not None:
            raise ValueError("only an entry with every head is stored")
        return [self.header.encode(), memoryview(self.payload.numpy())]


def stack_kv(k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """K and V [L, n, Hkv, D] as one contiguous tensor in the payload's order [L, Hkv, 2, n, D]
    (on their device)."""
    L, n, h, d = k.shape
    if (L, h, d) != (layout.num_layers, layout.num_kv_heads, layout.head_dim) or v.shape != k.shape:
        raise ValueError(f"K/V {tuple(k.shape)} do not match the layout {layout}")
    if k.dtype != layout.torch_dtype:
        raise ValueError(f"K/V are {k.dtype}, the layout says {layout.dtype}")
    return torch.stack((k.transpose(1, 2), v.transpose(1, 2)), dim=2).contiguous()


def head_ranges(heads: np.ndarray, segment_bytes: int, payload_offset: int) -> list[tuple[int, int, int]]:
    """Contiguous byte ranges (offset, length, heads covered) of the payload segments of ``heads``."""
    out = []
    for h in np.asarray(heads, dtype=np.int64):
        off = payload_offset + int(h) * segment_bytes
        if out and out[-1][0] + out[-1][1] == off:
            o, n, c = out[-1]
            out[-1] = (o, n + segment_bytes, c + 1)
        else:
            out.append((off, segment_bytes, 1))
    return out


def decode(buf, key: str, layout: Layout, pin: bool = False) -> KVEntry:
    """A verified entry from its whole serialized bytes; raises CorruptEntry."""
    view = memoryview(buf)
    header = decode_header(view)
    header.check(key, layout)
    off = PREAMBLE.size + header_length(bytes(view[:PREAMBLE.size]))
    if len(view) != off + header.payload_bytes:
        raise CorruptEntry(f"entry of {len(view)} bytes, its header says {off + header.payload_bytes}")
    payload = _empty(header.payload_bytes, pin)
    payload.numpy()[:] = np.frombuffer(view, dtype=np.uint8, count=header.payload_bytes, offset=off)
    entry = KVEntry(header, payload)
    entry.verify()
    return entry
