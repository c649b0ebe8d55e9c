"""The nccl data path: a handoff's pages by torch.distributed point-to-point.

A prefill instance (rank 0) and a decode instance (rank 1) join one process group at start-up
(``--pd-nccl-init tcp://host:port``; NCCL between GPUs, gloo between CPU processes, which the tests
use). The header still goes over the control channel; the payload is gathered on the prefill's
device, sent with ``dist.send`` and received with ``dist.recv`` straight into a buffer on the decode's
device, checksummed there (``fold64``) without a trip through the host. One pair, one transfer at
a time: each side serialises its sends or receives, and the control channel orders them.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .wire import HandoffHeader, payload_digest


class NcclPath:
    name = "nccl"

    def __init__(self, init_method: str, rank: int, device, timeout_s: float = 30.0):
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # joining blocks until the other instance joins too: in the background, so the server starts
        self._thread = threading.Thread(target=self._join, args=(init_method, timeout_s), daemon=True,
                                        name="redknot-pd-nccl-init")
        self._thread.start()

    def _join(self, init_method: str, timeout_s: float) -> None:
        try:
            if not dist.is_initialized():
                dist.init_process_group(self.backend, init_method=init_method, rank=self.rank, world_size=2,
                                        timeout=timedelta(seconds=max(timeout_s, 60)))
        except BaseException as e:  # noqa: BLE001  (reported to the first transfer)
            self._error = e
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s):
            raise RuntimeError("the prefill/decode process group has not formed yet (is the other instance up?)")
        if self._error is not None:
            raise RuntimeError(f"the prefill/decode process group failed to form: {self._error}")

    def serve(self, server, ident: bytes, lease) -> bool:
        from .transfer import class_bytes, gather

        self.wait_ready(server.done_timeout_s)
        from .device import device_lock

        payload = gather(lease)
        h = lease.header
        with device_lock:
            h.payload_bytes, h.digest_algo = payload.numel(), "fold64"
            h.digest = payload_digest(payload, "fold64")
        h.extra = {"rank": self.rank}
        with self._lock:
            server.send(ident, b"H", h.encode())
            dist.send(payload, dst=self.peer)
        server.count(class_bytes(lease.head_class, np.concatenate([lease.page_head] * 2), h.page_bytes))
        return True

    def receive(self, session, h: HandoffHeader, pin: bool) -> torch.Tensor:
        from .device import device_lock

        self.wait_ready(session.timeout_s)
        with device_lock:
            buf = torch.empty(h.payload_bytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            dist.recv(buf, src=int(h.extra.get("rank", self.peer)))
        return buf

    def close(self) -> None:
        pass
