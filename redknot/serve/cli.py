"""``redknot serve``: the OpenAI-compatible server (uvicorn) over one model."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled testbed model)")
    p.add_argument("--head-config", default=None, help="head config JSON (needed by headsparse and redknot*)")
    p.add_argument("--method", default="auto",
                   help="default method of requests that name none (auto: redknot_kv with a head config, "
                        "else cacheblend: documents are reused out of the box)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="SegPaged pool pages (default: sized from --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, activations and KV pages together (vLLM's flag)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per SegPaged page")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model, or redknot-testbed)")
    p.add_argument("--cuda-graph-max-len", type=int, default=0,
                   help="capture decode CUDA graphs for contexts up to this many tokens at start-up "
                        "(default 0: each one is captured when first met)")
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine import LLM
    from ..engine.async_engine import AsyncLLMEngine
    from .app import build_app

    llm = LLM(model=args.model, head_config=args.head_config, device=args.device,
              dtype=args.dtype, kv_pages=args.kv_pages, page_size=args.page_size,
              gpu_memory_utilization=args.gpu_memory_utilization)
    set_default_method(llm, args.method)
    print(f"default method: {llm.method}; prefix caching on", flush=True)
    print(capacity_summary(llm.engine), flush=True)
    if args.cuda_graph_max_len > 0:
        n = llm.engine.capture_graphs(args.cuda_graph_max_len)
        print(f"captured {n} decode CUDA graphs (contexts up to {args.cuda_graph_max_len} tokens)", flush=True)
    engine = AsyncLLMEngine(llm, max_num_seqs=args.max_num_seqs)
    app = build_app(engine, args.served_model_name or (args.model or "redknot-testbed"))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0


def capacity_summary(engine) -> str:
    """What the pool holds, said at start-up: pages, bytes, and sessions of 8K/32K/128K per head plan."""
    mem = engine.memory
    lines = [f"KV pool: {mem['kv_pages']} pages of {engine.pool.bytes_per_page} B = {mem['kv_bytes'] / 2**30:.2f} GiB"]
    if "weights_bytes" in mem:
        lines[0] += (f" (of {mem['total_bytes'] / 2**30:.1f} GiB x {mem['gpu_memory_utilization']}: weights "
                     f"{mem['weights_bytes'] / 2**30:.2f}, activations {mem['activation_bytes'] / 2**30:.2f}, "
                     f"graphs {mem['graph_reserve_bytes'] / 2**30:.2f}, other {mem['other_bytes'] / 2**30:.2f} GiB)")
    for plan, per in engine.capacity().items():
        fits = ", ".join(f"{n // 1024}K: {v['sessions']}" for n, v in per.items())
        lines.append(f"  sessions that fit under the {plan} plan: {fits or 'none (max_model_len)'}")
    return "\n".join(lines)


def default_method(llm) -> str:
    """The best-quality reuse method the model can run (docs/results/quality.md): redknot_kv
    needs a head config; without one, cacheblend is the strongest head-agnostic reuse."""
    return "redknot_kv" if llm.head_config is not None else "cacheblend"


def set_default_method(llm, method: str = "auto") -> str:
    """The method requests that name none get (``auto``: ``default_method``)."""
    llm.method = llm.check_method(default_method(llm) if method == "auto" else method)
    return llm.method


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
