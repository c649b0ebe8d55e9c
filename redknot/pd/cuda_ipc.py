"""The cuda_ipc data path: a prefill and a decode process on one GPU share the prefill pool's memory.

The prefill side answers a pull with the header plus CUDA IPC handles of its pool's K and V page
tensors (``UntypedStorage._share_cuda_``: plain bytes and integers, sent in the msgpack header, no
pickle) and the lease's page ids. The decode side opens the handles (once per pool: torch caches
the mapping), gathers the pages into a buffer of its own on the device, checks ``fold64`` against
the prefill's, and says "done": only then does the lease let the pages go. Nothing passes through
the host. The gather runs on the engine's thread when the request is admitted (the engine owns the
device: a copy from another thread could race its CUDA-graph captures); a checksum mismatch found
then fails the request rather than recomputing it.
"""

from __future__ import annotations

import numpy as np
import torch

import msgpack
import zmq

from .wire import DTYPES, HandoffHeader, HandoffRejected, dtype_name, payload_digest


def share(t: torch.Tensor) -> dict:
    """A CUDA tensor as IPC-shareable plain values."""
    st = t.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = st._share_cuda_()
    return {"storage": [device, handle, size, offset, ref_handle, ref_offset, event, event_sync],
            "offset": t.storage_offset(), "shape": list(t.shape), "stride": list(t.stride()),
            "dtype": dtype_name(t.dtype)}


def open_shared(d: dict) -> torch.Tensor:
    """The tensor ``share`` described, mapped into this process."""
    st = torch.UntypedStorage._new_shared_cuda(*d["storage"])
    t = torch.empty(0, dtype=DTYPES[d["dtype"]], device=st.device)
    return t.set_(st, d["offset"], d["shape"], d["stride"])


class CudaIpcPath:
    name = "cuda_ipc"

    def __init__(self):
        self._opened: dict[bytes, torch.Tensor] = {}  # handle -> mapped tensor (a pool lives as long as its server)

    def serve(self, server, ident: bytes, lease) -> bool:
        from .transfer import class_bytes, gather

        if not lease.k_pages.is_cuda:
            raise RuntimeError("cuda_ipc needs the prefill pool on a CUDA device")
        from .device import device_lock

        payload = gather(lease)
        h = lease.header
        with device_lock:
            h.payload_bytes, h.digest_algo = payload.numel(), "fold64"
            h.digest = payload_digest(payload, "fold64")
            h.extra = {"k": share(lease.k_pages), "v": share(lease.v_pages),
                       "pages": lease.pages.astype("<i8").tobytes()}
            del payload
        server.send(ident, b"H", h.encode())
        server.count(class_bytes(lease.head_class, np.concatenate([lease.page_head] * 2), h.page_bytes))
        return False  # the receiver reads the pages after this: the lease waits for its "done"

    def _tensor(self, d: dict) -> torch.Tensor:
        key = bytes(d["storage"][1]) + str(d["storage"][3]).encode()
        if key not in self._opened:
            self._opened[key] = open_shared(d)
        return self._opened[key]

    def receive(self, session, h: HandoffHeader, pin: bool):
        """A fetch to run on the engine thread at admission (not here: a device copy on a pull thread
        would race the engine's CUDA-graph captures): it maps the prefill's pool, gathers the pages,
        checks ``fold64`` and says "done" (the prefill then frees them)."""
        address = session.address

        def fetch() -> torch.Tensor:
            try:
                k, v = self._tensor(h.extra["k"]), self._tensor(h.extra["v"])
                idx = torch.from_numpy(np.frombuffer(h.extra["pages"], dtype="<i8").copy()).to(k.device)
                with torch.inference_mode():
                    out = torch.stack([k.index_select(0, idx), v.index_select(0, idx)]).reshape(-1).view(torch.uint8)
                ok = payload_digest(out, "fold64") == h.digest
            finally:
                _send_done(address, h.lease)
            if not ok:
                raise HandoffRejected("payload checksum (fold64) mismatch")
            return out
        return fetch

    def close(self) -> None:
        self._opened.clear()


def _send_done(address: str, lease: str) -> None:
    """Tell the prefill instance its pages were copied (a short-lived socket of the calling thread)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://{address}")
    sock.send(msgpack.packb({"op": "done", "lease": lease}))
    sock.close()
