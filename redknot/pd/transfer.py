"""Moving a lease from the prefill instance to the decode instance: one control channel, several
data paths.

The prefill instance runs a ``KVServer``: a ZeroMQ ROUTER socket on its own thread. A decode
instance's ``KVClient.pull`` connects (a fresh DEALER socket per pull, so nothing of a failed pull
can leak into the next), names the lease and a data path, and gets the handoff header back; the
payload then travels by the data path:

tcp        the payload's bytes over the same ZeroMQ connection, in chunks of whole pages (pinned
           host staging on a GPU); xxh3-64 checksum
cuda_ipc   two processes on one GPU: the header carries CUDA IPC handles of the prefill pool's K/V
           page tensors and the page ids; the decode side gathers the pages straight from the
           prefill's memory, then says "done" (``redknot/pd/cuda_ipc.py``)
nccl       torch.distributed point-to-point (NCCL on GPUs, gloo on CPUs) between a prefill and a
           decode process of one process group (``redknot/pd/nccl.py``)
nixl       NIXL (optional): the decode side READs the pages from the prefill's registered staging
           buffer, then says "done" (``redknot/pd/nixl_transport.py``)

Whatever the path, the decode side checks the header against its own model, plan, layout and
prompt (``Expect.check``) and the payload against the header's checksum before anything reaches its
pool; a peer that goes away (the TCP connection drops, or a connect is refused) or stalls past the
timeout fails the pull at once. Bytes are counted as they are sent and received, by head class.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from .device import device_lock
from .lease import Lease, LeaseStore
from .wire import DTYPES, HandoffHeader, HandoffRejected, payload_digest, tokens_digest

log = logging.getLogger("redknot.pd")

CHUNK_BYTES = 8 << 20  # a TCP payload goes out in chunks of whole pages of about this size
# fault injection for tests: seconds the TCP path pauses between a handoff's header and its payload
FAULT_PAUSE_ENV = "REDKNOT_PD_FAULT_PAUSE_S"
HEAD_CLASSES = ("global", "local", "retrieval")


class TransferFailed(RuntimeError):
    """The handoff could not be had: the prefill instance is gone, the lease unknown or expired, the
    transfer stalled, or what arrived was rejected (``rejected``: a checksum, plan or model mismatch)."""

    def __init__(self, message: str, rejected: bool = False):
        super().__init__(message)
        self.rejected = rejected


# ---------------------------------------------------------------- what the decode side expects

@dataclass
class Expect:
    """What a handoff must match on the decode side: its model, its pool's plans and layout, and
    the prompt it re-tokenised. ``plans``: plan name -> its digest, window and sink [L, Hkv];
    ``bases``: the plans a request of its method may arrive under (its plan and selected twin)."""
    fingerprint: str
    plans: dict
    bases: tuple
    dtype: str
    page_size: int
    head_dim: int
    num_layers: int
    num_kv_heads: int
    token_ids: list

    def check(self, h: HandoffHeader) -> tuple[np.ndarray, int]:
        """(held pages bool [L, Hkv, P], pages beyond the plan's window and sink: selected ones);
        raises HandoffRejected naming the first mismatch."""
        if h.fingerprint != self.fingerprint:
            raise HandoffRejected(f"model fingerprint {h.fingerprint} differs from this instance's {self.fingerprint}")
        if h.plan not in self.bases or h.plan not in self.plans:
            raise HandoffRejected(f"head plan {h.plan!r} is not one this request may run under here "
                                  f"({', '.join(self.bases)})")
        digest, window, sink = self.plans[h.plan]
        if h.plan_hash != digest:
            raise HandoffRejected(f"head plan {h.plan!r} has other windows or sinks here ({h.plan_hash} vs {digest})")
        layout = (h.dtype, h.page_size, h.head_dim, h.num_layers, h.num_kv_heads)
        mine = (self.dtype, self.page_size, self.head_dim, self.num_layers, self.num_kv_heads)
        if layout != mine:
            raise HandoffRejected(f"layout (dtype, page size, head dim, layers, KV heads) {layout} differs from {mine}")
        if h.num_tokens != len(self.token_ids) or h.tokens_hash != tokens_digest(self.token_ids):
            raise HandoffRejected(f"the handoff holds another prompt ({h.num_tokens} tokens; this request has "
                                  f"{len(self.token_ids)})")
        held = h.held()
        from ..visibility import kept_page_mask

        kept = kept_page_mask(h.num_tokens, window, sink, h.page_size, held.shape[2])
        extra = held & ~kept  # pages beyond window and sink: only a selected set may hold them
        sel = h.selection()
        if extra.any():
            if sel is None:
                raise HandoffRejected("the handoff holds pages its plan never keeps (and no selected set)")
            chosen = np.zeros_like(held)
            li, hi, ci = np.nonzero(sel >= 0)
            chosen[li, hi, sel[li, hi, ci] // h.page_size] = True
            if (extra & ~chosen).any():
                raise HandoffRejected("the handoff holds pages neither its plan nor its selected sets keep")
        if h.payload_bytes != 2 * int(held.sum()) * h.page_bytes:
            raise HandoffRejected(f"payload of {h.payload_bytes} bytes for {int(held.sum())} pages")
        if len(h.logits) % 4:
            raise HandoffRejected("first-position logits are not float32")
        return held, int(extra.sum())


@dataclass(eq=False)
class Received:
    """A checked handoff on the decode side, waiting for admission to adopt its pages."""
    header: HandoffHeader
    held: np.ndarray  # bool [L, Hkv, P]
    payload: torch.Tensor  # uint8: K of every held page, then V
    extra_pages: int  # pages beyond the plan's window and sink (selected sets)
    transfer: dict = field(default_factory=dict)  # bytes, bytes by head class, path, seconds
    fetch: object = None  # a path that copies at admission (cuda_ipc): returns the payload, on the engine thread

    @property
    def num_pages(self) -> int:
        return int(self.held.sum())

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.header
        if self.payload is None:
            self.payload, self.fetch = self.fetch(), None
        x = self.payload.view(DTYPES[h.dtype]).view(2, self.num_pages, h.page_size, h.head_dim)
        return x[0], x[1]


def class_bytes(lease_or_classes, page_heads: np.ndarray, page_bytes: int) -> dict:
    """Bytes of the pages ``page_heads`` (flat head index of each page) by their head's class."""
    classes = lease_or_classes
    out = {c: 0 for c in HEAD_CLASSES}
    names, counts = np.unique(classes[page_heads], return_counts=True)
    for c, k in zip(names, counts):
        out[str(c)] += int(k) * page_bytes
    return out


# ---------------------------------------------------------------- the prefill side

class KVServer:
    """The prefill instance's end: answers pulls of its leases on a thread of its own."""

    def __init__(self, leases: LeaseStore, host: str = "127.0.0.1", port: int = 0, paths=None,
                 chunk_bytes: int = CHUNK_BYTES, done_timeout_s: float = 60.0):
        self.leases, self.chunk_bytes, self.done_timeout_s = leases, chunk_bytes, done_timeout_s
        self.paths = paths if paths is not None else {"tcp": TcpPath()}
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops what passes its high-water mark: never here
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a peer that left raises, not vanishes
        self.port = self.sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        self.host = host
        self.awaiting: dict[str, tuple[Lease, float]] = {}  # leases whose receiver must still say "done"
        self.stats = {"transfers": 0, "failed": 0, "bytes_sent": 0, **{f"bytes_{c}": 0 for c in HEAD_CLASSES}}
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="redknot-kv-server", daemon=True)
        self._thread.start()

    def count(self, by_class: dict) -> None:
        with self._lock:
            for c, b in by_class.items():
                self.stats[f"bytes_{c}"] += b
                self.stats["bytes_sent"] += b

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        for path in self.paths.values():
            path.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop:
                if poller.poll(100):
                    ident, body = self.sock.recv_multipart()[:2]
                    self._handle(ident, body)
                self._expire_awaiting()
        finally:
            self.sock.close(0)

    def _handle(self, ident: bytes, body: bytes) -> None:
        try:
            msg = msgpack.unpackb(body)
            op, lease_id = msg["op"], str(msg["lease"])
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            return self._error(ident, "malformed request")
        if op == "done":
            self._finish_awaiting(lease_id, pulled=True)
            return
        path = self.paths.get(msg.get("path", "tcp"))
        if op != "pull" or path is None:
            return self._error(ident, f"unknown op {op!r} or data path {msg.get('path')!r} "
                                      f"(this instance serves {', '.join(self.paths)})")
        lease = self.leases.checkout(lease_id)
        if lease is None:
            return self._error(ident, f"lease {lease_id} is unknown, expired or already pulled")
        log.info("pd: sending lease %s (%d pages) over %s", lease_id, lease.pages.size, path.name)
        try:
            finished = path.serve(self, ident, lease)
        except Exception as e:  # noqa: BLE001  (the receiver recomputes; this instance goes on)
            log.warning("pd: sending lease %s failed: %s", lease_id, e)
            self.stats["failed"] += 1
            self.leases.finish(lease, pulled=False)  # a half-sent lease is never sent again
            return
        self.stats["transfers"] += 1
        if finished:
            self.leases.finish(lease)
        else:
            self.awaiting[lease_id] = (lease, time.monotonic() + self.done_timeout_s, path)

    def _finish_awaiting(self, lease_id: str, pulled: bool) -> None:
        """The lease's pages go back; a path that staged them elsewhere (``release``) lets that go too."""
        entry = self.awaiting.pop(lease_id, None)
        if entry is None:
            return
        lease, _, path = entry
        release = getattr(path, "release", None)
        if release is not None:
            try:
                release(lease_id)
            except Exception as e:  # noqa: BLE001  (the pages still go back)
                log.warning("pd: releasing lease %s's %s staging failed: %s", lease_id, path.name, e)
        self.leases.finish(lease, pulled=pulled)

    def _expire_awaiting(self) -> None:
        now = time.monotonic()
        for lease_id, (_, deadline, _) in list(self.awaiting.items()):
            if deadline <= now:
                self._finish_awaiting(lease_id, pulled=False)

    def _error(self, ident: bytes, reason: str) -> None:
        try:
            self.sock.send_multipart([ident, b"E", reason.encode()])
        except zmq.ZMQError:
            pass

    def send(self, ident: bytes, kind: bytes, data, copy: bool = True) -> None:
        self.sock.send_multipart([ident, kind, data], copy=copy)


def gather(lease: Lease) -> torch.Tensor:
    """The lease's payload as one uint8 tensor on the pool's device: K of its pages, then V."""
    k, v = lease.k_pages, lease.v_pages
    with device_lock:
        idx = torch.from_numpy(lease.pages.astype(np.int64)).to(k.device)
        stream = torch.cuda.Stream(k.device) if k.is_cuda else None
        with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else _nothing()):
            out = torch.stack([k.index_select(0, idx), v.index_select(0, idx)]).reshape(-1).view(torch.uint8)
        if stream is not None:
            stream.synchronize()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class TcpPath:
    """The payload over the control connection itself, streamed: pages are gathered on the pool's
    device a chunk at a time, copied to the host and sent while the next is gathered; the xxh3-64
    of the payload follows the last chunk (a trailer), so the header leaves at once and no
    staging copy of the whole payload is ever held."""
    name = "tcp"
    checks_digest = True  # ``receive`` verifies the trailer against what arrived

    def serve(self, server: KVServer, ident: bytes, lease: Lease) -> bool:
        h = lease.header
        half = h.page_bytes
        total = 2 * lease.pages.size
        h.payload_bytes, h.digest_algo, h.digest, h.extra = total * half, "xxh3-64", 0, {"trailer": True}
        server.send(ident, b"H", h.encode())
        pause = float(os.environ.get(FAULT_PAUSE_ENV, "0") or 0)
        if pause > 0:
            time.sleep(pause)
        k, v = lease.k_pages, lease.v_pages
        with device_lock:
            idx = torch.from_numpy(lease.pages.astype(np.int64)).to(k.device)
            stream = torch.cuda.Stream(k.device) if k.is_cuda else None
        per_chunk = max(1, server.chunk_bytes // half)
        digest = xxhash.xxh3_64()
        P, a = lease.pages.size, 0
        while a < total:  # a chunk holds K pages or V pages, never both
            src, lo = (k, a) if a < P else (v, a - P)
            hi = min(lo + per_chunk, P)
            a += hi - lo
            with device_lock, torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else _nothing()):
                chunk = src.index_select(0, idx[lo:hi]).cpu() if src.is_cuda else src.index_select(0, idx[lo:hi])
            data = chunk.reshape(-1).view(torch.uint8).numpy()
            digest.update(data)
            server.send(ident, b"C", memoryview(data), copy=False)
            server.count(class_bytes(lease.head_class, lease.page_head[lo:hi], half))
        server.send(ident, b"T", digest.intdigest().to_bytes(8, "little"))
        return True

    def receive(self, session: "PullSession", h: HandoffHeader, pin: bool) -> torch.Tensor:
        with device_lock:  # pinning calls into CUDA
            payload = torch.empty(h.payload_bytes, dtype=torch.uint8, pin_memory=pin)
        out = payload.numpy()
        digest = xxhash.xxh3_64()
        got = 0
        while got < h.payload_bytes:
            data = session.recv(b"C")
            n = len(data)
            if got + n > h.payload_bytes:
                raise TransferFailed("the prefill instance sent more bytes than its header announced", rejected=True)
            piece = np.frombuffer(data, dtype=np.uint8)
            digest.update(piece)
            out[got:got + n] = piece
            got += n
        if digest.intdigest() != int.from_bytes(bytes(session.recv(b"T")), "little"):
            raise HandoffRejected("payload checksum (xxh3-64) mismatch")
        return payload

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- the decode side

class PullSession:
    """One pull's connection: a DEALER socket and a monitor that notices the peer leaving."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                    | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED)
        self.sock.connect(f"tcp://{host}:{port}")
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.address = f"{host}:{port}"

    def send(self, msg: dict) -> None:
        self.sock.send(msgpack.packb(msg))

    def recv(self, kind: bytes):
        """The next message's data, of ``kind``; TransferFailed when the peer reports an error,
        leaves, cannot be reached, or sends nothing for ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferFailed(f"no data from the prefill instance at {self.address} for {self.timeout_s:g} s")
            events = dict(self.poller.poll(left * 1000))
            if self.monitor in events:
                ev = recv_monitor_message(self.monitor)["event"]
                if ev in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CLOSED):
                    raise TransferFailed(f"the prefill instance at {self.address} went away or is unreachable")
            if self.sock in events:
                got, data = self.sock.recv_multipart(copy=False)
                got = bytes(got.buffer)
                if got == b"E":
                    raise TransferFailed(f"the prefill instance refused the pull: {bytes(data.buffer).decode()}")
                if got != kind:
                    raise TransferFailed(f"unexpected {got!r} message from the prefill instance", rejected=True)
                return data.buffer

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class KVClient:
    """The decode instance's end: pulls a lease named by a prefill response's kv_transfer_params."""

    def __init__(self, paths=None, timeout_s: float = 30.0, device: torch.device | None = None):
        self.paths = paths if paths is not None else {"tcp": TcpPath()}
        self.timeout_s = timeout_s
        self.device = torch.device(device or "cpu")
        self.ctx = zmq.Context.instance()
        self.stats = {"transfers": 0, "failed": 0, "rejected": 0, "bytes_received": 0,
                      **{f"bytes_{c}": 0 for c in HEAD_CLASSES}}
        self._lock = threading.Lock()

    def pull(self, params: dict, expect: Expect) -> Received:
        """The checked handoff ``params`` names (kv_transfer_params of a prefill response).
        Raises TransferFailed (``rejected`` for a mismatch or a bad checksum)."""
        try:
            got = self._pull(params, expect)
        except HandoffRejected as e:
            self._fail(rejected=True)
            raise TransferFailed(str(e), rejected=True) from None
        except TransferFailed as e:
            self._fail(rejected=e.rejected)
            raise
        with self._lock:
            self.stats["transfers"] += 1
            for c, b in got.transfer["bytes_by_head_class"].items():
                self.stats[f"bytes_{c}"] += b
            self.stats["bytes_received"] += got.transfer["bytes"]
        return got

    def _fail(self, rejected: bool) -> None:
        with self._lock:
            self.stats["failed"] += 1
            self.stats["rejected"] += rejected

    def _pull(self, params: dict, expect: Expect) -> Received:
        try:
            host, port, lease_id = str(params["remote_host"]), int(params["remote_port"]), str(params["remote_request_id"])
        except (KeyError, TypeError, ValueError):
            raise TransferFailed("kv_transfer_params lack remote_host, remote_port or remote_request_id",
                                 rejected=True) from None
        name = str(params.get("transport") or "tcp")
        path = self.paths.get(name)
        if path is None:
            raise TransferFailed(f"data path {name!r} is not available here ({', '.join(self.paths)})", rejected=True)
        t0 = time.perf_counter()
        session = PullSession(self.ctx, host, port, self.timeout_s)
        try:
            session.send({"op": "pull", "lease": lease_id, "path": name})
            h = HandoffHeader.decode(session.recv(b"H"))
            if h.lease != lease_id:
                raise HandoffRejected(f"asked for lease {lease_id}, got {h.lease}")
            held, extra = expect.check(h)
            payload = path.receive(session, h, self.device.type == "cuda")
        finally:
            session.close()
        fetch = payload if callable(payload) else None  # copied at admission, checked then
        if fetch is not None:
            payload = None
        elif payload.numel() != h.payload_bytes:
            raise HandoffRejected(f"payload of {payload.numel()} bytes, the header says {h.payload_bytes}")
        elif not getattr(path, "checks_digest", False):
            with device_lock:
                if payload_digest(payload, h.digest_algo) != h.digest:
                    raise HandoffRejected(f"payload checksum ({h.digest_algo}) mismatch")
        li, hi, _ = np.nonzero(held)
        classes = expect_classes(params, h)
        heads = np.concatenate([li * h.num_kv_heads + hi] * 2)
        by_class = class_bytes(classes, heads, h.page_bytes)
        transfer = {"bytes": int(h.payload_bytes), "bytes_by_head_class": by_class, "transport": name,
                    "seconds": time.perf_counter() - t0, "pages": int(held.sum())}
        return Received(h, held, payload, extra, transfer, fetch)


def expect_classes(params: dict, h: HandoffHeader) -> np.ndarray:
    """Each head's class as the prefill named it (kv_transfer_params ``head_classes``: a string of
    g/l/r per head), else global for all."""
    code = str(params.get("head_classes") or "")
    names = {"g": "global", "l": "local", "r": "retrieval"}
    if len(code) != h.heads or set(code) - set(names):
        return np.array(["global"] * h.heads, dtype=object)
    return np.array([names[c] for c in code], dtype=object)
