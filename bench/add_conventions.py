"""Cost of the fused add's non-default conventions (#48) on the CPU, paired.

``norm_input="sum"`` and ``residual_dtype`` run apart (the add in numpy, then the
Numba backend's plain kernel): this measures what that costs against the fused
default, interleaved in one run so that machine noise hits all variants alike.

    python bench/add_conventions.py [--tokens N] [--d D] [--reps R]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import ml_dtypes
import numpy as np

import polynorm as pn

VARIANTS = {
    "default": {},
    "norm_input=sum": {"norm_input": "sum"},
    "residual_dtype=float32": {"residual_dtype": "float32"},
    "sum+float32": {"norm_input": "sum", "residual_dtype": "float32"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    x = rng.standard_normal((a.tokens, a.d)).astype(bf)
    r = rng.standard_normal((a.tokens, a.d)).astype(bf)
    w = rng.standard_normal(a.d).astype(bf)
    for kw in VARIANTS.values():  # compile
        pn.add_rms_norm(x[:4], r[:4], w, **kw)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(a.reps):
        for name, kw in VARIANTS.items():
            t0 = time.perf_counter()
            pn.add_rms_norm(x, r, w, **kw)
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    cpu = platform.processor() or platform.machine()
    out = {"what": f"python bench/add_conventions.py --tokens {a.tokens} --d {a.d} "
                   f"--reps {a.reps}: add_rms_norm bf16 on Numba, norm_input/residual_dtype "
                   f"against the fused default, median of interleaved runs ({cpu}, "
                   f"{os.cpu_count()} CPUs)",
           "shape": [a.tokens, a.d], "dtype": "bfloat16", "reps": a.reps,
           "machine": platform.machine(), "median_ms": {k: v * 1e3 for k, v in med.items()},
           "ratio_to_default": {k: v / med["default"] for k, v in med.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
