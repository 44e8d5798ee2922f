"""In-place fused add and per-head weights on the CPU against torch's own compositions, paired.

Torch CPU tensors, interleaved in one run (machine noise hits every variant alike):

- add: ``pn.add_rms_norm_`` (in place), ``pn.add_rms_norm`` (allocating), and torch's
  ``h = x + residual; y = F.rms_norm(h, (d,), w, eps)``;
- per-head: ``pn.rms_norm(x, W)`` with ``x`` (T, H, D) and ``W`` (H, D), torch's
  ``F.rms_norm(x, (D,), eps=eps) * W``, and ``pn.rms_norm`` with one shared (D,) weight
  (what the per-head loop costs over the plain kernel), and the per-head call head by
  head (the loop the one-call drivers replaced).

    python bench/inplace_perhead.py [--reps R] [--threads T] [--out FILE]

``--threads 1`` (torch and Numba on one thread each) gives steadier numbers on a
shared machine than the default thread counts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

import polynorm as pn
import polynorm.torch as pt

EPS = 1e-6
ADD_SHAPES = [(1, 4096), (32, 4096), (2048, 4096)]
HEAD_SHAPES = [(1, 32, 128), (64, 32, 128), (2048, 32, 128)]
DTYPES = [torch.float32, torch.bfloat16]


def _paired(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each fn, the variants interleaved rep by rep."""
    for f in fns.values():  # compile, warm
        f()
        f()
    inner = 1
    t0 = time.perf_counter()
    next(iter(fns.values()))()
    one = time.perf_counter() - t0
    inner = max(1, min(200, int(2e-3 / max(one, 1e-7))))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t0) / inner)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _add_rows(dtype, shape, reps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    xi, ri = x.clone(), r.clone()

    def torch_compose():
        h = x + r
        return F.rms_norm(h, (shape[-1],), w, EPS), h

    def inplace():
        # values drift over the calls (x becomes y, residual accumulates); timing does not
        # depend on them, and they stay finite for these repetitions
        pt.add_rms_norm_(xi, ri, w, eps=EPS)

    fns = {"polynorm add_rms_norm_ (in place)": inplace,
           "polynorm add_rms_norm": lambda: pn.add_rms_norm(x, r, w, eps=EPS),
           "torch x + residual; F.rms_norm": torch_compose}
    return _paired(fns, reps)


def _head_rows(dtype, shape, reps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    wh = torch.randn(shape[1:], generator=g).to(dtype)
    w1 = wh[0].clone()
    fns = {"polynorm rms_norm per-head (H, D)": lambda: pn.rms_norm(x, wh, eps=EPS),
           "torch F.rms_norm(x, (D,)) * W": lambda: F.rms_norm(x, (shape[-1],), eps=EPS) * wh,
           "polynorm rms_norm shared (D,)": lambda: pn.rms_norm(x, w1, eps=EPS),
           "polynorm per-head loop (one call per head)": lambda: _per_head_loop(x, wh)}
    return _paired(fns, reps)


def _per_head_loop(x, wh):
    """The per-head call head by head (``ops.norm._HEADS_ONE_CALL`` off): the path
    before the one-call drivers, kept for the tests."""
    import importlib

    norm = importlib.import_module("polynorm.ops.norm")
    norm._HEADS_ONE_CALL = False
    try:
        return pn.rms_norm(x, wh, eps=EPS)
    finally:
        norm._HEADS_ONE_CALL = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch and Numba threads (0: defaults)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("add", "per-head"), default=None,
                    help="run only these rows")
    a = ap.parse_args()
    if a.threads:
        import numba

        torch.set_num_threads(a.threads)
        numba.set_num_threads(a.threads)
    rows = []
    for kind, shapes, run in (("add", ADD_SHAPES, _add_rows), ("per-head", HEAD_SHAPES, _head_rows)):
        if a.only is not None and kind != a.only:
            continue
        for dtype in DTYPES:
            for shape in shapes:
                med = run(dtype, shape, a.reps)
                base = next(v for k, v in med.items() if k.startswith("torch"))
                rows.append({"op": kind, "shape": list(shape), "dtype": str(dtype).split(".")[-1],
                             "median_us": {k: round(v * 1e6, 2) for k, v in med.items()},
                             "ratio_to_torch": {k: round(v / base, 3) for k, v in med.items()}})
                print(json.dumps(rows[-1]))
    cpu = platform.processor() or platform.machine()
    only = "" if a.only is None else f" --only {a.only}"
    out = {"what": f"python bench/inplace_perhead.py --reps {a.reps} --threads {a.threads}{only}: "
                   "torch CPU tensors, "
                   "median per call of interleaved runs; ratio < 1 is faster than torch's "
                   "composition",
           "machine": f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                      f"{torch.get_num_threads()} torch threads",
           "rows": rows}
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
