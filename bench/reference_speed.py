"""The array-API reference against the naive RMSNorm formula in the same library.

Paired and interleaved: each round times polynorm (``backend="array_api"``),
the naive formula and, with ``--before REV``, the reference as it was at git
revision ``REV`` (its functions patched into the live module for that timing),
so the ratios come from one run.  Prints one JSON object; ``--out`` writes it.

    python bench/reference_speed.py --before HEAD~1 --out bench/results/x.json

Ratio = naive time / polynorm time (>= 1: the reference is at least as fast).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

# this checkout's polynorm, not the one the environment has installed (editable elsewhere)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import polynorm as pn  # noqa: E402

ref = importlib.import_module("polynorm.backends.reference")

EPS = 1e-6


def _naive_np(x, w):
    xf = x.astype(np.float32)
    r = 1 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (xf * r * w).astype(x.dtype)


def _naive_torch(x, w):
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * r * w).to(x.dtype)


def _old_functions(rev: str) -> dict:
    src = subprocess.run(
        ["git", "show", f"{rev}:polynorm/backends/reference.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    mod = types.ModuleType("reference_before")
    exec(compile(src, "reference_before", "exec"), mod.__dict__)
    return {k: v for k, v in mod.__dict__.items() if isinstance(v, types.FunctionType)}


def _declines(*args, **kwargs):
    return None


def _patched(funcs: dict, f):
    # the live module's functions that REV lacks (entry points such as eager_forward,
    # which the front end calls where they exist and which may decline with None) decline
    # during the timing: the front end then runs REV's own path
    new = {k: _declines for k, v in vars(ref).items()
           if isinstance(v, types.FunctionType) and k not in funcs}

    def run():
        swap = {**funcs, **new}
        saved = {k: getattr(ref, k) for k in swap if hasattr(ref, k)}
        for k, v in swap.items():
            setattr(ref, k, v)
        try:
            return f()
        finally:
            for k in swap:
                if k in saved:
                    setattr(ref, k, saved[k])
                else:
                    delattr(ref, k)

    return run


def _t(f, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--torch-threads", type=int, default=1, help="1: steadier on a shared host")
    ap.add_argument("--note", default=None, help="a note stored with the results")
    a = ap.parse_args()
    torch.set_num_threads(a.torch_threads)
    old = _old_functions(a.before) if a.before else None
    rng = np.random.default_rng(0)
    cases = []
    for lib, dts in (("numpy", ("float32", "float16")), ("torch", ("float32", "bfloat16"))):
        for dt in dts:
            for shape in ((4096, 1024), (1, 4096)):
                x = rng.standard_normal(shape).astype(np.float32)
                w = (1 + 0.1 * rng.standard_normal(shape[1])).astype(np.float32)
                if lib == "numpy":
                    x, naive = x.astype(dt), _naive_np
                else:
                    x, w, naive = (
                        torch.from_numpy(x).to(getattr(torch, dt)),
                        torch.from_numpy(w),
                        _naive_torch,
                    )
                fns = {
                    "polynorm": lambda x=x, w=w: pn.rms_norm(x, w, eps=EPS, backend="array_api"),
                    "naive": lambda x=x, w=w, f=naive: f(x, w),
                }
                if old is not None:
                    fns["before"] = _patched(old, fns["polynorm"])
                cases.append((f"{lib} {dt} {shape[0]}x{shape[1]}", fns, 3 if shape[0] > 1 else 200))
    res = {}
    for name, fns, reps in cases:
        for f in fns.values():
            f()
        rounds = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, f in fns.items():
                rounds[k].append(_t(f, reps))
        med = {k: float(np.median(v)) for k, v in rounds.items()}
        row = {f"{k}_us": round(v * 1e6, 1) for k, v in med.items()}
        row["naive/polynorm"] = round(med["naive"] / med["polynorm"], 2)
        if "before" in med:
            row["naive/before"] = round(med["naive"] / med["before"], 2)
        res[name] = row
        print(name, row, flush=True)
    doc = {
        "what": "array-API reference (backend='array_api') vs the naive formula in the same library, "
        "rms_norm forward with float32 weight, eps=1e-6; medians over interleaved rounds of the best of reps",
        "command": "python bench/reference_speed.py --rounds "
        + str(a.rounds)
        + (f" --before {a.before}" if a.before else ""),
        "machine": platform.machine() + " " + platform.processor(),
        "torch_threads": torch.get_num_threads(),
        "results": res,
    }
    if a.note:
        doc["note"] = a.note
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
