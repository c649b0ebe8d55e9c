"""Block-size sweep of the SegPaged prefill kernel (GPU): which (BLOCK_M, BLOCK_N, warps, stages)
and interior path is fastest at each benchmark shape, each variant checked against the exact
reference first. Prints a table and writes JSON.

    python -m redknot.bench.kernel_sweep --out sweep.json [--shapes prefill-8k,prefill-32k]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="prefill-8k,prefill-32k,prefill-128k")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernel_sweep.json"))
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args(argv)
    from ..kernels import segpaged

    dev = torch.device("cuda")
    timer = kb.Timer(dev, repeats=30, target_ms=300)
    results = []
    for name in args.shapes.split(","):
        shape = kb.SHAPES[name]
        case = kb.make_case(shape, dev, seed=0, global_window=kb.GLOBAL_WINDOW)
        work = kb.work_model(case)
        rows = kb.sample_rows(case, args.rows, seed=1)
        ref = kb.reference_rows(case, rows)
        for bm, bn, warps, stages, fast, merge in VARIANTS:
            cfg = segpaged.KernelConfig(prefill=(bm, bn, warps, stages), fast_interior=fast,
                                        merge_edges=merge)
            entry = {"shape": name, "block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                     "fast_interior": fast, "merge_edges": merge}
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
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **kb._versions(), "argv": sys.argv,
                   "results": results}, f, indent=1)
    print(f"\n{'shape':<13} {'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} {'fast':>5} {'merge':>5} {'ms':>9} {'TF/s':>6} "
          f"{'cos':>9}")
    for e in results:
        if "error" in e:
            print(f"{e['shape']:<13} {e['block_m']:>4} {e['block_n']:>4} {e['warps']:>5} {e['stages']:>6} "
                  f"{str(e['fast_interior']):>5} {str(e['merge_edges']):>5}  error: {e['error'][:60]}")
        else:
            print(f"{e['shape']:<13} {e['block_m']:>4} {e['block_n']:>4} {e['warps']:>5} {e['stages']:>6} "
                  f"{str(e['fast_interior']):>5} {str(e['merge_edges']):>5} {e['ms']:>9.3f} {e['tflops']:>6.0f} {e['cos']:>9.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
