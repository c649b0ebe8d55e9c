"""Launch-choice sweeps of the SegPaged kernels (GPU), each variant checked against an exact
reference first. Prints a table and writes JSON.

Prefill: which (BLOCK_M, BLOCK_N, warps, stages) and interior path is fastest at each shape.
Decode under H2O budgets (``--h2o``): which (BLOCK_N, warps, stages), split layout (tiles a
split reads), register cap and merge (a separate kernel or fused into the splits) is fastest at
the `bench kernel --h2o` shapes, against FA-2 dense in the same run.

    python -m redknot.bench.kernel_sweep --out sweep.json [--shapes prefill-8k,prefill-32k]
    python -m redknot.bench.kernel_sweep --h2o --out sweep_h2o.json [--shapes h2o-8k,h2o-32k]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from . import kernel as kb

# (BLOCK_M, BLOCK_N, num_warps, num_stages, fast_interior, merge_edges)
VARIANTS = [
    (128, 64, 8, 3, False, False),
    (128, 128, 8, 2, True, False),
    (128, 128, 8, 2, True, True),
    (128, 32, 4, 4, True, False),
    (128, 32, 4, 4, True, True),
    (128, 64, 4, 4, True, True),
]

# tensor-descriptor (TMA) interior: (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N divides the
# 64-token page
TMA_VARIANTS = [
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 32, 4, 4),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 32, 4, 4),
]


# decode: (BLOCK_N, num_warps, num_stages, tiles per split (None: built-in split count), min tiles,
# max registers per thread (None: the compiler's choice), fused merge (the last split merges: one
# launch))
DECODE_VARIANTS = [
    (64, 4, 1, None, None, None, False),
    (64, 2, 1, None, None, None, False),
    (64, 4, 1, None, None, 128, False),
    (64, 4, 1, None, None, 96, False),
    (64, 4, 1, None, None, 80, False),
    (64, 4, 2, None, None, 128, False),
    (64, 4, 2, None, None, 96, False),
    (32, 4, 1, None, None, None, False),
    (32, 4, 2, None, None, None, False),
    (32, 4, 2, None, None, 96, False),
    (32, 4, 3, None, None, 80, False),
    (32, 2, 2, None, None, None, False),
    (64, 8, 1, None, None, 64, False),
    (64, 4, 1, None, 2, 96, False),
    (64, 4, 1, None, None, 128, True),
    (64, 4, 1, None, None, None, True),
    (64, 4, 1, None, 2, 128, True),
    (32, 4, 2, None, None, 96, True),
]


def _save(path: str, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **kb._versions(), "argv": sys.argv,
                   "results": results}, f, indent=1)


def sweep_h2o(args) -> int:
    """Decode variants at the H2O shapes, FA-2 dense timed in the same run."""
    from ..kernels import segpaged
    from . import kernel_h2o as kh

    dev = torch.device("cuda")
    timer = kb.Timer(dev, repeats=50, target_ms=500)
    timer.graph = True
    fa = kb.probe_fa(dev)
    env = kb.Env(device=dev, timer=timer, fa=fa, kernels=None, kernel_error=None, methods=(), deadline=float("inf"))
    names = args.shapes or ",".join(kh.SHAPES)
    results = []
    for name in names.split(","):
        shape = kh.SHAPES[name]
        c = kh.make_h2o_case(shape, dev, seed=0)
        B, L, H, D = shape.batch, shape.ctx, kb.HKV, kb.HEAD_DIM
        fn, _ = kh._fa_or_sdpa(env, c["q"], c["k"].reshape(B * L, H, D), c["v"].reshape(B * L, H, D), L, B)
        fa_ms = timer(fn)["ms"]
        qd = c["q"].double().view(B, H, kb.GROUP, D)
        sc = torch.einsum("bhgd,bhnd->bhgn", qd, c["k_sel"].double()) * c["scale"]
        ref = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(sc, -1), c["v_sel"].double()).reshape(B, kb.HQ, D)
        for bn, warps, stages, per_split, min_tiles, maxnreg, fused in DECODE_VARIANTS:
            cfg = segpaged.KernelConfig(decode=(bn, warps, stages), decode_tiles_per_split=per_split,
                                        decode_min_tiles_per_split=min_tiles, decode_maxnreg=maxnreg,
                                        decode_fused_merge=fused)
            entry = {"shape": name, "block_n": bn, "warps": warps, "stages": stages, "tiles_per_split": per_split,
                     "min_tiles": min_tiles, "maxnreg": maxnreg, "fused_merge": fused, "fa_dense_ms": fa_ms}
            try:
                fn = lambda: segpaged.segpaged_attention(  # noqa: E731
                    c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["cu_q"], c["seq_lens"], c["window"],
                    c["sink"], c["scale"], 1, sel_pos=c["sel_pos"], sel_lens=c["sel_lens"], config=cfg)
                entry["cos"] = kb.compare(fn().reshape(B, kb.HQ, D), ref)["cos"]
                entry.update(timer(fn))
                entry["x_fa_dense"] = fa_ms / entry["ms"]
            except Exception as e:
                entry["error"] = kb._err(e)
            results.append(entry)
            print(json.dumps(entry), flush=True)
        del c
        kb._free_memory(dev)
    _save(args.out, results)
    print(f"\n{'shape':<9} {'BN':>4} {'warps':>5} {'stages':>6} {'per split':>9} {'min':>4} {'regs':>5} {'fused':>5} "
          f"{'ms':>8} {'x FA-2':>7} {'cos':>9}")
    for e in results:
        head = (f"{e['shape']:<9} {e['block_n']:>4} {e['warps']:>5} {e['stages']:>6} {str(e['tiles_per_split']):>9} "
                f"{str(e['min_tiles']):>4} {str(e.get('maxnreg')):>5} {str(e['fused_merge']):>5}")
        print(head + (f"  error: {e['error'][:60]}" if "error" in e
                      else f" {e['ms']:>8.4f} {e['x_fa_dense']:>7.2f} {e['cos']:>9.6f}"))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=None,
                    help="comma list (default: every prefill shape, or every H2O shape with --h2o)")
    ap.add_argument("--h2o", action="store_true", help="sweep the decode kernel at the H2O shapes")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernel_sweep.json"))
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args(argv)
    if args.h2o:
        return sweep_h2o(args)
    from ..kernels import segpaged

    dev = torch.device("cuda")
    timer = kb.Timer(dev, repeats=30, target_ms=300)
    results = []
    for name in (args.shapes or "prefill-8k,prefill-32k,prefill-128k").split(","):
        shape = kb.SHAPES[name]
        case = kb.make_case(shape, dev, seed=0, global_window=kb.GLOBAL_WINDOW)
        work = kb.work_model(case)
        rows = kb.sample_rows(case, args.rows, seed=1)
        ref = kb.reference_rows(case, rows)
        variants = [(bm, bn, w, st, fast, merge, False) for bm, bn, w, st, fast, merge in VARIANTS]
        variants += [(bm, bn, w, st, None, None, True) for bm, bn, w, st in TMA_VARIANTS]
        for bm, bn, warps, stages, fast, merge, tma in variants:
            cfg = segpaged.KernelConfig(prefill=(bm, bn, warps, stages), fast_interior=fast,
                                        merge_edges=merge, tma=tma)
            entry = {"shape": name, "block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                     "fast_interior": fast, "merge_edges": merge, "tma": tma}
            try:
                fn = lambda: segpaged.segpaged_attention(  # noqa: E731
                    case.q, case.k_pages, case.v_pages, case.block_table, case.cu_q, case.seq_lens,
                    case.window, case.sink, case.scale, shape.q_len, config=cfg)
                out = fn()
                entry["cos"] = kb.compare(out[rows.to(dev)], ref)["cos"]
                entry.update(timer(fn))
                entry["tflops"] = work["visible_flop"] / (entry["ms"] * 1e-3) / 1e12
            except Exception as e:  # a config that does not compile (shared memory) is a result too
                entry["error"] = kb._err(e)
            results.append(entry)
            print(json.dumps(entry), flush=True)
        del case
        kb._free_memory(dev)
    _save(args.out, results)
    print(f"\n{'shape':<13} {'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} {'fast':>5} {'merge':>5} {'interior':>8} "
          f"{'ms':>9} {'TF/s':>6} {'cos':>9}")
    for e in results:
        interior = "tma" if e["tma"] else "pointer"
        head = (f"{e['shape']:<13} {e['block_m']:>4} {e['block_n']:>4} {e['warps']:>5} {e['stages']:>6} "
                f"{str(e['fast_interior']):>5} {str(e['merge_edges']):>5} {interior:>8}")
        print(head + (f"  error: {e['error'][:60]}" if "error" in e
                      else f" {e['ms']:>9.3f} {e['tflops']:>6.0f} {e['cos']:>9.6f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
