"""Sizing the page pool from the device's memory (vLLM's rule)."""

from __future__ import annotations

import torch

# Default pool size when none is given: on a GPU, what is left of gpu_memory_utilization x the
# device's memory once weights, the activations of the largest step (measured) and the CUDA-graph
# reserve are counted; on the CPU this many bytes.
CPU_POOL_BYTES = 256 << 20
GRAPH_RESERVE_BYTES = 1 << 30


def profile_pages(engine) -> tuple[int, dict]:
    """Run the largest step once (random token ids: as many rows as a prefill step or a recovery
    forward holds, in prompts of at most max_model_len), measure its activation peak, and give the
    pages what is left of gpu_memory_utilization x the device's memory after the weights, everything
    else on the device, that peak and the CUDA-graph reserve. Returns (pages, memory report)."""
    cfg, dev, pool = engine.cfg, engine.device, engine.pool
    tokens = max(cfg.max_num_batched_tokens, cfg.recovery_rows)
    n_max = engine.max_model_len
    slots = pool.device_tables.shape[1] - 1  # the sequences the pool can hold at once
    lens = [n for n in [n_max] * (tokens // n_max) + [tokens % n_max] if n][:slots]
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    sids = []
    try:
        for n in lens:
            sid = engine.documents.next_pool_id()
            pool.add_sequence(sid, "dense")
            sids.append(sid)
            pool.ensure(sid, n)
        ids = [torch.randint(0, engine.config.vocab_size, (n,)).tolist() for n in lens]
        engine.runner.forward("dense", sids, ids, [0] * len(sids))
        torch.cuda.synchronize(dev)
    finally:
        for sid in sids:
            pool.free_sequence(sid)
    tokens = sum(lens)
    activations = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    pool_bytes = pool.num_pages * pool.bytes_per_page
    cached_free = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    others = total - free - cached_free - pool_bytes  # weights, buffers, context, other processes
    graphs = GRAPH_RESERVE_BYTES if engine.runner.cuda_graphs else 0
    linear = engine.documents.linear  # a hybrid's cached chunks' linear-layer entries, at most this many bytes
    linear_chunks = linear.max_bytes if linear is not None else 0
    budget = total * cfg.gpu_memory_utilization - others - activations - graphs - linear_chunks
    num_pages = int(budget // pool.bytes_per_page)
    if num_pages < pool.num_pages:
        raise RuntimeError(
            f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves {max(budget, 0) / 2**30:.2f} GiB "
            f"for KV pages after {others / 2**30:.2f} GiB in use and {activations / 2**30:.2f} GiB of "
            f"activations: not even one {tokens}-token step fits; raise it or lower max_num_batched_tokens "
            f"and max_recovery_rows")
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return num_pages, {"gpu_memory_utilization": cfg.gpu_memory_utilization, "total_bytes": total,
                       "weights_bytes": weights, "other_bytes": others - weights, "activation_bytes": activations,
                       "graph_reserve_bytes": graphs, "linear_chunk_bytes": linear_chunks, "kv_pages": num_pages,
                       "kv_bytes": num_pages * pool.bytes_per_page}


def initial_pages(cfg, num_layers: int, num_kv_heads: int, page_bytes: int, max_model_len: int,
                  device: torch.device) -> tuple[int, bool]:
    """(pages to build the pool with, whether to profile and resize it): a given count; on a GPU,
    a pool for one largest step, measured and then resized; on the CPU, CPU_POOL_BYTES."""
    if cfg.kv_pages is not None:
        return cfg.kv_pages, False
    if device.type == "cuda":
        rows = max(cfg.max_num_batched_tokens, cfg.recovery_rows)
        return num_layers * num_kv_heads * (-(-rows // cfg.page_size) + -(-rows // max_model_len)), True
    return max(int(CPU_POOL_BYTES // page_bytes), 1), False
