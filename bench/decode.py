"""Decode-size calls (1 and 8 tokens of d = 4096) against the peers, side by side.

Every op of ``polynorm bench``'s matrix (``fwd``, ``fwd-out``, ``add``, ``bwd``,
``gated``, ``quant``) in float32, bfloat16 and float16, timed in interleaved
rounds: each round times a batch of calls of polynorm and of every peer (ONNX
Runtime's nodes, torch, numpy's composition: the functions of
:mod:`polynorm.bench.cpu`), so that a noisy host slows all columns alike.  A
column's figure is the median over rounds of ``peer time / polynorm time`` in
the same round (< 1: the peer is faster), with the median per-call times.

Prints one JSON object; ``--out FILE`` writes it too.  Compare two checkouts by
running it under each (``PYTHONPATH=/path/to/checkout python bench/decode.py``)::

    python bench/decode.py --out bench/results/decode-cpu-DATE.json
    python bench/decode.py --ops fwd fwd-out add --rounds 31
    python bench/decode.py --ops fwd add --read-only   # inputs as safetensors gives them

``--read-only`` makes every input array read-only (``out`` stays writable): the arrays
a jax buffer or ``np.frombuffer`` over a weights file gives.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

from polynorm.bench import cpu
from polynorm.core.dtypes import numpy_dtype

OPS = ("fwd", "fwd-out", "add", "bwd", "gated", "quant")
DTYPES = ("float32", "bfloat16", "float16")
TOKENS = (1, 8)
D = 4096


def _batch(fn, calls: int) -> float:
    t = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t) / calls / 1e3


def case(op: str, dt: str, n: int, d: int, rounds: int, calls: int,
         read_only: bool = False) -> dict:
    """One row: per-call microseconds (medians) and peer / polynorm ratios."""
    rng = np.random.default_rng(0)
    npd = numpy_dtype(dt)
    x = rng.standard_normal((n, d), dtype=np.float32).astype(npd)
    w = (1 + 0.1 * rng.standard_normal(d, dtype=np.float32)).astype(npd)
    r = rng.standard_normal((n, d), dtype=np.float32).astype(npd)
    dy = rng.standard_normal((n, d), dtype=np.float32).astype(npd)
    out = np.empty_like(x)
    if read_only:
        for a in (x, w, r, dy):
            a.flags.writeable = False
    fns = {"polynorm": cpu._polynorm_fn("gated" if op == "gated" else op, x, w, r, dy, out)}
    for k, f in cpu._ort_fns(op, x, w, r, out).items():
        fns[f"ort_{k}"] = f
    tf = cpu._torch_fn(op, x, w, r, dy)
    if tf is not None:
        fns["torch"] = tf
    fns["numpy"] = cpu._numpy_fn(op, x, w, r, dy)
    for f in fns.values():  # warm-up: compiles, sessions, pools
        f()
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(_batch(f, calls))
    pn = times["polynorm"]
    row = {"op": op, "dtype": dt, "tokens": n, "d": d, **({"read_only": True} if read_only else {}),
           "us": {k: round(statistics.median(v), 2) for k, v in times.items()}}
    ratios = {}
    ort = [k for k in fns if k.startswith("ort_")]
    if ort:  # the faster ONNX Runtime node, round by round
        ratios["ort"] = statistics.median(min(times[k][i] for k in ort) / pn[i]
                                          for i in range(rounds))
    for k in ("torch", "numpy"):
        if k in times:
            ratios[k] = statistics.median(times[k][i] / pn[i] for i in range(rounds))
    row["ratio"] = {k: round(v, 2) for k, v in ratios.items()}
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--calls", type=int, default=200, help="calls per batch")
    p.add_argument("--threads", type=int, default=1,
                   help="threads of Numba, torch and ONNX Runtime (0: their defaults); the "
                        "decode path runs serial kernels, and one thread is the peers' "
                        "fastest at these sizes on a shared host")
    p.add_argument("--read-only", action="store_true", help="read-only input arrays")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    import numba

    import polynorm

    if args.threads:
        numba.set_num_threads(args.threads)  # ONNX Runtime's sessions take Numba's count
        try:
            import torch

            torch.set_num_threads(args.threads)
        except ImportError:
            pass

    rows = []
    for n in args.tokens:
        for dt in args.dtypes:
            for op in args.ops:
                row = case(op, dt, n, D, args.rounds, args.calls, args.read_only)
                rows.append(row)
                print(json.dumps(row), flush=True)
    try:
        rev = subprocess.run(["git", "-C", polynorm.__path__[0], "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = ""
    result = {"polynorm": polynorm.__path__[0], "rev": rev, "machine": platform.machine(),
              "processor": platform.processor(), "numba_threads": numba.get_num_threads(),
              "command": "python bench/decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "rounds": args.rounds, "calls_per_batch": args.calls, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
