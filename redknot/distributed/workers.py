"""Rank 0 starts the other ranks as processes (spawned, as vLLM's multiprocessing executor does)
and watches them; a worker builds the same front as rank 0 on its own device and replays
rank 0's engine calls until it closes."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from .group import close_group, free_address, init_group


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited while rank 0 still needed it."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: CUDA device ``rank`` on a GPU host, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _worker_main(front, kwargs: dict, rank: int, world: int, address: str) -> None:
    """A worker: the front (``LLM``) built as rank ``rank`` (its model shard, pool and engine),
    then rank 0's calls replayed until it closes."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    llm = front(**kwargs, _tp_rank=(rank, address))
    try:
        llm.engine.serve()
    finally:
        close_group()


class Workers:
    """Ranks 1..N-1 of a group, started by rank 0."""

    def __init__(self, front, kwargs: dict, world: int):
        self.address = free_address()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(front, kwargs, r, world, self.address), daemon=True,
                                  name=f"redknot-tp-rank{r}") for r in range(1, world)]
        for p in self.procs:
            p.start()

    def check(self) -> None:
        """Raise ``WorkerDied`` if any worker has exited."""
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                raise WorkerDied(f"tensor-parallel worker rank {r} exited with code {p.exitcode}; the engine "
                                 "cannot go on (restart it)")

    def join(self, timeout: float = 30.0) -> None:
        """Wait for the workers to return; terminate those that do not."""
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(5)


def start_group(front, kwargs: dict, world: int, device: torch.device):
    """Rank 0: start the workers and join the group with them. Returns (group, workers)."""
    workers = Workers(front, kwargs, world)
    try:
        group = init_group(0, world, workers.address, rank_device(device, 0))
    except Exception:
        workers.join(1)
        raise
    return group, workers
