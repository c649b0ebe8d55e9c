"""`redknot bench capacity`: how many long sessions one GPU serves at once, per head plan.

Real architectures with random bf16 weights. For each context length, sessions of that many
prompt tokens (documents drawn from one shared pool, so reuse methods also hit their chunks, and a
short question) all arrive at once and decode ``--decode-tokens`` tokens each through
``Engine.step()``. The pool is sized the way serving sizes it (``gpu_memory_utilization`` minus
weights, measured activations and the CUDA-graph reserve); admission, preemption and prefix/chunk
caching are the engine's own. Reported per (method, head plan, context): the most sessions
running at once, decode tok/s while at least 90% of that many decode together, TTFT p50/p99,
preemptions, errors, and beside them the analytic bound (pool pages / pages one session holds at
its full length under its plan).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import random
import statistics
import sys
import time

import torch

from ..models.config import ModelConfig
from .common import ARCHS, head_config, parse_names

METHODS = ("dense", "headsparse", "full_reuse", "redknot")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archs", default="mistral-7b", help=f"comma list of: {', '.join(sorted(ARCHS))}")
    p.add_argument("--contexts", default="32768", help="comma list of prompt lengths in tokens")
    p.add_argument("--methods", default="dense,redknot", help=f"comma list of: {', '.join(METHODS)}")
    p.add_argument("--head-configs", default="g15-w1024",
                   help="head plans of the head-aware methods: g15-w1024, g15-w4096, anchor")
    p.add_argument("--anchor-head-config", default=None)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--doc-tokens", type=int, default=1024, help="tokens per document")
    p.add_argument("--pool-docs", type=int, default=64, help="documents in the shared pool")
    p.add_argument("--oversubscribe", type=float, default=1.1,
                   help="sessions submitted = this x the analytic bound (so the pool, not the queue, is the limit)")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--plot", default=None, help="PNG: sessions and decode tok/s vs context")


def _sessions(n_sessions: int, context: int, args, vocab: int, rng: random.Random):
    """Prompt (question ids) and documents (id lists) of each session, from one shared pool."""
    lo, hi = 100, vocab - 100
    docs = [[rng.randrange(lo, hi) for _ in range(args.doc_tokens)] for _ in range(args.pool_docs)]
    per = max(1, min(args.pool_docs, (context - 32) // args.doc_tokens))
    out = []
    for i in range(n_sessions):
        question = [rng.randrange(lo, hi) for _ in range(max(1, context - per * args.doc_tokens))]
        out.append((question, rng.sample(docs, per)))
    return out


def run_case(llm, method: str, context: int, args, rng: random.Random) -> dict:
    from ..engine.sampling import SamplingParams

    engine = llm.engine
    engine.clear_caches()
    plan = "dense" if method in ("dense", "full_reuse") else "headsparse"
    total = context + args.decode_tokens
    per_session = engine.pool.peak_pages(total, 1, plan)
    bound = engine.pool.num_pages // per_session
    n = min(args.max_sessions, max(1, math.ceil(args.oversubscribe * bound)))
    engine.max_num_seqs = min(engine.cfg.max_num_seqs, n)
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    seqs = [llm.make_sequence(q, params, docs, method) for q, docs in _sessions(n, context, args, llm.config.vocab_size, rng)]
    preempt0 = engine.num_preemptions
    host0 = dict(engine.timings)
    t0 = time.perf_counter()
    for s in seqs:
        engine.add_request(s)
    steps = []  # (seconds, sequences decoding, tokens out, admitted or prefilled this step)
    peak = 0
    while engine.has_unfinished():
        waiting, misses = len(engine.waiting), engine.chunk_cache.misses
        ts = time.perf_counter()
        outs = engine.step()
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        dt = time.perf_counter() - ts
        running = len(engine.running)
        peak = max(peak, running)
        produced = sum(len(o.new_token_ids) for o in outs)
        prefilled = (len(engine.waiting) != waiting or engine.chunk_cache.misses != misses  # documents computed
                     or any(s.num_computed < s.num_prompt for s in engine.running))
        steps.append((dt, running, produced, prefilled))
    wall = time.perf_counter() - t0
    errors = [f"{type(s.error).__name__}: {str(s.error)[:160]}" for s in seqs if s.error is not None]
    ttft = [s.first_token_time - s.arrival for s in seqs if s.first_token_time is not None]
    steady = [(dt, tok) for dt, running, tok, pre in steps if not pre and running >= 0.9 * peak]
    decode_s = sum(dt for dt, _ in steady)
    engine.clear_caches()
    return {"method": method, "plan": plan, "context": context, "sessions_submitted": n,
            "sessions_peak": peak, "bound_sessions": bound, "of_bound": peak / bound if bound else float("nan"),
            "pages_per_session": per_session, "bytes_per_session": per_session * engine.pool.bytes_per_page,
            "decode_tok_s": sum(t for _, t in steady) / decode_s if decode_s else float("nan"),
            "decode_steps_measured": len(steady), "decode_step_ms": 1e3 * decode_s / len(steady) if steady else None,
            "host_s": {k: engine.timings[k] - host0[k] for k in ("schedule", "forward", "sample")},
            "ttft_p50_s": statistics.median(ttft) if ttft else float("nan"),
            "ttft_p99_s": sorted(ttft)[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))] if ttft else float("nan"),
            "preemptions": engine.num_preemptions - preempt0, "errors": errors, "wall_s": wall,
            "pool_idle_after": engine.pool.num_free_pages == engine.pool.num_pages}


def run(args) -> dict:
    from ..engine import LLM

    archs = parse_names(args.archs, ARCHS, "arch")
    methods = parse_names(args.methods, METHODS, "method")
    plans = [x for x in args.head_configs.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    if any(c < 64 for c in contexts) or args.decode_tokens < 1:
        raise ValueError("--contexts must be >= 64 tokens and --decode-tokens >= 1")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rng = random.Random(args.seed)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "capacity.json")
    result = {"benchmark": "capacity", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "argv": ["redknot", "bench", "capacity"] + sys.argv[3:],
              "args": {k: v for k, v in vars(args).items() if not callable(v)}, "rows": [], "pools": {}}
    for arch in archs:
        spec = dict(ARCHS[arch])
        spec["max_position_embeddings"] = max(spec["max_position_embeddings"], max(contexts) + args.decode_tokens)
        cfg = ModelConfig.from_dict(spec)
        # the dense rows on a pool without a head plan, the others per plan
        builds = [(None, [m for m in methods if m in ("dense", "full_reuse")])]
        builds += [(p, [m for m in methods if m in ("headsparse", "redknot")]) for p in plans]
        for plan_name, ms in builds:
            if not ms:
                continue
            head = head_config(plan_name, cfg, args.anchor_head_config) if plan_name else None
            t0 = time.perf_counter()
            llm = LLM(model=cfg, head_config=head, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else None,
                      page_size=args.page_size, gpu_memory_utilization=args.gpu_memory_utilization,
                      max_model_len=spec["max_position_embeddings"], max_num_seqs=args.max_sessions)
            key = f"{arch}/{plan_name or 'dense'}"
            result["pools"][key] = {**llm.engine.memory, "build_s": time.perf_counter() - t0}
            print(f"{key}: {llm.engine.memory['kv_pages']} pages, {llm.engine.memory['kv_bytes'] / 2**30:.1f} GiB "
                  f"of KV (built in {time.perf_counter() - t0:.1f} s)", flush=True)
            for context in contexts:
                for m in ms:
                    row = {"arch": arch, "head_config": plan_name, **run_case(llm, m, context, args, rng)}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    with open(out, "w") as f:
                        json.dump(result, f, indent=1)
            del llm
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print_table(result)
    if args.plot:
        plot(result, args.plot)
    return result


def print_table(result: dict) -> None:
    rows = result["rows"]
    print(f"\ncapacity on {result['device']}: sessions running at once vs the analytic bound, decode tok/s there")
    print(f"{'arch':<11} {'method':<11} {'plan':<10} {'ctx':>7} {'sessions':>8} {'bound':>6} {'of bound':>8} "
          f"{'x dense':>7} {'tok/s':>8} {'x dense':>7} {'TTFT p50':>8} {'p99':>7} {'preempt':>7} {'errors':>6}")
    dense = {(r["arch"], r["context"]): r for r in rows if r["method"] == "dense"}
    for r in rows:
        d = dense.get((r["arch"], r["context"]))
        xs = r["sessions_peak"] / d["sessions_peak"] if d and d["sessions_peak"] else float("nan")
        xt = r["decode_tok_s"] / d["decode_tok_s"] if d and d["decode_tok_s"] else float("nan")
        print(f"{r['arch']:<11} {r['method']:<11} {r['head_config'] or '-':<10} {r['context']:>7} "
              f"{r['sessions_peak']:>8} {r['bound_sessions']:>6} {r['of_bound']:>8.2f} {xs:>7.2f} "
              f"{r['decode_tok_s']:>8.0f} {xt:>7.2f} {r['ttft_p50_s']:>8.2f} {r['ttft_p99_s']:>7.2f} "
              f"{r['preemptions']:>7} {len(r['errors']):>6}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    series = {}
    for r in result["rows"]:
        series.setdefault((r["arch"], r["method"], r["head_config"]), []).append(r)
    for (arch, method, plan), rows in series.items():
        rows.sort(key=lambda r: r["context"])
        label = f"{arch} {method}" + (f" {plan}" if plan else "")
        xs = [r["context"] // 1024 for r in rows]
        a.plot(xs, [r["sessions_peak"] for r in rows], marker="o", label=label)
        a.plot(xs, [r["bound_sessions"] for r in rows], linestyle=":", color=a.lines[-1].get_color())
        b.plot(xs, [r["decode_tok_s"] for r in rows], marker="o", label=label)
    a.set(xlabel="context (K tokens)", ylabel="sessions running at once (dotted: bound)", xscale="log", yscale="log")
    b.set(xlabel="context (K tokens)", ylabel="decode tok/s at that concurrency", xscale="log", yscale="log")
    a.legend(fontsize=7)
    fig.suptitle(f"sessions per GPU ({result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench capacity", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
