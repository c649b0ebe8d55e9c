"""`redknot bench kernel`: the shapes of ``bench/kernel.py``, or with ``--h2o`` the heavy-hitter decode
shapes of ``bench/kernel_h2o.py`` (which builds on the first)."""

from __future__ import annotations

import argparse
import sys

from . import kernel, kernel_h2o

add_arguments = kernel.add_arguments


def run(args) -> dict:
    return kernel_h2o.run(args) if getattr(args, "h2o", False) else kernel.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m redknot.bench.kernel_cli", description=kernel.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
