"""``python -m codegen`` writes polynorm/backends/cuda/*.cu; ``--check`` fails (exit 1) when stale."""

from __future__ import annotations

import argparse
import sys

from . import stale, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the generated sources are stale")
    args = p.parse_args(argv)
    if args.check:
        bad = stale()
        if bad:
            print("stale generated CUDA sources (run `python -m codegen`):", *bad, sep="\n  ")
            return 1
        print("generated CUDA sources are up to date")
        return 0
    for path in write():
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
