"""Cost of ``group_size`` and ``casting="none"`` (#48) on the CPU, paired with torch.

Each is timed against torch's own composition of the peer's reference in the same
run, interleaved, so that machine noise hits every variant alike: Mamba's
``rms_norm_ref(x, weight, z=None, group_size=g)`` (float32 upcast, per-group mean,
``.to(dtype)``) and Liger's ``BaseRMSNorm`` (every op in bfloat16), both on torch CPU
tensors; polynorm's default ``rms_norm`` is the baseline.

    python bench/conventions_groups.py [--tokens N] [--d D] [--group G] [--reps R]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import ml_dtypes
import numpy as np
import torch

import polynorm as pn

EPS = 1e-6


def mamba_ref(x, w, g):
    dtype = x.dtype
    xf = x.float()
    xg = xf.view(*xf.shape[:-1], -1, g)
    rstd = 1 / torch.sqrt(xg.square().mean(dim=-1, keepdim=True) + EPS)
    return ((xg * rstd).view(xf.shape) * w.float()).to(dtype)


def liger_base(x, w):
    variance = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(variance + EPS)).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--group", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.tokens, a.d)).astype(ml_dtypes.bfloat16)
    w = (1 + 0.1 * rng.standard_normal(a.d)).astype(ml_dtypes.bfloat16)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    wt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    variants = {
        "polynorm default": lambda: pn.rms_norm(x, w, eps=EPS),
        f"polynorm group_size={a.group}": lambda: pn.rms_norm(x, w, eps=EPS, group_size=a.group),
        f"torch Mamba rms_norm_ref group_size={a.group}": lambda: mamba_ref(xt, wt, a.group),
        "polynorm casting=none": lambda: pn.rms_norm(x, w, eps=EPS, casting="none"),
        "torch Liger BaseRMSNorm (bf16)": lambda: liger_base(xt, wt),
    }
    for f in variants.values():  # compile, first touch
        f()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.reps):
        for name, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    base = med["polynorm default"]
    cpu = platform.processor() or platform.machine()
    out = {"what": f"python bench/conventions_groups.py --tokens {a.tokens} --d {a.d} "
                   f"--group {a.group} --reps {a.reps}: rms_norm bf16 on Numba with group_size "
                   f"and casting='none' against torch's compositions of Mamba's and Liger's "
                   f"references, median of interleaved runs ({cpu}, {os.cpu_count()} CPUs, "
                   f"torch {torch.__version__}, {torch.get_num_threads()} threads)",
           "shape": [a.tokens, a.d], "dtype": "bfloat16", "group_size": a.group, "reps": a.reps,
           "machine": platform.machine(), "median_ms": {k: v * 1e3 for k, v in med.items()},
           "ratio_to_polynorm_default": {k: v / base for k, v in med.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
