"""The head plans the pool serves and the model runner over it.

Every method's KV lives under one of two plans: ``dense`` (every head global) and, with a head
config, ``headsparse`` (each head its class's visibility); the head selection may add twins of
them (``+sel``). The visibility each plan gives a head comes from ``HeadConfig.visibility``: the one
rule (``redknot.visibility``), and the model's own sliding-window layers, as the model's adapter
sees them (SELECTVISIBLESTATE).
"""

from __future__ import annotations

import torch

from ..cache import PagePool
from ..cache.linear_state import LinearStatePool
from ..models.adapter import ModelAdapter
from .model_runner import ModelRunner


def build_pool(adapter: ModelAdapter, head_config, num_pages: int, page_size: int, dtype, device, slots: int,
               max_len: int, plans: dict | None = None, state_snapshots: int = 0) -> PagePool:
    """A pool of ``num_pages`` pages of the adapter's state layout under ``plans`` (default: the
    base plans it sees) with device tables for ``slots`` sequences of up to ``max_len`` tokens
    (and a hybrid's linear state for each, with ``state_snapshots`` snapshot rows)."""
    layout = adapter.state_layout()
    if layout.kind != "kv_pages":
        raise ValueError(f"the page pool holds K/V pages; this model stores {layout.kind!r}")
    plans = plans or adapter.visible_state(head_config)
    pool = PagePool(num_pages, page_size, layout.head_dim, *plans["dense"], dtype=dtype, device=device,
                    stored_heads=layout.num_kv_heads)
    for name, (window, sink) in plans.items():
        if name != "default":
            pool.add_plan(name, window, sink)
    pool.attach_device_tables(slots, max_len)
    if layout.linear is not None:  # a hybrid's linear layers: a state per sequence slot (slot 0: padding)
        pool.linear_state = LinearStatePool(layout.linear_layers, layout.linear, slots + 1, dtype, device,
                                            num_snapshots=state_snapshots)
    return pool


def build_runner(adapter: ModelAdapter, pool: PagePool, cfg) -> ModelRunner:
    """The model runner with every plan of the pool as device tensors (per plan head: the model's
    attention applies each head's own window and sink)."""
    tensors = {}
    for name in pool.plans:
        if name == "default":
            continue
        window, sink = pool.head_window_sink(name)
        tensors[name] = (torch.as_tensor(window, dtype=torch.int32).to(pool.device),
                         torch.as_tensor(sink, dtype=torch.int32).to(pool.device))
    return ModelRunner(adapter, pool, tensors, cfg.max_num_seqs, cfg.cuda_graphs, cfg.kernel)
