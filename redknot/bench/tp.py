"""`redknot bench tp`: decode throughput of the tensor-parallel engine against one process.

For each tensor-parallel size (1 and --tensor-parallel-size) and each BATCHxCONTEXT case, B
prompts of random tokens are generated through ``LLM.generate`` (greedy, EOS ignored, prefix caching off) after a
warm-up: 1 token, then --tokens tokens, the faster of two runs each; decode tok/s is B * (tokens - 1) over the difference
of the two times, so the prefill is not counted. Under tensor parallelism the time rank 0 spends
in the model's collectives during the decode is its share of the step (on CPU: the collectives'
whole time, waits for the slower rank included; on CUDA the host only launches them, so the share
there needs a profiler). ``--model`` is a checkpoint (default: the bundled one) or ``--arch`` a
random-weight architecture (``bench.common.ARCHS``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from .common import ARCHS, head_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled model)")
    p.add_argument("--arch", default=None, choices=sorted(ARCHS), help="random weights of this shape instead")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--no-baseline", action="store_true", help="skip the one-process run (a model that does not fit one GPU)")
    p.add_argument("--cases", default="1x256,8x256", help="comma list of BATCHxCONTEXT")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per sequence")
    p.add_argument("--head-config", default=None, help="gPERCENT-wWINDOW (e.g. g15-w1024): also run headsparse")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-pages", type=int, default=None)
    p.add_argument("--out", default=None, help="write the result JSON here")


def _llm(args, tp: int):
    from ..engine.llm import LLM
    from ..models import ModelConfig

    model = ModelConfig.from_dict(ARCHS[args.arch]) if args.arch else args.model
    cfg = model if isinstance(model, ModelConfig) else None
    plan = None
    if args.head_config:
        if cfg is None:
            from ..models.resolve import bundled_model_path

            cfg = ModelConfig.from_dir(model or bundled_model_path())
        plan = head_config(args.head_config, cfg, None)
    return LLM(model, head_config=plan, device=args.device, dtype=args.dtype, kv_pages=args.kv_pages,
               enable_prefix_caching=False, tensor_parallel_size=tp)


def _case(llm, method: str, batch: int, context: int, tokens: int) -> dict:
    from ..engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(batch * 100003 + context)
    prompts = [torch.randint(10, llm.config.vocab_size, (context,), generator=g).tolist() for _ in range(batch)]
    params = {n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, tokens)}
    llm.generate(prompts, params[1], method=method)  # warm-up (the workers' first steps)
    group = llm.tp.group if llm.tp is not None else None
    times = {}
    for n in (1, tokens):  # the faster of two runs each (a shared host's noise)
        for _ in range(2):
            comm0 = group.comm_s if group is not None else 0.0
            t0 = time.perf_counter()
            llm.generate(prompts, params[n], method=method)
            t = (time.perf_counter() - t0, (group.comm_s if group is not None else 0.0) - comm0)
            times[n] = min(times.get(n, t), t)
    decode = times[tokens][0] - times[1][0]
    comm = times[tokens][1] - times[1][1]
    return {"method": method, "batch": batch, "context": context, "tokens": tokens, "decode_s": decode,
            "tok_per_s": batch * (tokens - 1) / decode, "collective_share": comm / decode if decode > 0 else None}


def run(args) -> dict:
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    methods = ["dense"] + (["headsparse"] if args.head_config else [])
    rows = []
    sizes = [args.tensor_parallel_size] if args.no_baseline else sorted({1, args.tensor_parallel_size})
    imb = None
    for tp in sizes:
        llm = _llm(args, tp)
        try:
            imb = llm.tp.imbalance if llm.tp is not None else imb
            for method in methods:
                for b, c in cases:
                    row = {"tensor_parallel_size": tp, **_case(llm, method, b, c, args.tokens)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            llm.close()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "model": args.arch or args.model or "bundled", "head_config": args.head_config,
              "imbalance": imb, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result
