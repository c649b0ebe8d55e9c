"""The prefill-to-decode KV handoff on the wire: a header, then raw page bytes. No pickle.

Byte layout of one handoff (the same for every transport; a GPU transport moves the payload
itself, the header still goes over the control channel)::

    preamble  "<4sHHIQ": magic b"RKPD", format version, flags (0), header length, xxh3-64 of the header
    header    msgpack map: lease id, model fingerprint, head plan (name and digest of its windows and
              sinks), dtype, page size, shapes, prompt length and a digest of its token ids, the
              pages each (layer, KV head) holds as position RANGES, the selected sets of retrieval
              heads as ranges, the first position's logits, the payload's size and its checksum
    payload   K of every held page, then V of every held page, [P, page_size, head_dim] each, pages
              in (layer, KV head, logical page) order: exactly the pages the prefill pool holds

A head holds whole pages; its ranges are page-aligned starts and ends clipped to the prompt, so a
local head is two ranges (sink, window) and a global head one, whatever the prompt's length. The
checksum is xxh3-64 of the payload bytes where they pass through the host, and ``fold64`` (a
position-weighted sum of its 64-bit words, computed where the payload is) for transports that keep
it on a GPU; the header names which. Anything that does not match what the reader expects raises
``HandoffRejected``: the decode instance then recomputes the prompt (or answers 503).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
import xxhash

from ..cache.tiers.entry import DTYPES, dtype_name, plan_digest

__all__ = ["HandoffHeader", "HandoffRejected", "DTYPES", "dtype_name", "plan_digest", "tokens_digest",
           "held_to_ranges", "ranges_to_held", "positions_to_ranges", "ranges_to_positions", "payload_digest",
           "PREAMBLE"]

MAGIC = b"RKPD"
VERSION = 1
PREAMBLE = struct.Struct("<4sHHIQ")
MAX_HEADER_BYTES = 256 << 20  # logits of a large vocabulary and ranges of every head: far below this
_M1, _M2 = 0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019  # fold64's multipliers (odd, as int64)
FOLD_CHUNK_WORDS = 8 << 20  # fold64 works through this many 64-bit words at a time (64 MiB of temporaries)


class HandoffRejected(ValueError):
    """A handoff that is corrupt or was made for another model, plan, layout or prompt."""


def tokens_digest(token_ids) -> int:
    """xxh3-64 of a prompt's token ids (little-endian int64): the decode side re-tokenises the
    request and must arrive at the same prompt."""
    return xxhash.xxh3_64_intdigest(np.asarray(token_ids, dtype="<i8").tobytes())


# ---------------------------------------------------------------- ranges

def held_to_ranges(held: np.ndarray, page_size: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts uint32 [L*Hkv], bounds int64 [2R]) of the page runs each head holds: ``held`` is
    bool [L, Hkv, P]; each run is [first page * page_size, min(end page * page_size, n))."""
    rows = held.reshape(-1, held.shape[-1])
    pad = np.zeros((rows.shape[0], rows.shape[1] + 2), np.int8)
    pad[:, 1:-1] = rows
    step = np.diff(pad, axis=1)
    r0, start = np.nonzero(step == 1)  # row-major: a row's runs in order, rows in order
    _, end = np.nonzero(step == -1)
    counts = np.bincount(r0, minlength=rows.shape[0]).astype(np.uint32)
    bounds = np.stack([start * page_size, np.minimum(end * page_size, n)], 1).reshape(-1).astype(np.int64)
    return counts, bounds


def _check_ranges(counts: np.ndarray, bounds: np.ndarray, heads: int, n: int, what: str) -> tuple:
    if counts.size != heads or bounds.size != 2 * int(counts.sum()):
        raise HandoffRejected(f"{what}: {counts.size} range counts and {bounds.size // 2} ranges for {heads} heads")
    starts, ends = bounds[0::2], bounds[1::2]
    if (starts < 0).any() or (ends > n).any() or (starts >= ends).any():
        raise HandoffRejected(f"{what}: a range is empty or outside the prompt's {n} tokens")
    row = np.repeat(np.arange(heads), counts)
    same = row[1:] == row[:-1]
    if (same & (starts[1:] < ends[:-1])).any():
        raise HandoffRejected(f"{what}: a head's ranges overlap or are out of order")
    return row, starts, ends


def ranges_to_held(counts: np.ndarray, bounds: np.ndarray, shape: tuple, page_size: int, n: int) -> np.ndarray:
    """bool [L, Hkv, P] of the pages the ranges cover (``held_to_ranges`` inverted, validated)."""
    L, H, P = shape
    row, starts, ends = _check_ranges(counts, bounds, L * H, n, "page ranges")
    if (starts % page_size).any():
        raise HandoffRejected("page ranges: a range does not start on a page boundary")
    first, last = starts // page_size, -(-ends // page_size)
    lens = last - first
    held = np.zeros((L * H, P), bool)
    total = int(lens.sum())
    offs = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    held[np.repeat(row, lens), np.repeat(first, lens) + offs] = True
    return held.reshape(L, H, P)


def positions_to_ranges(sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Selected positions int [L, Hkv, m] (sorted, -1 padded) as runs of consecutive positions:
    (counts uint32 [L*Hkv], bounds int64 [2R], [start, end))."""
    flat = sel.reshape(-1, sel.shape[-1])
    r, c = np.nonzero(flat >= 0)
    pos = flat[r, c].astype(np.int64)
    new = np.ones(pos.size, bool)
    new[1:] = (r[1:] != r[:-1]) | (pos[1:] != pos[:-1] + 1)
    idx = np.nonzero(new)[0]
    ends = np.append(idx[1:], pos.size)[:idx.size].astype(np.int64) - 1
    counts = np.bincount(r[idx], minlength=flat.shape[0]).astype(np.uint32)
    bounds = np.stack([pos[idx], pos[ends] + 1], 1).reshape(-1).astype(np.int64)
    return counts, bounds


def ranges_to_positions(counts: np.ndarray, bounds: np.ndarray, shape: tuple, n: int) -> np.ndarray:
    """int64 [L, Hkv, m] sorted positions, -1 padded (``positions_to_ranges`` inverted, validated)."""
    L, H = shape
    row, starts, ends = _check_ranges(counts, bounds, L * H, n, "selection ranges")
    lens = ends - starts
    per_head = np.bincount(np.repeat(row, lens), minlength=L * H)
    out = np.full((L * H, max(int(per_head.max(initial=0)), 1)), -1, np.int64)
    total = int(lens.sum())
    pos = np.repeat(starts, lens) + (np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens))
    rows = np.repeat(row, lens)
    col = np.arange(total) - np.repeat(np.cumsum(per_head) - per_head, per_head)
    out[rows, col] = pos
    return out.reshape(L, H, -1)


# ---------------------------------------------------------------- checksums

def fold64(payload: torch.Tensor) -> int:
    """A 64-bit checksum of a uint8 tensor (length a multiple of 8) computed on its device: the sum,
    modulo 2^64, of each 64-bit word times an odd multiplier drawn from its index. Integer sums
    wrap and commute, so the value does not depend on the device or the reduction order."""
    words = payload.view(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=payload.device)
    for a in range(0, words.numel(), FOLD_CHUNK_WORDS):
        w = words[a:a + FOLD_CHUNK_WORDS]
        idx = torch.arange(a, a + w.numel(), dtype=torch.int64, device=payload.device)
        total += (w * (idx * _M1 + _M2 | 1)).sum()
    return int(total.item()) & ((1 << 64) - 1)


def payload_digest(payload: torch.Tensor, algo: str) -> int:
    """The checksum ``algo`` ("xxh3-64" on a host tensor, "fold64" anywhere) of a uint8 payload."""
    if algo == "xxh3-64":
        return xxhash.xxh3_64_intdigest(payload.numpy())
    if algo == "fold64":
        return fold64(payload)
    raise HandoffRejected(f"unknown checksum {algo!r}")


# ---------------------------------------------------------------- the header

@dataclass(eq=False)
class HandoffHeader:
    lease: str
    fingerprint: str
    plan: str  # the pool plan the pages live under ("dense", "headsparse", "headsparse+sel", ...)
    plan_hash: str  # plan_digest(window, sink) of that plan
    dtype: str
    page_size: int
    head_dim: int
    num_layers: int
    num_kv_heads: int
    num_tokens: int  # prompt length: the pages hold positions [0, num_tokens)
    tokens_hash: int
    counts: np.ndarray  # uint32 [L*Hkv]: page ranges per head
    bounds: np.ndarray  # int64 [2R]
    logits: bytes  # the first generated position's logits, float32 [V] little-endian
    logits_dtype: str  # the dtype the prefill computed them in (the float32 copy is exact)
    sel_counts: np.ndarray | None = None  # selected sets of retrieval heads, as ranges
    sel_bounds: np.ndarray | None = None
    page_mass: bytes | None = None  # decode budgets' accumulated mass, float32 [L, Hkv, P]
    exact_kv: bool = True
    cached_tokens: int = 0
    payload_bytes: int = 0
    digest_algo: str = "xxh3-64"
    digest: int = 0
    extra: dict = field(default_factory=dict)  # transport-specific fields (CUDA IPC handles, ...)

    @property
    def heads(self) -> int:
        return self.num_layers * self.num_kv_heads

    @property
    def pages(self) -> int:
        """Logical pages of the prompt per head (``num_tokens`` / page size, rounded up)."""
        return -(-self.num_tokens // self.page_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K (or of V)."""
        return self.page_size * self.head_dim * DTYPES[self.dtype].itemsize

    def held(self) -> np.ndarray:
        """bool [L, Hkv, P]: the pages the payload holds (validated)."""
        return ranges_to_held(self.counts, self.bounds, (self.num_layers, self.num_kv_heads, self.pages),
                              self.page_size, self.num_tokens)

    def selection(self) -> np.ndarray | None:
        if self.sel_counts is None:
            return None
        return ranges_to_positions(self.sel_counts, self.sel_bounds, (self.num_layers, self.num_kv_heads),
                                   self.num_tokens)

    def first_logits(self) -> torch.Tensor:
        """The first position's logits in the dtype the prefill computed them in."""
        x = torch.from_numpy(np.frombuffer(self.logits, dtype="<f4").copy())
        return x.to(DTYPES[self.logits_dtype])

    def encode(self) -> bytes:
        opt = (lambda a, t: None if a is None else np.ascontiguousarray(a, dtype=t).tobytes())
        body = msgpack.packb({
            "lease": self.lease, "fingerprint": self.fingerprint, "plan": self.plan, "plan_hash": self.plan_hash,
            "dtype": self.dtype, "page_size": self.page_size, "head_dim": self.head_dim,
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "num_tokens": self.num_tokens,
            "tokens_hash": self.tokens_hash, "counts": opt(self.counts, "<u4"), "bounds": opt(self.bounds, "<i8"),
            "logits": self.logits, "logits_dtype": self.logits_dtype, "sel_counts": opt(self.sel_counts, "<u4"),
            "sel_bounds": opt(self.sel_bounds, "<i8"), "page_mass": self.page_mass, "exact_kv": self.exact_kv,
            "cached_tokens": self.cached_tokens, "payload_bytes": self.payload_bytes,
            "digest_algo": self.digest_algo, "digest": self.digest, "extra": self.extra,
        })
        return PREAMBLE.pack(MAGIC, VERSION, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body

    @classmethod
    def decode(cls, buf) -> "HandoffHeader":
        view = memoryview(buf)
        if len(view) < PREAMBLE.size:
            raise HandoffRejected(f"truncated handoff header: {len(view)} bytes")
        magic, version, _flags, n, digest = PREAMBLE.unpack_from(view)
        if magic != MAGIC:
            raise HandoffRejected(f"not a KV handoff (magic {magic!r})")
        if version != VERSION:
            raise HandoffRejected(f"handoff format version {version}, this reader knows {VERSION}")
        if n > MAX_HEADER_BYTES or len(view) != PREAMBLE.size + n:
            raise HandoffRejected(f"handoff header of {len(view) - PREAMBLE.size} bytes, its preamble says {n}")
        body = bytes(view[PREAMBLE.size:])
        if xxhash.xxh3_64_intdigest(body) != digest:
            raise HandoffRejected("handoff header checksum mismatch")
        try:
            d = msgpack.unpackb(body)
            arr = (lambda b, t: None if b is None else np.frombuffer(b, dtype=t).copy())
            h = cls(str(d["lease"]), str(d["fingerprint"]), str(d["plan"]), str(d["plan_hash"]), str(d["dtype"]),
                    int(d["page_size"]), int(d["head_dim"]), int(d["num_layers"]), int(d["num_kv_heads"]),
                    int(d["num_tokens"]), int(d["tokens_hash"]), arr(d["counts"], "<u4"), arr(d["bounds"], "<i8"),
                    bytes(d["logits"]), str(d["logits_dtype"]), arr(d["sel_counts"], "<u4"),
                    arr(d["sel_bounds"], "<i8"), d["page_mass"], bool(d["exact_kv"]), int(d["cached_tokens"]),
                    int(d["payload_bytes"]), str(d["digest_algo"]), int(d["digest"]), dict(d["extra"]))
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise HandoffRejected(f"unreadable handoff header: {e}") from None
        if h.dtype not in DTYPES or h.logits_dtype not in DTYPES:
            raise HandoffRejected(f"handoff dtype {h.dtype!r} / {h.logits_dtype!r} unknown")
        if h.counts is None or h.bounds is None or h.page_size < 1 or h.num_tokens < 1:
            raise HandoffRejected("handoff header without page ranges or tokens")
        return h
