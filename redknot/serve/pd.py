"""The server's side of prefill/decode disaggregation: vLLM's ``kv_transfer_params`` handoff.

A PD router (``vllm-router --vllm-pd-disaggregation``) sends each request twice: to a prefill
instance with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true, ...}``, then,
with the ``kv_transfer_params`` of that response, to a decode instance. Here:

* prefill leg (role ``prefill`` or ``both``): the request runs as usual (document reuse included)
  and its sequence is marked for export; when it finishes, the engine keeps its pages under a lease
  (``engine/handoff.py``) and the response's ``kv_transfer_params`` say where to pull them
  (vLLM's NixlConnector names: ``do_remote_prefill``, ``remote_engine_id``, ``remote_host``,
  ``remote_port``, ``remote_request_id``; redknot's: ``transport``, ``plan``, ``head_classes``);
* decode leg (role ``decode`` or ``both``): the server tokenises the request again, pulls the
  lease (``pd/transfer.py``) on a thread of its own, checks it, and hands it to the engine, which
  adopts the pages at admission and samples the first token from the prefill's logits. When the
  pull fails (the prefill instance died, the lease expired, a checksum or plan mismatch) the
  request is computed here from its prompt (``--pd-on-failure recompute``, the default) or
  answered 503 (``fail``).

Requests without ``kv_transfer_params`` are served as usual on every role.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..engine import handoff
from ..pd.transfer import KVClient, KVServer, TcpPath, TransferFailed

log = logging.getLogger("redknot.serve.pd")

ROLES = ("both", "prefill", "decode")
TRANSPORTS = ("tcp", "cuda_ipc", "nccl", "nixl")
POLICIES = ("recompute", "fail")


@dataclass
class PDOptions:
    role: str = "both"
    transport: str = "tcp"  # the data path this instance offers (prefill) and asks for (decode)
    host: str = "127.0.0.1"  # where the KV server binds, and the host named in kv_transfer_params
    port: int = 0  # 0: any free port (named in kv_transfer_params)
    lease_s: float = 30.0  # a prefilled request's pages wait this long for their pull
    pull_timeout_s: float = 30.0  # a pull fails after this long without data
    on_failure: str = "recompute"
    nccl_init: str | None = None  # torch.distributed init method of the prefill/decode pair (nccl)
    nccl_rank: int | None = None  # 0: the prefill instance, 1: the decode instance

    def __post_init__(self):
        for name, value, allowed in (("role", self.role, ROLES), ("transport", self.transport, TRANSPORTS),
                                     ("on_failure", self.on_failure, POLICIES)):
            if value not in allowed:
                raise ValueError(f"--pd-{name.replace('_', '-')} {value!r}: one of {', '.join(allowed)}")
        if self.lease_s <= 0 or self.pull_timeout_s <= 0:
            raise ValueError("--pd-lease-s and --pd-pull-timeout-s must be > 0")

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")


class PDError(Exception):
    """A request the handoff cannot serve: (status, message, code)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def data_paths(opts: PDOptions, device) -> dict:
    """The data path objects for ``opts.transport`` (TCP always: the control channel carries it)."""
    paths = {"tcp": TcpPath()}
    if opts.transport == "cuda_ipc":
        from ..pd.cuda_ipc import CudaIpcPath

        paths["cuda_ipc"] = CudaIpcPath()
    elif opts.transport == "nixl":
        from ..pd.nixl_transport import NixlPath

        paths["nixl"] = NixlPath()  # raises, naming the import error, where NIXL does not import
    elif opts.transport == "nccl":
        from ..pd.nccl import NcclPath

        if opts.nccl_init is None or opts.nccl_rank not in (0, 1):
            raise ValueError("--pd-transport nccl needs --pd-nccl-init (e.g. tcp://10.0.0.1:29600) and "
                             "--pd-nccl-rank (0 on the prefill instance, 1 on the decode instance)")
        paths["nccl"] = NcclPath(opts.nccl_init, opts.nccl_rank, device, opts.pull_timeout_s)
    return paths


class PDService:
    def __init__(self, engine, opts: PDOptions):
        self.opts, self.engine, self.llm = opts, engine, engine.llm
        core = self.llm.engine
        core.leases.ttl_s = opts.lease_s
        core.leases.wake = engine.wake
        self.engine_id = uuid.uuid4().hex
        paths = data_paths(opts, core.device)
        self.server = KVServer(core.leases, opts.host, opts.port, paths) if opts.prefills else None
        self.client = KVClient(paths, opts.pull_timeout_s, core.device) if opts.decodes else None
        self.pulls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="redknot-kv-pull")
        self.recomputed = 0  # decode legs computed here after a failed pull
        self.refused = 0  # decode legs answered 503 after a failed pull (policy fail)

    @property
    def address(self) -> str | None:
        return None if self.server is None else f"tcp://{self.opts.host}:{self.server.port}"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.pulls.shutdown(wait=False)

    # ---- a request's leg ------------------------------------------------------------------------
    async def prepare(self, req, seqs: list) -> None:
        """Mark a prefill leg's sequence for export, or pull a decode leg's KV into its sequence."""
        params = req.kv_transfer_params
        if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
            return
        if len(seqs) != 1:
            raise PDError(400, "kv_transfer_params: a disaggregated request has one prompt and n = 1",
                          "invalid_request_error", "kv_transfer_params")
        seq = seqs[0]
        if params.get("do_remote_decode"):
            if not self.opts.prefills:
                raise PDError(400, f"kv_transfer_params: this instance's role is {self.opts.role}; send "
                                   f"do_remote_decode requests to a prefill instance", "invalid_request_error",
                              "kv_transfer_params")
            if req.stream:
                raise PDError(400, "kv_transfer_params: a prefill leg is not streamed (its response carries "
                                   "the handoff)", "invalid_request_error", "stream")
            seq.kv_export = uuid.uuid4().hex
            seq.params = replace(seq.params, return_first_logits=True)
            return
        if not self.opts.decodes:
            raise PDError(400, f"kv_transfer_params: this instance's role is {self.opts.role}; send "
                               f"do_remote_prefill requests to a decode instance", "invalid_request_error",
                          "kv_transfer_params")
        await self._import(req, seq, params)

    async def _import(self, req, seq, params: dict) -> None:
        core = self.llm.engine
        expect = handoff.expectation(core, seq)
        loop = asyncio.get_running_loop()
        try:
            got = await loop.run_in_executor(self.pulls, self.client.pull, params, expect)
        except TransferFailed as e:
            if self.opts.on_failure == "fail":
                self.refused += 1
                raise PDError(503, f"the prefill instance's KV could not be had: {e}", "kv_transfer_failed") from None
            self.recomputed += 1
            log.warning("pd: pull failed (%s); computing the prompt here", e)
            return
        seq.kv_import, seq.kv_transfer = got, got.transfer
        if req.max_tokens is None:  # what the pool leaves a request that brings its prompt's pages
            seq.params = replace(seq.params, max_tokens=max(1, self.llm.max_new_tokens(seq)))

    def response_params(self, seqs: list) -> dict | None:
        """The prefill leg's kv_transfer_params: where and how its lease is pulled (None when the
        request made no lease: it failed or was aborted)."""
        if self.server is None or len(seqs) != 1 or seqs[0].kv_export is None:
            return None
        lease = self.llm.engine.leases.get(seqs[0].kv_export)
        if lease is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": self.opts.host, "remote_port": self.server.port,
                "remote_request_id": lease.lease_id, "remote_block_ids": None, "tp_size": 1,
                "transport": self.opts.transport, "plan": lease.header.plan,
                "head_classes": "".join(str(c)[0] for c in lease.head_class)}

    def stats(self) -> dict:
        core = self.llm.engine
        out = {"role": self.opts.role, "leases": core.leases.stats(), "recomputed": self.recomputed,
               "refused": self.refused}
        if self.server is not None:
            out["sent"] = dict(self.server.stats)
        if self.client is not None:
            out["received"] = dict(self.client.stats)
        return out
