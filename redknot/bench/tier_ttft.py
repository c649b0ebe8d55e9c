"""``redknot bench tier-ttft``: TTFT of one request of N documents by where its documents' KV
comes from: computed (cold), GPU-resident, each tier below the GPU, and a dense prefill.

Per variant (``cpu``, ``disk``, ``redis``: the only tier configured, so the one the documents load
from once the GPU chunk cache is emptied before each tier run), the median of ``--repeats`` runs
of ``--method`` (``full_reuse``) over the same documents (other questions), plus bytes loaded, the
share of the entries' bytes that is (the loader fetches only the heads the request's plan can see;
``--all-heads``: every head) and the effective load bandwidth, bytes / (TTFT_tier - TTFT_gpu). The dense row prefills the same tokens as one
prompt, caches emptied first.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import uuid

import numpy as np
import torch

from .common import ARCHS

VARIANTS = ("cpu", "disk", "redis")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled testbed model)")
    p.add_argument("--arch", default=None, help=f"random weights of one of: {', '.join(sorted(ARCHS))}")
    p.add_argument("--variants", default="cpu,disk", help=f"comma list of: {', '.join(VARIANTS)}")
    p.add_argument("--docs", type=int, default=32, help="documents in the request")
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--disk-dir", default=None, help="disk tier directory (default: a temporary one)")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loads", choices=("async", "sync"), default="async",
                   help="async: the request waits while a loader thread reads its documents (the default); "
                        "sync: loaded in its admission")
    p.add_argument("--all-heads", action="store_true",
                   help="fetch every head of an entry (default: only those the request's plan can see)")
    p.add_argument("--method", default="full_reuse", help="the reuse method of the timed requests")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results JSON (default: $OUT/tier_ttft.json or ./tier_ttft.json)")


def _ttft(llm, question, docs, method: str) -> float:
    from ..engine.sampling import SamplingParams

    out = llm.generate(question, SamplingParams(max_tokens=1, temperature=0), documents=docs, method=method)[0]
    return out.metrics["time_to_first_token"]


def _whole_bytes(llm) -> int:
    """Payload bytes of every entry the asynchronous loader has loaded so far, all heads counted."""
    loader = llm.chunk_cache.stats().get("tiers", {}).get("loader") or {}
    return loader.get("bytes_whole", 0)


def run(args) -> dict:
    from ..engine import LLM
    from ..models.config import ModelConfig

    variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; available: {', '.join(VARIANTS)}")
    if "redis" in variants and not args.redis_url:
        raise ValueError("variant redis needs --redis-url")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = ModelConfig.from_dict(dict(ARCHS[args.arch])) if args.arch else args.model
    dtype = torch.bfloat16 if dev.type == "cuda" and args.arch else None
    out_path = args.out or os.path.join(os.environ.get("OUT", "."), "tier_ttft.json")
    result = {"benchmark": "tier_ttft", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "argv": ["redknot", "bench", "tier-ttft"] + sys.argv[3:],
              "args": {k: v for k, v in vars(args).items() if not callable(v)}, "rows": []}
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="redknot-tier-ttft-") as tmp:
        for variant in variants:
            kv = {"write_behind": False, "async_loads": args.loads == "async", "per_head_fetch": not args.all_heads}
            if variant == "cpu":
                kv["cpu_bytes"] = 1 << 40  # bounded by what the request holds
            elif variant == "disk":
                kv.update(disk_dir=args.disk_dir or os.path.join(tmp, "disk"), disk_bytes=1 << 42)
            else:
                kv["redis_url"] = args.redis_url
            torch.manual_seed(args.seed)  # random weights (--arch): the same model in every variant
            llm = LLM(model=model, device=dev, dtype=dtype, page_size=args.page_size, kv_offload=kv)
            if variant == "redis":
                llm.engine.kv_tiers.redis.prefix = f"redknot-bench:{uuid.uuid4().hex}:"
            vocab = llm.config.vocab_size
            docs = [rng.integers(100, vocab - 100, args.doc_tokens).tolist() for _ in range(args.docs)]

            def question():
                return rng.integers(100, vocab - 100, args.question_tokens).tolist()

            for _ in range(2):  # warm-up: kernels, allocator, graphs, on documents of their own
                _ttft(llm, question(), [rng.integers(100, vocab - 100, args.doc_tokens).tolist()], args.method)
            llm.engine.clear_caches()
            cold = _ttft(llm, question(), docs, args.method)  # computes every document (and writes them down)
            gpu, tier, dense, loaded, whole = [], [], [], [], []
            tiers = llm.chunk_cache.tiers
            for _ in range(args.repeats):
                gpu.append(_ttft(llm, question(), docs, args.method))
                llm.chunk_cache.evict(llm.pool.num_pages)
                read, entries = tiers.info()[variant]["bytes_read"], _whole_bytes(llm)
                tier.append(_ttft(llm, question(), docs, args.method))
                loaded.append(tiers.info()[variant]["bytes_read"] - read)
                whole.append(_whole_bytes(llm) - entries)
            for _ in range(args.repeats):
                llm.engine.clear_caches()
                dense.append(_ttft(llm, question() + [t for d in docs for t in d], None, "dense"))
            row = {"variant": variant, "ttft_cold_s": cold, "ttft_gpu_s": float(np.median(gpu)),
                   "ttft_tier_s": float(np.median(tier)), "ttft_dense_s": float(np.median(dense)),
                   "bytes_loaded": int(np.median(loaded)), "tier_hits": dict(llm.chunk_cache.tier_hits),
                   "loads": args.loads, "per_head_fetch": not args.all_heads}
            # what the same entries hold for every head (async loads count it; sync ones load every head)
            row["bytes_whole"] = int(np.median(whole)) if args.loads == "async" else row["bytes_loaded"]
            row["fetched_over_whole"] = row["bytes_loaded"] / row["bytes_whole"] if row["bytes_whole"] else None
            row["served_from_tier"] = bool(row["bytes_loaded"]) and variant in row["tier_hits"]
            if not row["served_from_tier"]:  # e.g. a dead Redis: the tier row is a recompute
                print(f"warning: the {variant} tier served nothing (see its counters: "
                      f"{json.dumps(tiers.info().get(variant))})", flush=True)
            extra = row["ttft_tier_s"] - row["ttft_gpu_s"]
            row["tier_over_gpu"] = row["ttft_tier_s"] / row["ttft_gpu_s"]
            row["dense_over_tier"] = row["ttft_dense_s"] / row["ttft_tier_s"]
            row["load_gb_s"] = row["bytes_loaded"] / extra / 1e9 if extra > 0 else float("inf")
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            tiers.close()
            del llm, tiers
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)
    print(f"\none request of {args.docs} x {args.doc_tokens}-token documents on {result['device']} (median of "
          f"{args.repeats}): TTFT in ms")
    print(f"{'from':<7} {'cold':>8} {'GPU':>8} {'tier':>8} {'dense':>8} {'tier/GPU':>8} {'dense/tier':>10} "
          f"{'MB loaded':>9} {'of whole':>8} {'GB/s':>6}")  # GB/s: bytes loaded / (tier - GPU TTFT)
    for r in result["rows"]:
        print(f"{r['variant']:<7} {1000 * r['ttft_cold_s']:>8.1f} {1000 * r['ttft_gpu_s']:>8.1f} "
              f"{1000 * r['ttft_tier_s']:>8.1f} {1000 * r['ttft_dense_s']:>8.1f} {r['tier_over_gpu']:>8.2f} "
              f"{r['dense_over_tier']:>10.2f} {r['bytes_loaded'] / 1e6:>9.1f} "
              f"{r['fetched_over_whole'] if r['fetched_over_whole'] is not None else float('nan'):>8.2f} "
              f"{r['load_gb_s']:>6.1f}"
              + ("" if r["served_from_tier"] else "  (not served from the tier)"))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench tier-ttft", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
