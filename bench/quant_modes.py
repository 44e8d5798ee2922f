"""Numba quantized forward: scale_mode and float8_e5m2 beside the e4m3fn division, and
against the code before #48 (a tree given by ``--base``), paired in one run.

Each configuration runs in its own subprocess (``--worker``), alternating, several
rounds; the median (and the minimum) over rounds of the per-call medians is
reported with the ratio to the e4m3fn "divide" call of the new code.

    python bench/quant_modes.py --base /tmp/quant48-base --out bench/results/quant-modes-cpu-2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("float8_e4m3fn", "divide"), ("float8_e4m3fn", "reciprocal"),
         ("float8_e5m2", "divide"), ("int8", "reciprocal")]


def worker(n: int, d: int, dtype: str, reps: int, new: bool) -> dict:
    import ml_dtypes
    import numpy as np

    import polynorm as pn

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    w = rng.standard_normal(d).astype(np.float32)
    out = {}
    for qdtype, mode in (CASES if new else CASES[:1]):
        kw = dict(dtype=qdtype, backend="numba")
        if new:
            kw["scale_mode"] = mode
        pn.rms_norm_quant(x, w, **kw)  # compile / load
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            pn.rms_norm_quant(x, w, **kw)
            ts.append(time.perf_counter() - t0)
        out[f"{qdtype} {mode}"] = statistics.median(ts)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=False)
    ap.add_argument("--out")
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--worker", choices=["new", "base"])
    # one thread: on a shared 2-core VM two threads wait on each other's wake-ups
    # (~12 ms a call at load 7, whatever the size), which hides the kernel
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    n, d = map(int, a.shape.split("x"))
    if a.worker:
        print(json.dumps(worker(n, d, a.dtype, a.reps, a.worker == "new")))
        return 0
    trees = {"new": str(ROOT)} | ({"base": a.base} if a.base else {})
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(a.rounds):
        for name, tree in trees.items():
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
                   "--shape", a.shape, "--dtype", a.dtype, "--reps", str(a.reps)]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True,
                               env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin",
                                    "HOME": str(Path.home()),
                                    "NUMBA_NUM_THREADS": str(a.threads)})
            runs[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    res, low = {}, {}
    for name, rs in runs.items():
        for key in rs[0]:
            res[f"{name}: {key}"] = statistics.median(r[key] for r in rs)
            low[f"{name}: {key}"] = min(r[key] for r in rs)
    ref, lref = res["new: float8_e4m3fn divide"], low["new: float8_e4m3fn divide"]
    report = {"shape": a.shape, "dtype": a.dtype, "rounds": a.rounds, "reps": a.reps,
              "numba_threads": a.threads,
              "median_s": res, "ratio_to_new_e4m3fn_divide": {k: v / ref for k, v in res.items()},
              "min_s": low, "min_ratio_to_new_e4m3fn_divide": {k: v / lref for k, v in low.items()}}
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
