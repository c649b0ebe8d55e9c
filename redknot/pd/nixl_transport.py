"""The nixl data path: NVIDIA's NIXL library moves the payload; the decode side READs it out of the
prefill's memory (UCX underneath: shared memory or TCP between CPUs, RDMA or NVLink where the
hosts have them).

The prefill side gathers the lease's pages into one staging tensor on the pool's device, registers
it with its NIXL agent and answers the pull with the header plus, in ``extra``, the agent's partial
metadata (its connection info and this buffer's keys: bytes NIXL produces) and the buffer's address,
length, device and memory type: plain values, no pickle. The decode side loads the metadata,
registers a host buffer of its own, READs, and says "done"; the prefill then deregisters the staging
buffer and lets the lease go (a "done" that never comes expires the lease and frees it the same
way). The decode side checks the header's checksum (``xxh3-64`` from a host pool, ``fold64`` from a
GPU pool) like every path.

Optional: ``pip install 'redknot[nixl]'``. ``--pd-transport nixl`` fails at start-up, naming the
import error, where NIXL does not import.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import numpy as np
import torch

from .device import device_lock
from .wire import HandoffHeader, payload_digest


def _nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # noqa: BLE001  (ImportError, or a backend library that fails to load)
        raise RuntimeError(f"--pd-transport nixl needs NIXL (pip install 'redknot[nixl]'); import nixl failed: "
                           f"{type(e).__name__}: {e}") from e
    return nixl_agent, nixl_agent_config


class NixlPath:
    name = "nixl"
    checks_digest = False  # the client checks the header's digest on what the READ delivered

    def __init__(self, backend: str = "UCX", poll_s: float = 0.0005):
        nixl_agent, nixl_agent_config = _nixl_api()
        self.agent_name = f"redknot-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(backends=[backend]))
        if backend not in self.agent.backends:
            raise RuntimeError(f"--pd-transport nixl: NIXL has no {backend} backend here "
                               f"(plugins: {', '.join(self.agent.get_plugin_list())})")
        self.poll_s = poll_s
        self._lock = threading.Lock()  # one NIXL call at a time: pulls run on several threads
        self._staged: dict[str, tuple[torch.Tensor, object]] = {}  # lease id -> (staging tensor, its registration)
        self._stuck: list = []  # receive buffers of READs NIXL could not cancel: kept, never reused

    # ------------------------------------------------------------ the prefill side

    def serve(self, server, ident: bytes, lease) -> bool:
        from .transfer import class_bytes, gather

        payload = gather(lease)
        h = lease.header
        with device_lock:
            h.payload_bytes = payload.numel()
            h.digest_algo = "fold64" if payload.is_cuda else "xxh3-64"
            h.digest = payload_digest(payload, h.digest_algo)
        with self._lock:
            reg = self.agent.register_memory([payload])
            metadata = self.agent.get_partial_agent_metadata(reg, inc_conn_info=True)
        self._staged[h.lease] = (payload, reg)
        h.extra = {"agent": self.agent_name, "metadata": metadata, "addr": payload.data_ptr(),
                   "len": payload.numel(), "device": max(payload.get_device(), 0),
                   "mem": "VRAM" if payload.is_cuda else "DRAM"}
        try:
            server.send(ident, b"H", h.encode())
        except BaseException:  # the receiver never hears of the buffer: nothing will release it but this
            self.release(h.lease)
            raise
        server.count(class_bytes(lease.head_class, np.concatenate([lease.page_head] * 2), h.page_bytes))
        return False  # the receiver READs after this: the staging buffer lives until its "done"

    def release(self, lease_id: str) -> None:
        """The receiver said "done" (or never did, and the lease expired): the staging buffer goes."""
        staged = self._staged.pop(lease_id, None)
        if staged is not None:
            with self._lock:
                self.agent.deregister_memory(staged[1])

    # ------------------------------------------------------------ the decode side

    def receive(self, session, h: HandoffHeader, pin: bool) -> torch.Tensor:
        from .transfer import TransferFailed

        x = h.extra
        try:
            remote = (int(x["addr"]), int(x["len"]), int(x["device"]))
            mem, metadata = str(x["mem"]), bytes(x["metadata"])
        except (KeyError, TypeError, ValueError):
            raise TransferFailed("the nixl handoff lacks its agent metadata or buffer", rejected=True) from None
        if remote[1] != h.payload_bytes or mem not in ("DRAM", "VRAM"):
            raise TransferFailed(f"the nixl buffer ({remote[1]} bytes of {mem}) does not match the header",
                                 rejected=True)
        with device_lock:  # pinning calls into CUDA
            buf = torch.empty(h.payload_bytes, dtype=torch.uint8, pin_memory=pin)
        reg = None
        try:
            try:
                with self._lock:
                    peer = self.agent.add_remote_agent(metadata)
                    reg = self.agent.register_memory([buf])
                error, released = self._read(buf, remote, mem, peer, session.timeout_s)
            except Exception as e:  # noqa: BLE001  (NIXL raises its own errors: a failed pull, not a crash)
                error, released = f"nixl: {type(e).__name__}: {e}", True
            if reg is not None and released:
                with self._lock:
                    self.agent.deregister_memory(reg)
            elif reg is not None:  # a READ that could not be cancelled may still land: its buffer outlives the pull
                self._stuck.append((buf, reg))
        finally:  # done or failed, the prefill may let its staging buffer and the lease go
            session.send({"op": "done", "lease": h.lease})
        if error is not None:
            raise TransferFailed(error)
        return buf

    def _read(self, buf: torch.Tensor, remote: tuple, mem: str, peer, timeout_s: float) -> tuple[str | None, bool]:
        """READs the remote buffer into ``buf``: (what went wrong, or None; whether NIXL let the
        request go: a READ cut short by the timeout may not be cancellable)."""
        with self._lock:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs([buf]),
                                                self.agent.get_xfer_descs([remote], mem), peer)
            state = self.agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        error = None
        while state == "PROC":
            if time.monotonic() > deadline:
                error = f"the nixl READ from {peer!r} did not finish in {timeout_s:g} s"
                break
            time.sleep(self.poll_s)
            with self._lock:
                state = self.agent.check_xfer_state(handle)
        if error is None and state != "DONE":
            error = f"the nixl READ from {peer!r} failed ({state})"
        try:
            with self._lock:
                self.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001  (an active READ NIXL could not cancel)
            return error, False
        return error, True

    def close(self) -> None:
        for lease_id in list(self._staged):
            self.release(lease_id)
