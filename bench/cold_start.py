"""The first call's cost in a fresh process with an empty kernel cache.

Each case runs in its own child process whose ``POLYNORM_CACHE_DIR`` is a new
empty folder, so every kernel it needs is compiled; the CPU time (user +
system) of the child is reported, and beside it the same child with the
cache it just filled (the warm start: imports and cache loads only).  CPU
time rather than wall time: on a shared machine the wall time of a compile
is mostly waiting.

Run::

    python bench/cold_start.py            # all cases
    python bench/cold_start.py fwd32 --json bench/results/cold-start.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

_SETUP = "import numpy as np, polynorm as pn\nrng = np.random.default_rng(0)\n"

#: name -> the code of the call (after _SETUP)
CASES = {
    "fwd32": "x = rng.standard_normal((8, 4096), np.float32)\n"
             "w = np.ones(4096, np.float32)\npn.rms_norm(x, w)\n",
    "fwd32_big": "x = rng.standard_normal((4096, 4096), np.float32)\n"
                 "w = np.ones(4096, np.float32)\npn.rms_norm(x, w)\n",
    "add32": "x = rng.standard_normal((8, 4096), np.float32)\nr = x.copy()\n"
             "w = np.ones(4096, np.float32)\npn.add_rms_norm(x, r, w)\n",
    "bwd32": "x = rng.standard_normal((8, 4096), np.float32)\n"
             "w = np.ones(4096, np.float32)\n"
             "pn.rms_norm_backward(x.copy(), x, w)\n",
    "fwd_bf16": "import ml_dtypes\n"
                "x = rng.standard_normal((8, 4096)).astype(ml_dtypes.bfloat16)\n"
                "w = np.ones(4096, ml_dtypes.bfloat16)\npn.rms_norm(x, w)\n",
}


def _child_cpu(code: str, cache: str) -> tuple[float, float]:
    """``(cpu seconds, wall seconds)`` of one child process running ``code``."""
    env = dict(os.environ, POLYNORM_CACHE_DIR=cache)
    env.pop("NUMBA_CACHE_DIR", None)  # Numba's own variable would win over ours
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _SETUP + code], env=env, cwd=cache, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def measure(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="polynorm-cold-") as cache:
            cold_cpu, cold_wall = _child_cpu(CASES[name], cache)
            warm_cpu, warm_wall = _child_cpu(CASES[name], cache)
        rows.append({"case": name, "cold_cpu_s": round(cold_cpu, 2),
                     "cold_wall_s": round(cold_wall, 2), "warm_cpu_s": round(warm_cpu, 2),
                     "warm_wall_s": round(warm_wall, 2)})
        print(f"{name:10s} cold {cold_cpu:6.2f} s CPU ({cold_wall:6.2f} s wall)   "
              f"warm {warm_cpu:5.2f} s CPU", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*", metavar="case",
                   help=f"any of {', '.join(CASES)} (default: all)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        p.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    rows = measure(args.cases or list(CASES))
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor()
                or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
