"""``redknot bench tiers``: a sustained RAG stream over a document pool much larger than the GPU's
chunk cache, with and without tiers below it.

Queries of ``--docs-per-query`` documents drawn by a Zipf law (``--zipf``) from a pool of
``--docs`` documents, of which ``--new-share`` are first seen during the run (each enters near the
top of the popularity order, as fresh documents do). The GPU chunk cache holds ``--pool-share`` of
the pool. Each variant (``none``: the pool only; ``cpu``, ``cpu+disk``, ``disk``, ``redis``,
``cpu+redis``) serves the same stream through ``LLM.generate`` (one request at a time, the first
token only). Reported per variant: the chunk hit rate (pool or tier, over every document and
prompt-prefix lookup) over queries [W, 2W) and over the last W (no decay: the second is >= 0.9x
the first), the pool-only hit rate, TTFT p50 by where a query's slowest document came from
(``gpu``, ``cpu``, ``disk``, ``redis``, ``computed``), and whether the first tokens equal those of
the ``none`` variant (tiers return the same KV bytes).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

from .common import ARCHS

VARIANTS = ("none", "cpu", "disk", "cpu+disk", "redis", "cpu+redis")
SOURCES = ("gpu", "pending", "cpu", "disk", "redis", "computed")  # fastest first


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled testbed model)")
    p.add_argument("--arch", default=None, help=f"random weights of one of: {', '.join(sorted(ARCHS))} "
                                                f"(instead of --model; the GPU runs)")
    p.add_argument("--variants", default="none,cpu,cpu+disk", help=f"comma list of: {', '.join(VARIANTS)}")
    p.add_argument("--docs", type=int, default=1000, help="documents in the pool")
    p.add_argument("--new-share", type=float, default=0.3, help="share of documents first seen during the run")
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--docs-per-query", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=256)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of document popularity")
    p.add_argument("--pool-share", type=float, default=0.1, help="share of the pool's KV the GPU chunk cache holds")
    p.add_argument("--window", type=int, default=500, help="W: hit rates over queries [W, 2W) and the last W")
    p.add_argument("--cpu-bytes", type=int, default=None, help="CPU tier bytes (default: 1.2x the pool's KV)")
    p.add_argument("--disk-dir", default=None, help="disk tier directory (default: a fresh temporary one per run)")
    p.add_argument("--disk-bytes", type=int, default=None, help="disk tier bytes (default: 1.2x the pool's KV)")
    p.add_argument("--redis-url", default=None, help="Redis/Valkey for the redis variants (entries under a fresh "
                                                     "key prefix per run)")
    p.add_argument("--method", default="full_reuse")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results JSON (default: $OUT/tiers.json or ./tiers.json)")


def stream(args, vocab: int) -> tuple[list[list[int]], list[tuple[list[int], list[int]]]]:
    """(documents as token ids, queries as (question ids, document indices))."""
    rng = np.random.default_rng(args.seed)
    lo, hi = 100, vocab - 100
    docs = [rng.integers(lo, hi, args.doc_tokens).tolist() for _ in range(args.docs)]
    n_new = int(round(args.new_share * args.docs))
    order = list(rng.permutation(args.docs - n_new))  # popularity order of the documents seen so far
    arrivals = {int(q): args.docs - n_new + i
                for i, q in enumerate(np.linspace(0, args.queries, n_new, endpoint=False).astype(int))}
    queries = []
    for q in range(args.queries):
        if q in arrivals:  # a fresh document enters near the top
            order.insert(int(rng.integers(0, max(1, len(order) // 10))), arrivals[q])
        k = min(args.docs_per_query, len(order))
        w = 1.0 / np.arange(1, len(order) + 1) ** args.zipf
        picked = rng.choice(len(order), size=k, replace=False, p=w / w.sum())
        queries.append((rng.integers(lo, hi, args.question_tokens).tolist(), [int(order[i]) for i in picked]))
    return docs, queries


def offload(variant: str, args, pool_kv_bytes: int, tmp: str) -> dict | None:
    parts = set(variant.split("+"))
    if variant == "none":
        return None
    if not parts <= {"cpu", "disk", "redis"}:
        raise ValueError(f"unknown variant {variant!r}; available: {', '.join(VARIANTS)}")
    room = int(1.2 * pool_kv_bytes)
    out = {}
    if "cpu" in parts:
        out["cpu_bytes"] = args.cpu_bytes or room
    if "disk" in parts:
        out["disk_dir"] = args.disk_dir or os.path.join(tmp, f"disk-{variant}")
        out["disk_bytes"] = args.disk_bytes or room
    if "redis" in parts:
        if not args.redis_url:
            raise ValueError(f"variant {variant} needs --redis-url")
        out["redis_url"] = args.redis_url
    return out


def run_variant(llm, docs, queries, method: str) -> dict:
    from ..engine.sampling import SamplingParams

    cache = llm.chunk_cache
    params = SamplingParams(max_tokens=1, temperature=0)
    for _ in range(2):  # warm-up (first calls pay one-off costs), on documents of its own namespace
        llm.generate(queries[0][0], params, documents=[docs[i] for i in queries[0][1]], method=method,
                     cache_salt="warm-up")
    rows = []
    for question, picked in queries:
        before = (cache.hits, cache.misses, dict(cache.tier_hits))
        out = llm.generate(question, params, documents=[docs[i] for i in picked], method=method)[0]
        loads = {t: n - before[2].get(t, 0) for t, n in cache.tier_hits.items() if n - before[2].get(t, 0)}
        hits, misses = cache.hits - before[0], cache.misses - before[1]
        computed = misses - sum(loads.values())
        source = "computed" if computed else max(loads, key=SOURCES.index) if loads else "gpu"
        rows.append({"ttft_s": out.metrics["time_to_first_token"], "lookups": hits + misses, "pool_hits": hits,
                     "tier_hits": sum(loads.values()), "computed": computed, "source": source,
                     "token": out.outputs[0].token_ids[:1]})
    return {"queries": rows}


def summarize(rows: list[dict], window: int) -> dict:
    def rate(part, key):
        n = sum(r["lookups"] for r in part)
        return sum(sum(r[k] for k in key) for r in part) / n if n else float("nan")

    early = rows[window:2 * window]
    late = rows[-window:]
    out = {"hit_rate_early": rate(early, ("pool_hits", "tier_hits")),
           "hit_rate_late": rate(late, ("pool_hits", "tier_hits")),
           "pool_hit_rate_early": rate(early, ("pool_hits",)), "pool_hit_rate_late": rate(late, ("pool_hits",)),
           "ttft_p50_s": {}, "queries_by_source": {}}
    out["no_decay"] = out["hit_rate_late"] / out["hit_rate_early"] if out["hit_rate_early"] else float("nan")
    for s in SOURCES:
        t = [r["ttft_s"] for r in rows if r["source"] == s]
        if t:
            out["ttft_p50_s"][s] = float(np.median(t))
            out["queries_by_source"][s] = len(t)
    return out


def doc_kv_bytes(args, model, dev: torch.device) -> int:
    """Bytes of one document's KV in pool pages (every head, its pages and the first one it shares
    with the prompt prefix), from the model's config (16-bit on a GPU, float32 on the CPU)."""
    from ..models.config import ModelConfig
    from ..models.resolve import bundled_model_path, resolve_model
    if not isinstance(model, ModelConfig):
        model = ModelConfig.from_dir(resolve_model(model or bundled_model_path()))
    pages = model.num_hidden_layers * model.num_key_value_heads * (-(-args.doc_tokens // args.page_size) + 1)
    return pages * 2 * args.page_size * model.head_dim * (2 if dev.type == "cuda" else 4)


def run(args) -> dict:
    from ..engine import LLM
    from ..models.config import ModelConfig

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; available: {', '.join(VARIANTS)}")
    if args.queries < 2 * args.window:
        args.window = max(1, args.queries // 4)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = args.model
    if args.arch:
        if args.arch not in ARCHS:
            raise ValueError(f"unknown arch {args.arch!r}; available: {', '.join(sorted(ARCHS))}")
        model = ModelConfig.from_dict(dict(ARCHS[args.arch]))
    out_path = args.out or os.path.join(os.environ.get("OUT", "."), "tiers.json")
    result = {"benchmark": "tiers", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "argv": ["redknot", "bench", "tiers"] + sys.argv[3:],
              "args": {k: v for k, v in vars(args).items() if not callable(v)}, "variants": {}}
    docs = queries = None
    reference = None
    with tempfile.TemporaryDirectory(prefix="redknot-tiers-") as tmp:
        for variant in variants:
            torch.manual_seed(args.seed)  # random weights (--arch): the same model in every variant
            llm = LLM(model=model, device=dev, page_size=args.page_size,
                      dtype=torch.bfloat16 if dev.type == "cuda" and args.arch else None,
                      kv_offload=offload(variant, args, args.docs * doc_kv_bytes(args, model, dev), tmp))
            cfg = llm.config
            per_doc = cfg.num_hidden_layers * cfg.num_key_value_heads * (-(-args.doc_tokens // args.page_size) + 1)
            # the GPU chunk cache's cap, from this pool's own page size (ChunkCache reads it at every insert)
            llm.chunk_cache.max_pages = int(args.pool_share * args.docs * per_doc)
            if docs is None:
                docs, queries = stream(args, cfg.vocab_size)
            if llm.engine.kv_tiers is not None and llm.engine.kv_tiers.redis is not None:
                llm.engine.kv_tiers.redis.prefix = f"redknot-bench:{uuid.uuid4().hex}:"
            t0 = time.perf_counter()
            res = run_variant(llm, docs, queries, args.method)
            res["wall_s"] = time.perf_counter() - t0
            tokens = [r["token"] for r in res["queries"]]
            if reference is None:
                reference = tokens
            res["summary"] = summarize(res["queries"], args.window)
            res["summary"]["first_tokens_match_first_variant"] = tokens == reference
            res["summary"]["chunk_cache"] = {k: v for k, v in llm.chunk_cache.stats().items()}
            result["variants"][variant] = res
            print(f"{variant}: {json.dumps({k: v for k, v in res['summary'].items() if k != 'chunk_cache'})}",
                  flush=True)
            if llm.engine.kv_tiers is not None:
                llm.engine.kv_tiers.close()
            del llm
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    a = result["args"]
    print(f"\ntiers on {result['device']}: {a['queries']} queries x {a['docs_per_query']} of {a['docs']} documents "
          f"({a['doc_tokens']} tokens, Zipf {a['zipf']}, {a['new_share']:.0%} new during the run), GPU chunk cache "
          f"{a['pool_share']:.0%} of the pool; hit rates over queries [W, 2W) and the last W (W={a['window']})")
    print(f"{'variant':<10} {'hit early':>9} {'hit late':>9} {'late/early':>10} {'pool late':>9} {'same tokens':>11}  "
          f"TTFT p50 ms by source (queries)")
    for name, v in result["variants"].items():
        s = v["summary"]
        ttft = ", ".join(f"{k} {1000 * t:.1f} ({s['queries_by_source'][k]})" for k, t in s["ttft_p50_s"].items())
        print(f"{name:<10} {s['hit_rate_early']:>9.3f} {s['hit_rate_late']:>9.3f} {s['no_decay']:>10.3f} "
              f"{s['pool_hit_rate_late']:>9.3f} {str(s['first_tokens_match_first_variant']):>11}  {ttft}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench tiers", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
