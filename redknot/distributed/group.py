"""The tensor-parallel process group: one process per device, rank 0 the one that owns requests.

Two groups over the same ranks, as vLLM keeps them: ``device`` carries the model's collectives
(NCCL on CUDA, gloo on CPU) and ``cpu`` (always gloo) carries the step's commands as pickled
objects, so rank 0 never stages Python objects through a GPU. Every collective has a timeout:
a rank that died makes the others raise instead of waiting forever.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Seconds a collective waits for the other ranks (a crashed worker surfaces as an error after it)
DEFAULT_TIMEOUT_S = float(os.environ.get("REDKNOT_TP_TIMEOUT", "120"))


@dataclass
class TPGroup:
    rank: int
    world: int
    device: torch.device
    device_group: object = None  # torch.distributed ProcessGroup for tensors
    cpu_group: object = None  # gloo ProcessGroup for pickled commands
    comm_s: float = 0.0  # host seconds in the model's collectives (CPU: their whole time, waits included)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- tensor collectives (the model's) -------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (returned for chaining)."""
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.device_group)
        self.comm_s += time.perf_counter() - t0
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        self.comm_s += time.perf_counter() - t0
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place)."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    # ---- commands -------------------------------------------------------------------------------
    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` (pickled) on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def agree(self, digest: int) -> bool:
        """Whether every rank computed the same 62-bit ``digest`` (one small all-reduce)."""
        d = digest & ((1 << 62) - 1)
        x = torch.tensor([d, -d], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(x[0]) == -int(x[1]) == d


    def agree_min(self, n: int) -> int:
        """The smallest of every rank's ``n`` (the ranks size shared structures alike)."""
        x = torch.tensor([int(n)], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(x[0])


_current: TPGroup | None = None


def current() -> TPGroup | None:
    """The process's tensor-parallel group, or None (one device)."""
    return _current


def free_address() -> str:
    """A TCP rendezvous address on this host with a port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(rank: int, world: int, address: str, device: torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the group (every rank calls this; it returns once all have joined)."""
    global _current
    if _current is not None:
        raise RuntimeError("a tensor-parallel group is already open in this process: close its LLM first")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend_for(device), init_method=address, rank=rank, world_size=world, timeout=timeout)
    cpu = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else dist.group.WORLD
    _current = TPGroup(rank, world, device, dist.group.WORLD, cpu)
    return _current


def close_group() -> None:
    """Leave the group (idempotent)."""
    global _current
    if _current is not None and dist.is_initialized():
        dist.destroy_process_group()
    _current = None
