"""Nanoseconds per element of the Numba forward (``out=``) and backward, with the rows in cache
and in DRAM.

A kernel whose time per element is the same for a batch that fits in the caches and for one
that streams from memory is bound in the core (its instructions, their latencies), not by
memory bandwidth: then the copy roof is not what limits it, and fewer or shorter dependent
instructions are.  The small shape is timed with the same threads as the large one.

    python bench/in_cache.py --dtypes bfloat16 float32 --d 4096 --rows 256 16384
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import polynorm as pn
from polynorm.bench.common import median_time

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def per_element(dtype: str, n: int, d: int, min_time: float = 0.5) -> tuple[float, float]:
    """``(forward with out=, backward with rstd given)`` in ns per element."""
    rng = np.random.default_rng(0)
    dt = DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    dy = rng.standard_normal((n, d)).astype(dt)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    y, rstd = pn.rms_norm(x, w, return_rstd=True)
    pn.rms_norm_backward(dy, x, w, rstd=rstd)
    fwd = median_time(lambda: pn.rms_norm(x, w, out=y), min_time=min_time)
    bwd = median_time(lambda: pn.rms_norm_backward(dy, x, w, rstd=rstd), min_time=min_time)
    return fwd / (n * d) * 1e9, bwd / (n * d) * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--rows", nargs="+", type=int, default=[256, 16384])
    args = ap.parse_args(argv)
    for dtype in args.dtypes:
        for n in args.rows:
            f, b = per_element(dtype, n, args.d)
            print(f"{dtype:9s} {n:6d} x {args.d}: fwd out= {f:.3f} ns/element, bwd {b:.3f} ns/element",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
