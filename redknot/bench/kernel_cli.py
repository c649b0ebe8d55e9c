"""`redknot bench kernel`: the shapes of ``bench/kernel.py``, or with ``--h2o`` the heavy-hitter decode
shapes of ``bench/kernel_h2o.py`` (which builds on the first), or with ``--moe`` one mixture-of-experts
block at a real shape (``bench/kernel_moe.py``)."""

from __future__ import annotations

import argparse
import sys

from . import kernel, kernel_h2o, kernel_moe


def add_arguments(p: argparse.ArgumentParser) -> None:
    kernel.add_arguments(p)
    p.add_argument("--moe", action="store_true",
                   help="one MoE block (router + experts) for T tokens: the fused Triton grouped GEMM vs a "
                        "per-expert torch loop vs transformers' MoE block (redknot.bench.kernel_moe); "
                        f"--methods from {', '.join(kernel_moe.METHODS)}")
    p.add_argument("--moe-arch", default="qwen3-30b-a3b", choices=sorted(a for a in kernel_moe.ARCHS if a != "tiny"),
                   help="the MoE layer's shape (--quick: a tiny block)")
    p.add_argument("--moe-tokens", default=None,
                   help=f"comma list of token counts (default {','.join(map(str, kernel_moe.TOKENS))})")


def run(args) -> dict:
    if getattr(args, "moe", False):
        return kernel_moe.run(args)
    return kernel_h2o.run(args) if getattr(args, "h2o", False) else kernel.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m redknot.bench.kernel_cli", description=kernel.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
