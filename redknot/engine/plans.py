"""The head plans the pool serves and the model runner over it.

Every method's KV lives under one of two plans: ``dense`` (every head global) and, with a head
config, ``headsparse`` (each head its class's visibility); the head selection may add twins of
them (``+sel``). The visibility each plan gives a head comes from ``HeadConfig.visibility``: the one
rule (``redknot.visibility``), and the model's own sliding-window layers.
"""

from __future__ import annotations

import torch

from ..cache import PagePool
from ..config import HeadConfig
from .model_runner import ModelRunner


def plan_visibility(config, head_config: HeadConfig | None) -> dict:
    """name -> (window, sink) int [L, Hkv] of the base plans."""
    L, hkv = config.num_hidden_layers, config.num_key_value_heads
    plans = {"dense": HeadConfig.all_global(L, hkv)}
    if head_config is not None:
        plans["headsparse"] = head_config
    return {name: plan.visibility(model_windows=config.sliding_windows) for name, plan in plans.items()}


def build_pool(config, head_config, num_pages: int, page_size: int, dtype, device, slots: int, max_len: int,
               plans: dict | None = None) -> PagePool:
    """A pool of ``num_pages`` pages under ``plans`` (default: the base plans) with device tables
    for ``slots`` sequences of up to ``max_len`` tokens."""
    plans = plans or plan_visibility(config, head_config)
    pool = PagePool(num_pages, page_size, config.head_dim, *plans["dense"], dtype=dtype, device=device)
    for name, (window, sink) in plans.items():
        if name != "default":
            pool.add_plan(name, window, sink)
    pool.attach_device_tables(slots, max_len)
    return pool


def build_runner(model, pool: PagePool, cfg) -> ModelRunner:
    """The model runner with every plan of the pool as device tensors."""
    tensors = {}
    for name in pool.plans:
        if name == "default":
            continue
        window, sink = pool.window_sink(name)
        tensors[name] = (torch.as_tensor(window, dtype=torch.int32).to(pool.device),
                         torch.as_tensor(sink, dtype=torch.int32).to(pool.device))
    return ModelRunner(model, pool, tensors, cfg.max_num_seqs, cfg.cuda_graphs, cfg.kernel)
