"""The split hidden axis on the CPU: what the split path costs on one shard.

Per shape, timed paired (the variants in turn, the same number of rounds each) on numpy
float32 rows and a float32 weight:

- ``unsplit``: ``pn.rms_norm(x, w)``;
- ``split``: ``pn.rms_norm_stats(x)`` then ``pn.rms_norm_from_stats(x, w, sumsq=..)``
  (one shard, no collective: the split path's own overhead);
- ``torch_split``: torch's composition of the same two steps on the same memory
  (``ss = x.square().sum(-1, dtype=float64)``, ``x * rsqrt(ss / d + eps).float() * w``);
- ``torch_rms_norm``: ``torch.nn.functional.rms_norm`` (the unsplit call).

Prints and writes one JSON object (microseconds, the median over rounds)::

    python bench/split.py --out bench/results/split-2026-12-06-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

import polynorm as pn

SHAPES = ((1, 4096), (64, 4096), (4096, 4096), (512, 16384))
EPS = 1e-6


def _variants(x: np.ndarray, w: np.ndarray) -> dict:
    import torch

    d = x.shape[1]
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)

    def split():
        ss = pn.rms_norm_stats(x)
        return pn.rms_norm_from_stats(x, w, sumsq=ss, d_total=d, eps=EPS)

    def torch_split():
        ss = tx.square().sum(-1, keepdim=True, dtype=torch.float64)
        return tx * torch.rsqrt(ss / d + EPS).float() * tw

    return {
        "unsplit": lambda: pn.rms_norm(x, w, eps=EPS),
        "split": split,
        "torch_split": torch_split,
        "torch_rms_norm": lambda: torch.nn.functional.rms_norm(tx, (d,), tw, eps=EPS),
    }


def _paired(variants: dict, rounds: int, inner: int) -> dict:
    for f in variants.values():  # warm up (compiles, pools)
        f()
        f()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            t = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t) / inner)
    return {k: round(float(np.median(v)) * 1e6, 2) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    import torch

    load = os.getloadavg()  # a shared machine: the timings are only as steady as this
    rng = np.random.default_rng(0)
    rows = []
    for n, d in SHAPES:
        x = rng.standard_normal((n, d)).astype(np.float32)
        w = rng.standard_normal(d).astype(np.float32)
        inner = max(1, 2_000_000 // (n * d))
        us = _paired(_variants(x, w), args.rounds, inner)
        rows.append({"tokens": n, "d": d, "dtype": "float32", "us": us,
                     "split_over_unsplit": round(us["split"] / us["unsplit"], 3),
                     "split_over_torch_split": round(us["split"] / us["torch_split"], 3)})
    result = {
        "suite": "split",
        "date": "2026-12-06",
        "device": "cpu",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_before": [round(v, 2) for v in load],
        "command": "python bench/split.py --out bench/results/split-2026-12-06-cpu.json",
        "note": "median over paired rounds, microseconds per call; one shard (no collective)",
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
