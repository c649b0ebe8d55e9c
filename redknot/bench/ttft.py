"""`redknot bench ttft`: time to first token of every method on RAG layouts (GPU, random weights).

Real architectures (Mistral-7B, Qwen3-8B shapes) with random bf16 weights: timings do not depend
on weight values. A prompt is a 16-token prefix, n documents of L tokens and a 64-token question.
Chunks are pre-cached (their one-off cost is reported as `offline_s`); TTFT is the median of
warm prefills, synchronised, in one run with dense and HF transformers dense, so ratios compare
like with like. Executed FLOPs come from what each method ran (redknot.reuse.flops).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import statistics
import sys
import time

import torch

from ..cache import ChunkStore
from ..config import SparseFFNConfig
from ..models.config import ModelConfig
from ..models.loader import build_model
from ..reuse.methods import ReuseEngine
from ..reuse.prompt import ChunkedPrompt
from .common import ARCHS, head_config, hf_model, parse_names, sync

LAYOUTS = {"8x1k": (8, 1024), "8x4k": (8, 4096), "16x4k": (16, 4096), "32x4k": (32, 4096), "4x64": (4, 64)}
METHODS = ("hf_dense", "dense", "headsparse", "full_reuse", "epic", "cacheblend", "redknot", "redknot_kv")
PREFIX_TOKENS, SUFFIX_TOKENS = 16, 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archs", default="mistral-7b,qwen3-8b")
    p.add_argument("--layouts", default="8x1k,8x4k,16x4k,32x4k")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--head-configs", default="g15-w1024",
                   help="comma list of: anchor (needs --anchor-head-config), g15-w1024, g15-w4096")
    p.add_argument("--anchor-head-config", default=None, help="upstream head config JSON (Mistral-7B)")
    p.add_argument("--sparse-ffn", default=None, help="upstream sparse FFN JSON (default: built-in tiers)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-budget-s", type=float, default=500)
    p.add_argument("--device", default=None)
    p.add_argument("--plot", default=None, help="PNG: TTFT against context length per method")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also run each timed call once under torch.profiler: per-phase times in the JSON rows, "
                        "torch's op table per row in DIR")
    p.add_argument("--out", default=None)


def _timed(fn, dev, repeats):
    fn()  # warm: compiles, caches chunks
    sync(dev)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _profile_row(row: dict, call, dev, folder: str) -> None:
    """The row's timed call once more under torch.profiler: phase times into the row, torch's op
    table into FOLDER."""
    from .trace import format_summary, profile_call

    summary, table = profile_call(call, dev)
    row["profile"] = summary
    os.makedirs(folder, exist_ok=True)
    name = "_".join(str(row[k]) for k in ("arch", "head_config", "layout", "method"))
    with open(os.path.join(folder, f"{name}.txt"), "w") as f:
        f.write(f"{name}: {row['tokens']} tokens\n{format_summary(summary)}\n\n{table}\n")
    print(f"{name}: {format_summary(summary)}", flush=True)


def _prompt(n_docs: int, doc_len: int, vocab: int, seed: int) -> ChunkedPrompt:
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return tuple(torch.randint(10, vocab, (n,), generator=g).tolist())

    return ChunkedPrompt(ids(PREFIX_TOKENS), tuple(ids(doc_len) for _ in range(n_docs)), ids(SUFFIX_TOKENS))


def run(args) -> dict:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sparse = SparseFFNConfig.from_json(args.sparse_ffn) if args.sparse_ffn else SparseFFNConfig()
    methods = parse_names(args.methods, METHODS, "method")
    arch_names, layouts = parse_names(args.archs, ARCHS, "arch"), parse_names(args.layouts, LAYOUTS, "layout")
    head_names = [h for h in args.head_configs.split(",") if h]
    bad = [h for h in head_names if h != "anchor" and not re.fullmatch(r"g\d+-w\d+", h)]
    if bad or not head_names:
        raise ValueError(f"head config(s) {bad}: each is 'anchor' or gPERCENT-wWINDOW (e.g. g15-w1024)")
    out = args.out or os.path.join(os.environ.get("OUT", "."), "ttft.json")
    deadline = time.perf_counter() + args.time_budget_s
    result = {"benchmark": "ttft", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "argv": ["redknot", "bench", "ttft"] + sys.argv[3:],
              "sparse_ffn": vars(sparse), "rows": []}
    for arch_name in arch_names:
        arch = ARCHS[arch_name]
        cfg = ModelConfig.from_dict(arch)
        torch.manual_seed(0)
        model = build_model(cfg, dtype, dev)
        hf = hf_model(arch, dev, dtype) if "hf_dense" in methods else None
        for hc_name in head_names:
            if hc_name == "anchor" and arch_name != "mistral-7b":
                continue
            head = head_config(hc_name, cfg, args.anchor_head_config)
            store = ChunkStore(f"bench-{arch_name}", 100 << 30, 0, dev)
            engine = ReuseEngine(model, cfg, f"bench-{arch_name}", head, sparse, store,
                                 ChunkStore(f"bench-{arch_name}", 1 << 30, 0, dev), dev)
            for layout in layouts:
                n_docs, doc_len = LAYOUTS[layout]
                prompt = _prompt(n_docs, doc_len, cfg.vocab_size, seed=n_docs * doc_len)
                n = len(prompt)
                dense_row = None
                for m in methods:
                    if m == "hf_dense" and hc_name != head_names[0]:
                        continue  # head config does not affect HF: once per layout
                    if time.perf_counter() > deadline:
                        result.setdefault("skipped", []).append(f"{arch_name}/{hc_name}/{layout}/{m}: time budget")
                        continue
                    row = {"arch": arch_name, "head_config": hc_name, "layout": layout, "tokens": n, "method": m}
                    reps = args.repeats if n <= 40000 else 1
                    try:
                        if m == "hf_dense":
                            ids = torch.tensor([prompt.token_ids], device=dev)

                            def call():
                                with torch.inference_mode():
                                    hf(ids, logits_to_keep=1, use_cache=True)
                            row["ttft_s"] = _timed(call, dev, reps)
                        else:
                            t0 = time.perf_counter()
                            engine.prefill(prompt, m)  # cold: computes and caches the chunks
                            sync(dev)
                            row["cold_s"] = time.perf_counter() - t0
                            res = {}

                            def call():
                                res.update(r=engine.prefill(prompt, m))
                            row["ttft_s"] = _timed(call, dev, reps)
                            r = res["r"]
                            row["flops"] = r.recovered.flops.totals()
                            row["tokens_computed_layer0"] = r.recovered.flops.tokens[0]
                            row["cached_tokens"] = r.cached_tokens
                            res.clear()  # the result's buffers go; `call` stays for --profile
                            del r
                        if args.profile:
                            _profile_row(row, call, dev, args.profile)
                    except Exception as e:  # OOM or a baseline failing must not end the run
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    if m == "dense" and "ttft_s" in row:
                        dense_row = row
                    result["rows"].append(row)
                    gc.collect()
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                    print(json.dumps(row), flush=True)
                    with open(out, "w") as f:
                        json.dump(result, f, indent=1)
                if dense_row:
                    for row in result["rows"]:
                        if (row["arch"], row["head_config"], row["layout"]) == (arch_name, hc_name, layout) \
                                and "ttft_s" in row:
                            row["speedup_vs_dense"] = dense_row["ttft_s"] / row["ttft_s"]
                            if "flops" in row:
                                row["flop_reduction"] = dense_row["flops"]["total"] / row["flops"]["total"]
                                row["speedup_over_flop_reduction"] = row["speedup_vs_dense"] / row["flop_reduction"]
            del engine, store
        del model, hf
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    if args.plot:
        plot(result, args.plot)
    return result


def print_table(result: dict) -> None:
    print(f"\nTTFT on {result['device']} | torch {result['torch']} | median seconds, chunks pre-cached")
    print(f"{'arch':<11} {'heads':<10} {'layout':<6} {'tokens':>7} {'method':<11} {'TTFT s':>8} {'x dense':>8} "
          f"{'TFLOP':>8} {'FLOP red':>8} {'x/red':>6}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['arch']:<11} {r['head_config']:<10} {r['layout']:<6} {r['tokens']:>7} {r['method']:<11} "
                  f"error: {r['error'][:60]}")
            continue
        fl = r.get("flops", {}).get("total")
        print(f"{r['arch']:<11} {r['head_config']:<10} {r['layout']:<6} {r['tokens']:>7} {r['method']:<11} "
              f"{r['ttft_s']:>8.3f} {r.get('speedup_vs_dense', float('nan')):>8.2f} "
              f"{(fl or float('nan')) / 1e12:>8.1f} {r.get('flop_reduction', float('nan')):>8.2f} "
              f"{r.get('speedup_over_flop_reduction', float('nan')):>6.2f}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["arch"], r["head_config"]) for r in result["rows"]})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (arch, hc) in zip(axes[0], groups):
        rows = [r for r in result["rows"] if (r["arch"], r["head_config"]) == (arch, hc) and "ttft_s" in r]
        for m in sorted({r["method"] for r in rows}):
            pts = sorted((r["tokens"], r["ttft_s"]) for r in rows if r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)", title=f"{arch}, heads {hc}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench ttft", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
