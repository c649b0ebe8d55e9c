"""``redknot profile``: classify every (layer, KV head) of a checkpoint and write the head plan."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import DEFAULT_SINK


def _none_or_float(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else float(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory, .gguf or shelf name (default: the bundled testbed model)")
    p.add_argument("--out", required=True, help="head config JSON to write (upstream schema)")
    p.add_argument("--plot", default=None, help="PNG heat map of classes and windows")
    p.add_argument("--target-global", type=float, default=0.15,
                   help="share of the profiled heads made global: round(target x heads outside the dense prefix)")
    p.add_argument("--calib", default=None,
                   help="calibration records (.jsonl/.json) or plain text (documents split by blank lines); "
                        "default: built-in fictional multi-document records")
    p.add_argument("--samples", type=int, default=16, help="calibration records used")
    p.add_argument("--coverage", type=float, default=0.95, help="attention mass a local head's window must cover")
    p.add_argument("--page-size", type=int, default=64, help="windows are rounded up to whole pages")
    p.add_argument("--dense-prefix-layers", type=int, default=0, help="first K layers forced dense")
    p.add_argument("--sink", type=int, default=DEFAULT_SINK, help="sink tokens of every limited head")
    p.add_argument("--ref-window", type=int, default=256, help="reference window of the edge mass")
    p.add_argument("--retrieval-threshold", type=_none_or_float, default=0.25,
                   help="retrieval score making a non-global head a retrieval head ('none': never)")
    p.add_argument("--min-global-edge", type=_none_or_float, default=0.02,
                   help="heads with less edge mass are never global, even below the target ('none': off)")
    p.add_argument("--force-global-edge", type=_none_or_float, default=None,
                   help="heads with at least this edge mass are global, even above the target")
    p.add_argument("--question-weight", type=float, default=0.5,
                   help="weight in the global-head score of the edge mass of the question's own queries (the rest: "
                        "prefix sensitivity and edge mass of all queries)")
    p.add_argument("--ablation-weight", type=float, default=0.0,
                   help="weight of the measured effect of making each head local on the answer's first token "
                        "(KL at the prompt's last position; one forward per head and sample; 1.0: that alone)")
    p.add_argument("--max-tokens", type=int, default=4096, help="calibration prompts are cut to this length")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--reselect", default=None, metavar="PROFILED_JSON",
                   help="no model: choose the classes again at --target-global from the metrics a profiled "
                        "plan stores, and print the share of heads that can be local at each window")


def run(args) -> int:
    from transformers import AutoTokenizer

    from ..models import load_model
    from .calib import builtin_records, load_calibration
    from .plot import plot_heads
    from .profiler import profile_heads

    if args.reselect:
        from ..config import HeadConfig
        from .profiler import local_share, reselect

        plan = reselect(HeadConfig.from_json(args.reselect), args.target_global)
        plan.to_json(args.out)
        c = plan.class_counts()
        print(f"wrote {args.out}: {c['global']} global, {c['local']} local, {c['retrieval']} retrieval, "
              f"{c['dense']} dense of {c['total']} heads (reselected from {args.reselect})")
        print("heads that can be local (coverage window <= W): " +
              ", ".join(f"W={w}: {s:.0%}" for w, s in local_share(plan).items()))
        if args.plot:
            plot_heads(plan, args.plot)
            print(f"wrote {args.plot}")
        return 0
    if args.samples < 1:
        raise ValueError(f"--samples={args.samples} must be >= 1")
    # Read the calibration before the (slow) model load, so a bad file fails fast.
    records = load_calibration(args.calib, args.samples) if args.calib else builtin_records(args.samples)
    if args.model is None:
        from ..models.resolve import bundled_model_path

        args.model = bundled_model_path()
    from ..models import resolve_model

    args.model = resolve_model(args.model)  # an HF directory, a .gguf or a fetched shelf name (smollm2, ...)
    model, cfg = load_model(args.model, args.dtype, args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    plan = profile_heads(model, cfg, tokenizer, records, target_global=args.target_global, coverage=args.coverage,
                         page_size=args.page_size, dense_prefix_layers=args.dense_prefix_layers, sink=args.sink,
                         ref_window=args.ref_window, retrieval_threshold=args.retrieval_threshold,
                         min_global_edge=args.min_global_edge, force_global_edge=args.force_global_edge,
                         question_weight=args.question_weight, ablation_weight=args.ablation_weight,
                         max_tokens=args.max_tokens, model_name=Path(args.model).resolve().name,
                         progress=not args.no_progress)
    plan.to_json(args.out)
    c = plan.class_counts()
    print(f"wrote {args.out}: {c['global']} global, {c['local']} local, {c['retrieval']} retrieval, "
          f"{c['dense']} dense of {c['total']} heads ({len(records)} samples)")
    if args.plot:
        plot_heads(plan, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    """Standalone entry (``python -m redknot.profile.cli``) until ``redknot profile`` is wired."""
    p = argparse.ArgumentParser(prog="redknot profile", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"redknot profile: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
