"""Timings of the calls that issue 14's checks and kernel changes touch.

Prints one JSON line (microseconds).  Compare two checkouts by running it
alternately under each, e.g.::

    for i in 1 2 3; do for root in /path/old /path/new; do
        PYTHONPATH=$root python bench/edge_overhead.py; done; done

Small calls are the median of many; serial kernel calls the 10th percentile
(steadier on a shared machine).
"""

from __future__ import annotations

import json
import time

import ml_dtypes
import numpy as np

import polynorm as pn


def _time(f, reps: int, q: float) -> float:
    f()
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return round(float(np.percentile(ts, q)) * 1e6, 2)


def main() -> None:
    rng = np.random.default_rng(0)
    r = {}
    x1 = rng.standard_normal((1, 4096)).astype(np.float32)
    w1 = np.ones(4096, np.float32)
    o1 = np.empty_like(x1)
    r["small"] = _time(lambda: pn.rms_norm(x1, w1), 5000, 50)
    r["small_out"] = _time(lambda: pn.rms_norm(x1, w1, out=o1), 5000, 50)
    r["small_inplace"] = _time(lambda: pn.rms_norm(x1, w1, out=x1), 5000, 50)
    for dt in (np.float32, ml_dtypes.bfloat16, np.float64):
        x = rng.standard_normal((8, 4096)).astype(dt)
        w = rng.standard_normal(4096).astype(np.float32)
        dy = rng.standard_normal(x.shape).astype(dt)
        o = np.empty_like(x)
        name = np.dtype(dt).name
        r[f"fwd_out_8x4096_{name}"] = _time(lambda x=x, w=w, o=o: pn.rms_norm(x, w, out=o), 3000, 10)
        r[f"bwd_8x4096_{name}"] = _time(lambda dy=dy, x=x, w=w: pn.rms_norm_backward(dy, x, w),
                                          2000, 10)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
