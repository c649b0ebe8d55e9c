"""One rank's tensor-parallel setup, made by the front (``LLM``) before it loads its model: the
head order (balanced), the rank's shard, the process group (rank 0 starts the workers first)."""

from __future__ import annotations

import atexit

import torch

from ..config import HeadConfig
from ..models.config import ModelConfig
from .balance import balanced_order, imbalance
from .group import close_group, init_group
from .shard import Shard, check_tensor_parallel
from .workers import rank_device, start_group


class TensorParallel:
    """``rank_address``: None on rank 0 (which starts ranks 1..N-1 as workers building ``front``
    with ``kwargs``), (rank, rendezvous address) on a worker. ``balance``: permute each layer's KV
    heads so the plan's cost is spread over the ranks (``balance.py``)."""

    def __init__(self, front, kwargs: dict, world: int, rank_address, cfg: ModelConfig,
                 head_config: HeadConfig | None, device: torch.device, balance: bool = True):
        check_tensor_parallel(cfg, world)
        self.world, self.rank = world, 0 if rank_address is None else rank_address[0]
        self.device = rank_device(device, self.rank)
        self.order = balanced_order(head_config, world) if balance else None
        per_token = 2 * cfg.head_dim * (2 if self.device.type == "cuda" else 4)
        plan = head_config or HeadConfig.all_global(cfg.num_hidden_layers, cfg.num_key_value_heads)
        self.imbalance = {"before": imbalance(plan, world, None, bytes_per_token=per_token),
                          "after": imbalance(plan, world, self.order, bytes_per_token=per_token)}
        self.shard = Shard(cfg, self.rank, world, self.order)
        self.workers = None
        if self.rank == 0:
            self.group, self.workers = start_group(front, kwargs, world, device)
            atexit.register(self.close)
        else:
            self.group = init_group(self.rank, world, rank_address[1], self.device)
        self.engine = None  # set by the front once built (closing tells its workers)
        self.closed = False

    @property
    def local_config(self) -> ModelConfig:
        return self.shard.local

    def watch(self) -> None:
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Rank 0: stop the workers and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.rank == 0 and self.engine is not None and self.workers is not None:
                self.workers.check()
                self.engine.close()
        except Exception:  # a dead worker: nothing left to tell
            pass
        finally:
            if self.workers is not None:
                self.workers.join()
            close_group()
