"""Parallel calls on a shared machine: Numba's threading layers side by side.

OpenMP's caller waits at the end of a parallel region for every worker.  A
worker that the scheduler has not run yet (its core is busy with another
process) holds the call up for that process's time slice: milliseconds for a
call of microseconds.  libgomp's workers also spin after a region
(``GOMP_SPINCOUNT`` rounds) before they sleep, using up their share of a
shared core.  TBB's caller runs the tasks no worker has taken, so a call
costs at most about the serial time.

This times ``pn.rms_norm`` (float32, d = 4096) through the parallel driver and
the serial one, for each configuration (TBB; OpenMP with each spin count), in a
fresh process each (the layer and libgomp's settings are fixed when they load),
in four settings: calls back to back on an otherwise idle machine, calls
100 us apart (a decode loop's other work), back to back beside a busy-looping
process (one per spare core), and beside another process that makes parallel
calls of its own (``shared``: two workers of a pool on one machine).  Figures are medians of batch
means, in microseconds; each child prints one JSON row.

    python bench/parallel_load.py --out bench/results/parallel-load-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

TOKENS = (16, 64, 256, 2048)
D = 4096
GAP_US = 100.0
#: ``tbb``, or ``omp-N``: OpenMP with GOMP_SPINCOUNT=N (300000: libgomp's own default
#: with OMP_WAIT_POLICY unset and no more threads than CPUs)
CONFIGS = ("tbb", "omp-300000", "omp-10000", "omp-1000")


#: the other worker of ``shared``: parallel calls (256 x 4096) back to back
_SHARED = ("import numpy as np, polynorm as pn\n"
           "x = np.ones((256, 4096), np.float32)\n"
           "while True: pn.rms_norm(x)\n")


def _child(tokens: tuple[int, ...], rounds: int) -> dict:
    import importlib

    import numpy as np

    import polynorm as pn

    nbk = importlib.import_module("polynorm.backends.numba")

    def med(f, calls):
        f()
        res = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(calls):
                f()
            res.append((time.perf_counter() - t) / calls)
        return statistics.median(res) * 1e6

    def spaced(f):
        def g():
            f()
            t = time.perf_counter()
            while time.perf_counter() - t < GAP_US * 1e-6:
                pass
        return g

    def serial(f):
        def g():
            old, nbk.SERIAL_MAX_ELEMENTS = nbk.SERIAL_MAX_ELEMENTS, 1 << 62
            try:
                f()
            finally:
                nbk.SERIAL_MAX_ELEMENTS = old
        return g

    rng = np.random.default_rng(0)
    w = rng.standard_normal(D, np.float32)
    import numba

    pn.rms_norm(rng.standard_normal((64, D), np.float32))  # the layer starts
    row: dict = {"layer": numba.threading_layer()}
    busy = []
    for setting in ("idle", "spaced", "busy", "shared"):
        if setting == "busy":
            spare = max(1, (os.cpu_count() or 2) - 1)
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(spare)]
            time.sleep(0.3)
        elif setting == "shared":
            busy = [subprocess.Popen([sys.executable, "-c", _SHARED])]
            time.sleep(3.0)  # its import and first calls
        try:
            for n in tokens:
                x = rng.standard_normal((n, D), np.float32)
                calls = max(3, 4000 // n)
                def call(x=x):
                    return pn.rms_norm(x, w)

                f = spaced(call) if setting == "spaced" else call
                par = med(f, calls) - (GAP_US if setting == "spaced" else 0)
                ser = med(serial(f), calls) - (GAP_US if setting == "spaced" else 0)
                row[f"{setting}/{n}"] = {"parallel_us": round(par, 1), "serial_us": round(ser, 1)}
        finally:
            for p in busy:
                p.kill()
            busy = []
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS),
                    help="tbb, or omp-N (OpenMP, GOMP_SPINCOUNT=N)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(tuple(a.tokens), a.rounds)))
        return
    rows = {}
    for config in a.configs:
        layer, _, spin = config.partition("-")
        env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
        if spin:
            env["GOMP_SPINCOUNT"] = spin  # the user's setting: polynorm keeps it
        out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(a.rounds),
                              "--tokens", *map(str, a.tokens)],
                             env=env, capture_output=True, text=True, check=True).stdout
        rows[config] = json.loads(out.strip().splitlines()[-1])
        print(config, json.dumps(rows[config]), flush=True)
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
              "cpus": os.cpu_count(), "d": D, "gap_us": GAP_US, "note": a.note, "rows": rows}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
