"""`redknot bench serve`: concurrent streaming clients against `redknot serve`, per method.

For each method a server starts in this process (random weights of a 7B architecture on the GPU,
or a checkpoint with --model), N clients send requests whose documents are drawn from a shared
pool (so chunks recur in different orders), and we record time to first token (first streamed
chunk), generated tokens per second over the run, and the tokens served from the chunk cache.
Prints a table and writes JSON; ratios compare methods within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

from .percentile import percentile as _pct

WORDS = ("amber river city founded merchant salt trade north harbour tower bridge market guild winter "
         "summer record ledger captain ship coast island valley mill stone road king queen council").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="mistral-7b", help="random-weight architecture (see bench ttft) or 'tiny'")
    p.add_argument("--model", default=None, help="HF checkpoint directory instead of random weights")
    p.add_argument("--methods", default="dense,redknot,redknot_paper,full_reuse")
    p.add_argument("--head-config", default="g15-w1024", help="JSON file or synthetic spec gRATIO-wWINDOW")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64, help="requests per method, spread over the clients")
    p.add_argument("--pool-docs", type=int, default=16, help="shared document pool")
    p.add_argument("--docs-per-request", type=int, default=8)
    p.add_argument("--doc-words", type=int, default=700, help="words per document (~1K tokens)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=None)
    p.add_argument("--capture-graphs", action="store_true",
                   help="capture every decode graph the run can need before the clients start")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="untimed rounds (one request per client, the timed workload's first ones) through "
                        "each method's server before its timed run, so that kernel compiles and decode-graph "
                        "captures for the run's batch shapes fall outside the measurement")
    p.add_argument("--no-async-decode", action="store_true",
                   help="the host reads each decode step's tokens before the next step is launched")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)


def _documents(n: int, words: int, rng: random.Random) -> list[str]:
    return [f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def _llm(args, dev):
    from ..config import HeadConfig
    from ..engine import LLM
    from ..models.config import ModelConfig
    from .common import ARCHS, head_config

    model = args.model or ModelConfig.from_dict(ARCHS[args.arch])  # random weights of the architecture
    cfg = ModelConfig.from_dir(model) if args.model else model
    head = None
    if args.head_config:
        head = (HeadConfig.from_json(args.head_config) if os.path.isfile(args.head_config)
                else head_config(args.head_config, cfg, None))
    return LLM(model=model, head_config=head, device=dev, kv_pages=args.kv_pages,
               async_decode=False if getattr(args, "no_async_decode", False) else None)


async def _client(client, model, jobs, results, max_tokens, method):
    """One client: its requests one after another, streamed (SSE over httpx), timed."""
    for question, docs in jobs:
        t0 = time.perf_counter()
        first, n_tok, cached, prompt = None, 0, 0, 0
        body = {"model": model, "prompt": question, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "documents": docs, "method": method, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and first is None:
                    first = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    n_tok, prompt = usage["completion_tokens"], usage["prompt_tokens"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        results.append({"ttft_s": first, "completion_tokens": n_tok, "prompt_tokens": prompt, "cached_tokens": cached,
                        "latency_s": time.perf_counter() - t0})
        if len(results) % 8 == 0:  # progress, so a stalled run shows where it stalled
            print(f"  {method}: {len(results)} requests done", flush=True)


async def _load(base, model, method, jobs_per_client, max_tokens):
    import httpx

    limits = httpx.Limits(max_connections=len(jobs_per_client) + 4)
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        outcome = await asyncio.gather(*[_client(client, model, jobs, results, max_tokens, method)
                                         for jobs in jobs_per_client], return_exceptions=True)
        wall = time.perf_counter() - t0
    errors = [f"{type(e).__name__}: {str(e)[:120]}" for e in outcome if isinstance(e, BaseException)]
    return results, wall, errors


def _serve_load(llm, args, method, per_client):
    """One OpenAI server on ``llm`` for the duration of one load; returns ``_load``'s results."""
    from ..engine.async_engine import AsyncLLMEngine
    from ..serve.background import BackgroundServer

    server = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=args.max_num_seqs), "bench")
    try:
        return asyncio.run(_load(server.base, "bench", method, per_client, args.max_tokens))
    finally:
        server.stop()


def run(args) -> dict:
    from ..engine.llm import METHODS
    from ..engine.sampling import SamplingParams
    from .common import ARCHS, parse_names

    methods = parse_names(args.methods, METHODS, "method")  # before a model is built: a typo fails at once
    if not args.model:
        parse_names(args.arch, ARCHS, "arch")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rng = random.Random(args.seed)
    pool = _documents(args.pool_docs, args.doc_words, rng)
    jobs = [(f"Question {i}: which documents mention the salt trade?", rng.sample(pool, args.docs_per_request))
            for i in range(args.requests)]
    per_client = [jobs[c::args.clients] for c in range(args.clients)]
    # the clients talk to 127.0.0.1: never through a proxy the environment may name
    for var in ("NO_PROXY", "no_proxy"):
        os.environ[var] = ",".join(filter(None, [os.environ.get(var), "127.0.0.1", "localhost"]))
    t0 = time.perf_counter()
    llm = _llm(args, dev)
    print(f"model and engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "serve.json")
    result = {"benchmark": "serve", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "argv": ["redknot", "bench", "serve"] + sys.argv[3:],
              "args": {k: v for k, v in vars(args).items() if not callable(v)}, "methods": {}}
    if args.capture_graphs:
        t0 = time.perf_counter()
        n_graphs = llm.engine.capture_graphs(args.max_tokens + args.docs_per_request * args.doc_words * 5 + 256)
        result["graphs_captured"], result["graph_capture_s"] = n_graphs, time.perf_counter() - t0
        print(f"captured {n_graphs} decode graphs in {result['graph_capture_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    for method in methods:  # kernels compile (and chunk paths run once) before anything is timed
        llm.generate("Which documents mention the salt trade?", warm, documents=rng.sample(pool, 2), method=method)
    print(f"warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    engine = llm.engine
    for method in methods:
        warm_errors = []
        if args.warmup_rounds > 0:
            t0 = time.perf_counter()
            _, _, warm_errors = _serve_load(llm, args, method, [jobs[:args.warmup_rounds] for jobs in per_client])
            print(f"{method}: {args.warmup_rounds} warm-up round(s) in {time.perf_counter() - t0:.1f} s", flush=True)
        engine.clear_caches()  # the timed run starts with no document cached, as a fresh server does
        preempted = engine.num_preemptions
        print(f"{method}: {args.requests} requests from {args.clients} clients", flush=True)
        results, wall, errors = _serve_load(llm, args, method, per_client)
        # with the prefix and chunk caches dropped every page is free again: no request kept any
        engine.clear_caches()
        pool_idle = not engine.has_unfinished() and engine.pool.num_free_pages == engine.pool.num_pages
        ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
        tokens = sum(r["completion_tokens"] for r in results)
        row = {"requests": len(results), "errors": errors, "warmup_errors": warm_errors, "wall_s": wall,
               "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99),
               "ttft_mean_s": statistics.mean(ttfts) if ttfts else float("nan"),
               "throughput_tok_s": tokens / wall, "requests_per_s": len(results) / wall,
               "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in results) if results else 0,
               "cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in results) if results else 0,
               "pool_idle_after": pool_idle, "preemptions": engine.num_preemptions - preempted}
        result["methods"][method] = row
        print(json.dumps({"method": method, **row}), flush=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        gc.collect()
    base = result["methods"].get("dense")
    print(f"\nserving on {result['device']}: {args.clients} clients, {args.requests} requests/method, "
          f"{args.docs_per_request} of {args.pool_docs} shared documents each")
    print(f"{'method':<13} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'tok/s':>9} {'req/s':>7} {'cached tok':>10} "
          f"{'p50 x dense':>11} {'errors':>6}")
    for m, r in result["methods"].items():
        ratio = base["ttft_p50_s"] / r["ttft_p50_s"] if base and r["ttft_p50_s"] else float("nan")
        print(f"{m:<13} {r['ttft_p50_s']:>10.3f} {r['ttft_p99_s']:>10.3f} {r['throughput_tok_s']:>9.1f} "
              f"{r['requests_per_s']:>7.2f} {r['cached_tokens_mean']:>10.0f} {ratio:>11.2f} {len(r['errors']):>6}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench serve", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
