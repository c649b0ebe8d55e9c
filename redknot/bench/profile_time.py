"""`redknot bench profile`: how long the head profiler takes on a real architecture (random weights).

The profiler's cost depends on the shape, not on weight values, so a random-weight Mistral-7B (or
Qwen3-8B) at the calibration length users run (8K) tells what `redknot profile` costs on the real
checkpoint. Calibration records come from the testbed corpus generator; prompts are cut to
``--max-tokens``. Prints seconds per sample and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="mistral-7b", help="random-weight architecture (see bench ttft) or 'tiny'")
    p.add_argument("--max-tokens", type=int, default=8192, help="calibration prompt length")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)


def run(args) -> int:
    from ..models.config import ModelConfig
    from ..models.loader import build_model
    from ..profile.profiler import profile_heads
    from ..testbed.records import generate_records
    from ..models.tokenizer import make_tokenizer
    from .common import ARCHS

    if args.arch not in ARCHS:
        raise ValueError(f"--arch {args.arch!r}: use one of {', '.join(ARCHS)}")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(ARCHS[args.arch])
    torch.manual_seed(0)
    model = build_model(cfg, dtype, dev)
    tokenizer = make_tokenizer()  # ~3 characters a token: the generated text easily fills --max-tokens
    records = generate_records(0, args.samples, context_tokens=args.max_tokens)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def profile(recs):
        sync()
        t0 = time.perf_counter()
        plan = profile_heads(model, cfg, tokenizer, recs, max_tokens=args.max_tokens, progress=False)
        sync()
        return plan, time.perf_counter() - t0

    profile(records[:1])  # warm-up: kernels, allocator
    plan, seconds = profile(records)
    prof = plan.metadata["profiling"]
    result = {"benchmark": "profile", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "argv": ["redknot", "bench", "profile"] + sys.argv[3:], "arch": args.arch, "samples": prof["samples"],
              "tokens": prof["tokens"], "longest_prompt": prof["longest_prompt"], "seconds": round(seconds, 3),
              "seconds_per_sample": round(seconds / prof["samples"], 3),
              "tokens_per_s": round(prof["tokens"] / seconds, 1), "classes": plan.class_counts(),
              "peak_memory_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None}
    print(f"profile {args.arch}: {result['samples']} samples, longest {result['longest_prompt']} tokens, "
          f"{seconds:.2f} s ({result['seconds_per_sample']:.2f} s/sample, {result['tokens_per_s']:,.0f} tokens/s); "
          f"classes {result['classes']}")
    out = args.out or os.path.join(os.environ.get("OUT", "."), "profile_time.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench profile", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
