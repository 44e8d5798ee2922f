"""The first call's cost in a fresh process with an empty kernel cache.

Each case runs in its own child process whose ``POLYNORM_CACHE_DIR`` is a new
empty folder, so every kernel it needs is compiled; reported are the CPU
time of ``import polynorm`` and the first call (which imports Numba and
compiles), and of the whole child (Python and numpy starting too), then the
same for a second child with the cache the first one filled (the warm
start: imports and cache loads only).  CPU time beside wall time: on a
shared machine the wall time of a compile is mostly waiting.

Run::

    python bench/cold_start.py            # all cases
    python bench/cold_start.py fwd32 --json bench/results/cold-start.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

_SETUP = "import time\nimport numpy as np\nrng = np.random.default_rng(0)\n"
_X = "x = rng.standard_normal((8, 4096), np.float32)\nw = np.ones(4096, np.float32)\n"
_MARK = "polynorm-first-call"

#: name -> (the inputs' code, the call's code); the call's own time runs from
#: ``import polynorm`` (which imports Numba) to its return
CASES = {
    "fwd32": (_X, "pn.rms_norm(x, w)"),
    "fwd32_big": ("x = rng.standard_normal((4096, 4096), np.float32)\n"
                  "w = np.ones(4096, np.float32)\n", "pn.rms_norm(x, w)"),
    "add32": (_X + "r = x.copy()\n", "pn.add_rms_norm(x, r, w)"),
    "bwd32": (_X + "dy = x.copy()\n", "pn.rms_norm_backward(dy, x, w)"),
    "fwd_bf16": ("import ml_dtypes\n"
                 "x = rng.standard_normal((8, 4096)).astype(ml_dtypes.bfloat16)\n"
                 "w = np.ones(4096, ml_dtypes.bfloat16)\n", "pn.rms_norm(x, w)"),
}


def _program(name: str) -> str:
    prep, call = CASES[name]
    return (_SETUP + prep + "c0, t0 = time.process_time(), time.perf_counter()\n"
            "import polynorm as pn\n" + call + "\n"
            f"print('{_MARK}', time.process_time() - c0, time.perf_counter() - t0)\n")


def _child(name: str, cache: str) -> dict:
    """One child process running case ``name``: its CPU and wall seconds, and
    those of its ``import polynorm`` + first call."""
    env = dict(os.environ, POLYNORM_CACHE_DIR=cache)
    env.pop("NUMBA_CACHE_DIR", None)  # Numba's own variable would win over ours
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _program(name)], env=env, cwd=cache, check=True,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    mark = next(ln for ln in res.stdout.splitlines() if ln.startswith(_MARK)).split()
    return {"process_cpu_s": round(cpu, 2), "process_wall_s": round(wall, 2),
            "call_cpu_s": round(float(mark[1]), 2), "call_wall_s": round(float(mark[2]), 2)}


def measure(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="polynorm-cold-") as cache:
            cold = _child(name, cache)
            warm = _child(name, cache)
        rows.append({"case": name, "cold": cold, "warm": warm})
        print(f"{name:10s} cold: first call {cold['call_cpu_s']:5.2f} s CPU "
              f"({cold['call_wall_s']:5.2f} s wall), process {cold['process_cpu_s']:5.2f} s CPU"
              f"   warm: first call {warm['call_cpu_s']:4.2f} s, process "
              f"{warm['process_cpu_s']:4.2f} s CPU", flush=True)
    return rows


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


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
        from polynorm.bench.common import machine_info

        meta = {**machine_info(), "numba": _version("numba"), "numpy": _version("numpy")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
