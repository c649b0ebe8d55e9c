"""`redknot bench ttft`: time to first token of every method, through the engine users run (GPU, random weights).

Real architectures (Mistral-7B, Qwen3-8B shapes) with random bf16 weights: timings do not depend
on weight values. A prompt is a 16-token prefix, n documents of L tokens and a 64-token question.
Each method's TTFT is ``LLM.generate(max_tokens=1)`` with its documents warm and in another order
than they were first computed in (a cold call first computes and caches them: ``cold_s``); every
timed call uses a different order, so no prefix cache covers a whole prompt. A step prefills the
whole prompt (``--max-num-batched-tokens``, default the longest prompt). Two peers run in the same
process: ``forward``, one unchunked forward of the prompt through the same model runner (the
engine's floor), and ``hf_dense``, HF transformers. Executed FLOPs are what each method ran.
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

from ..config import SparseFFNConfig
from ..models.config import ModelConfig
from ..reuse.prompt import ChunkedPrompt
from .common import ARCHS, head_config, hf_model, parse_names, sync

LAYOUTS = {"8x1k": (8, 1024), "8x4k": (8, 4096), "16x4k": (16, 4096), "32x4k": (32, 4096), "4x64": (4, 64)}
METHODS = ("hf_dense", "forward", "dense", "headsparse", "full_reuse", "epic", "cacheblend", "redknot_paper",
           "redknot")
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
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's token budget per step (default: the longest prompt, one step per prefill)")
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


def _prompt(n_docs: int, doc_len: int, vocab: int, seed: int) -> tuple[list[int], list[list[int]], list[int]]:
    """(prefix ids, document ids, question ids)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(10, vocab, (n,), generator=g).tolist()

    return ids(PREFIX_TOKENS), [ids(doc_len) for _ in range(n_docs)], ids(SUFFIX_TOKENS)


def _engine_llm(cfg, head, sparse, dev, dtype, tokens: int):
    from ..engine import LLM

    return LLM(model=cfg, head_config=head, sparse_ffn=sparse, device=dev, dtype=dtype,
               max_num_batched_tokens=tokens, max_recovery_rows=tokens, max_num_seqs=8)


def _time_method(llm, method: str, prompt, dev, reps: int, row: dict):
    """Cold call (documents computed), then ``reps`` timed calls, each with the documents in
    another order. Returns the call the profiler reruns."""
    from ..engine import SamplingParams

    prefix, docs, question = prompt
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    orders = [docs[k % len(docs):] + docs[:k % len(docs)] for k in range(1, reps + 3)]

    def call(order):
        return llm.generate(ChunkedPrompt(tuple(prefix), tuple(map(tuple, order)), tuple(question)), params,
                            method=method)[0]

    t0 = time.perf_counter()
    call(docs)
    sync(dev)
    row["cold_s"] = time.perf_counter() - t0
    ts, out = [], None
    for order in orders[:reps]:
        sync(dev)
        t0 = time.perf_counter()
        out = call(order)
        sync(dev)
        ts.append(time.perf_counter() - t0)
    row["ttft_s"] = statistics.median(ts)
    row["flops"] = out.metrics["flops"]
    row["cached_tokens"] = out.metrics["cached_tokens"]
    spare = orders[reps]
    return lambda: call(spare)


def _time_forward(llm, prompt, dev, reps: int, row: dict):
    """One unchunked forward of the whole prompt through the engine's model runner (a pool
    sequence of its own, freed after each call): what a step cannot go below."""
    prefix, docs, question = prompt
    ids = prefix + [t for d in docs for t in d] + question
    pool, runner = llm.engine.pool, llm.engine.runner

    def call():
        sid = llm.engine.documents.next_pool_id()
        pool.add_sequence(sid, "dense")
        try:
            pool.ensure(sid, len(ids))
            runner.forward("dense", [sid], [ids], [0])
        finally:
            pool.free_sequence(sid)
    row["ttft_s"] = _timed(call, dev, reps)
    return call


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
    longest = max(LAYOUTS[x][0] * LAYOUTS[x][1] for x in layouts) + PREFIX_TOKENS + SUFFIX_TOKENS
    tokens = args.max_num_batched_tokens or longest
    result["max_num_batched_tokens"] = tokens
    for arch_name in arch_names:
        arch = ARCHS[arch_name]
        cfg = ModelConfig.from_dict(arch)
        if "hf_dense" in methods:  # first and alone: a 20B model and its baseline need not fit one card together
            hf = hf_model(arch, dev, dtype)
            for layout in layouts:
                _run_layout(result, None, hf, arch_name, head_names[0], layout, ["hf_dense"], head_names, args, dev,
                            deadline, out)
            del hf
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        ours = [m for m in methods if m != "hf_dense"]
        for hc_name in head_names:
            if hc_name == "anchor" and arch_name != "mistral-7b":
                continue
            torch.manual_seed(0)  # the same random weights under every head config
            llm = _engine_llm(cfg, head_config(hc_name, cfg, args.anchor_head_config), sparse, dev, dtype, tokens)
            for layout in layouts:
                _run_layout(result, llm, None, arch_name, hc_name, layout, ours, head_names, args, dev, deadline, out)
            del llm
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    if args.plot:
        plot(result, args.plot)
    return result


def _run_layout(result, llm, hf, arch_name, hc_name, layout, methods, head_names, args, dev, deadline, out):
    n_docs, doc_len = LAYOUTS[layout]
    vocab = (llm if llm is not None else hf).config.vocab_size
    prompt = _prompt(n_docs, doc_len, vocab, seed=n_docs * doc_len)
    n = PREFIX_TOKENS + n_docs * doc_len + SUFFIX_TOKENS
    rows = []
    for m in methods:
        if m in ("hf_dense", "forward") and hc_name != head_names[0]:
            continue  # the head config does not change them: once per layout
        if time.perf_counter() > deadline:
            result.setdefault("skipped", []).append(f"{arch_name}/{hc_name}/{layout}/{m}: time budget")
            continue
        row = {"arch": arch_name, "head_config": hc_name, "layout": layout, "tokens": n, "method": m}
        reps = args.repeats if n <= 40000 else 1
        try:
            if m == "hf_dense":
                ids = torch.tensor([prompt[0] + [t for d in prompt[1] for t in d] + prompt[2]], device=dev)

                def call():
                    with torch.inference_mode():
                        hf(ids, logits_to_keep=1, use_cache=True)
                row["ttft_s"] = _timed(call, dev, reps)
            elif m == "forward":
                call = _time_forward(llm, prompt, dev, reps, row)
            else:
                call = _time_method(llm, m, prompt, dev, reps, row)
            if args.profile:
                _profile_row(row, call, dev, args.profile)
        except Exception as e:  # OOM or a baseline failing must not end the run
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        result["rows"].append(row)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    layout_rows = [r for r in result["rows"] if (r["arch"], r["layout"]) == (arch_name, layout)
                   and r["head_config"] in (hc_name, head_names[0])]
    baseline = [r for r in layout_rows if r["method"] == "hf_dense" and r not in rows]  # timed before the engine
    _ratios(layout_rows, rows + (baseline if hc_name == head_names[0] else []))


def _ratios(layout_rows: list[dict], rows: list[dict]) -> None:
    """Each row's speedup against the engine's dense and the FLOPs it saved; dense against its floor."""
    dense = next((r for r in layout_rows if r["method"] == "dense" and "ttft_s" in r), None)
    floor = next((r for r in layout_rows if r["method"] == "forward" and "ttft_s" in r), None)
    if dense is None:
        return
    for row in rows:
        if "ttft_s" not in row:
            continue
        row["speedup_vs_dense"] = dense["ttft_s"] / row["ttft_s"]
        if "flops" in row and row["flops"]:
            row["flop_reduction"] = dense["flops"]["total"] / row["flops"]["total"]
            row["speedup_over_flop_reduction"] = row["speedup_vs_dense"] / row["flop_reduction"]
    if floor is not None:
        dense["over_forward"] = dense["ttft_s"] / floor["ttft_s"]


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
