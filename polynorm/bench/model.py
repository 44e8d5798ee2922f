"""Launch model of the CUDA kernels: the bandwidth each GPU bench case can reach, before a GPU.

For every case of :func:`polynorm.bench.gpu_cases.cases` (or the headline ones) and each device
of :data:`DEVICES`, the launch the cupy backend makes (:mod:`polynorm.backends.cuda.launch`)
is combined with the kernel's machine-code figures (registers and 16-byte loads in flight
per thread -- LDG.E.128, or cp.async copies where the kernel stages rows in shared memory --
from a ``bench/sass_report.py --out`` JSON: ptxas register counts of the NVRTC cubins) into:

* theoretical occupancy (resident warps / the SM's maximum, as :func:`sass.occupancy`);
* bytes in flight per SM: resident threads x loads in flight x 16 B, where the grid fills
  an SM only as far as it has blocks (8 rows of one block each use 8 SMs);
* the bandwidth bound they imply by Little's law, ``in flight x SMs used / latency``,
  capped by the device's DRAM bandwidth, and the bytes the kernel moves beyond the op's
  own (pn_*_big re-reading chunks that did not fit in shared memory, the backward's
  dweight/dbias partial rows and their reduction);
* ``frac``: the op's bytes over the predicted time, as a fraction of a device copy, taken
  to run at the DRAM bandwidth.

The latency is an assumed loaded DRAM latency per device (not measured here); the model
ignores instruction throughput, so it is an upper bound wherever the kernel is not
latency-bound.  ``python -m polynorm.bench.model`` (or ``bench/gpu.py --gpu-model``)
prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from polynorm.backends.cuda import launch as cl
from polynorm.bench import sass
from polynorm.bench.gpu_cases import cases, op_bytes


@dataclass(frozen=True)
class Device:
    name: str
    arch: str  # whose register counts are used (sm_89 runs sm_80's code figures)
    sms: int
    bandwidth: float  # DRAM bytes / s
    latency: float  # assumed loaded DRAM latency, seconds
    warps: int  # max resident warps per SM
    blocks: int  # max resident blocks per SM
    smem: int  # shared memory per SM (bytes)
    smem_block: int  # opt-in shared memory per block


#: data-sheet figures; latencies are assumptions of the model
DEVICES = (
    Device("H100", "sm_90", 132, 3.35e12, 750e-9, 64, 32, 228 * 1024, 227 * 1024),
    Device("H200", "sm_90", 132, 4.8e12, 750e-9, 64, 32, 228 * 1024, 227 * 1024),
    Device("A100", "sm_80", 108, 2.039e12, 650e-9, 64, 32, 164 * 1024, 163 * 1024),
    Device("L40S", "sm_80", 142, 0.864e12, 650e-9, 48, 24, 100 * 1024, 99 * 1024),
)

#: the cases the README quotes
HEADLINE = (("fwd", "bfloat16", 16384, 4096), ("bwd", "bfloat16", 16384, 4096),
            ("fwd", "bfloat16", 1 << 21, 128), ("bwd", "bfloat16", 1 << 21, 128),
            ("fwd", "bfloat16", 8, 262144), ("bwd", "bfloat16", 8, 262144))

DEFAULT_SASS = Path(__file__).resolve().parents[2] / "bench" / "results" / "sass-kernels.json"


def load_kernels(path: Path = DEFAULT_SASS) -> dict[tuple[str, str], dict]:
    """(arch, kernel name) -> {regs, ldg128_inflight, inflight, static_smem} from a sass_report JSON."""
    doc = json.loads(Path(path).read_text())
    return {(k["arch"], k["name"]): k for k in doc["kernels"]}


def _loads(k: dict) -> int:
    """16-byte loads in flight per thread: LDG.E.128 or cp.async copies, whichever is more
    (:mod:`polynorm.bench.sass`; reports without the cp.async count have LDG only)."""
    return max(1, k.get("inflight", k["ldg128_inflight"]))


def _occupancy(dev: Device, regs: int, block: int, dyn: int, static: int) -> tuple[int, str]:
    """Resident blocks per SM and the limiting resource."""
    lim = sass.LIMITS[dev.arch]
    warps = math.ceil(block / 32)
    by = {"warps": dev.warps // warps, "blocks": dev.blocks}
    per_warp = math.ceil(max(regs, 1) * 32 / lim["reg_unit"]) * lim["reg_unit"]
    by["registers"] = (lim["regs"] // per_warp) // warps
    smem = math.ceil((dyn + static) / lim["smem_unit"]) * lim["smem_unit"]
    by["shared"] = 0 if dyn + static - lim["reserved_smem"] > dev.smem_block else (
        dev.smem // smem if smem else dev.blocks)
    limiter = min(by, key=lambda k: by[k])
    return by[limiter], limiter


def predict(op: str, dtype: str, n: int, d: int, dev: Device, kernels: dict) -> dict:
    """The model's figures for one case on one device (see the module docstring)."""

    item = cl.ITEMSIZE[dtype]
    smem_cap = min(dev.smem_block, cl.DEFAULT_SMEM)
    if op == "bwd":
        la = cl.backward_launch(n, d, dtype, dtype, dtype, num_sms=dev.sms, max_smem=smem_cap)
    else:
        la = cl.forward_launch(n, d, dtype, dtype if op == "add" else None, dtype, dtype, max_smem=smem_cap)
    if la.slices:
        return _predict_split(op, dtype, n, d, dev, kernels, la)
    k = kernels[(dev.arch, la.name)]
    per_sm, limiter = _occupancy(dev, k["regs"], la.block, la.shared, k["static_smem"])
    occ = per_sm * math.ceil(la.block / 32) / dev.warps
    used_sms = min(dev.sms, la.grid)
    active = min(per_sm, math.ceil(la.grid / dev.sms)) if per_sm else 0
    inflight = active * la.block * _loads(k) * 16
    bound = min(dev.bandwidth, inflight * used_sms / dev.latency)
    # waves: a non-persistent grid's last wave leaves SMs idle
    slots = per_sm * dev.sms
    waves = la.grid / slots if slots else math.inf
    wave_eff = waves / math.ceil(waves) if waves >= 1 and not la.name.startswith("pn_bwd") else 1.0
    useful = op_bytes(op, dtype, n, d)
    moved = useful
    if la.big:  # chunks that did not fit in shared memory are read again
        vec = cl.VEC[dtype]
        moved += n * max(0, d // vec - la.stash) * vec * item * (2 if op == "bwd" else 1)
    if op == "bwd" and la.partial_rows:  # dweight + dbias partials written, then reduced
        moved += 2 * 2 * la.partial_rows * la.ldp * cl.ITEMSIZE[cl.compute_dtype(dtype)]
    seconds = moved / (bound * wave_eff) if bound else math.inf
    frac = useful / seconds / dev.bandwidth
    return {"op": op, "dtype": dtype, "n": n, "d": d, "device": dev.name, "kernel": la.name,
            "grid": la.grid, "block": la.block, "shared": la.shared, "regs": k["regs"],
            "inflight": _loads(k), "occupancy": round(occ, 4), "limiter": limiter,
            "sms_used": used_sms, "inflight_per_sm": inflight, "bound_gbps": round(bound / 1e9, 1),
            "moved_over_useful": round(moved / useful, 4), "frac": round(frac, 4)}


def _predict_split(op: str, dtype: str, n: int, d: int, dev: Device, kernels: dict, la: cl.Launch) -> dict:
    """:func:`predict` for a pn_*_split launch: its two phases in turn, each bound by its own
    bytes in flight.  Phase 1 reads the row (and writes h), phase 2 reads it again (counted
    as DRAM traffic although it is mostly an L2 hit) and writes the outputs and, in the
    backward, one dweight + dbias partial row per row."""

    a = n * d * cl.ITEMSIZE[dtype]
    useful = op_bytes(op, dtype, n, d)
    first = {"fwd": a, "add": 3 * a, "bwd": 2 * a}[op]
    second = {"fwd": 2 * a, "add": 2 * a, "bwd": 3 * a}[op] + (useful - {"fwd": 2, "add": 4, "bwd": 3}[op] * a)
    if op == "bwd" and la.partial_rows:
        second += 2 * la.partial_rows * la.ldp * cl.ITEMSIZE[cl.compute_dtype(dtype)]
    seconds, parts = 0.0, []
    for name, moved in ((la.name, first), (la.name2, second)):
        k = kernels[(dev.arch, name)]
        per_sm, limiter = _occupancy(dev, k["regs"], la.block, la.shared, k["static_smem"])
        active = min(per_sm, math.ceil(la.grid / dev.sms)) if per_sm else 0
        inflight = active * la.block * _loads(k) * 16
        used_sms = min(dev.sms, la.grid)
        bound = min(dev.bandwidth, inflight * used_sms / dev.latency)
        seconds += moved / bound if bound else math.inf
        parts.append((k, per_sm, limiter, inflight, bound, used_sms))
    if op == "bwd" and la.partial_rows:  # pn_colsum reads the partial rows back
        seconds += 2 * la.partial_rows * la.ldp * cl.ITEMSIZE[cl.compute_dtype(dtype)] / dev.bandwidth
    k, per_sm, limiter, inflight, _, used_sms = min(parts, key=lambda p: p[4])
    occ = per_sm * math.ceil(la.block / 32) / dev.warps
    return {"op": op, "dtype": dtype, "n": n, "d": d, "device": dev.name, "kernel": la.name,
            "grid": la.grid, "block": la.block, "shared": la.shared, "regs": k["regs"],
            "inflight": _loads(k), "occupancy": round(occ, 4), "limiter": limiter,
            "sms_used": used_sms, "inflight_per_sm": inflight,
            "bound_gbps": round((first + second) / seconds / 1e9, 1),
            "moved_over_useful": round((first + second) / useful, 4),
            "frac": round(useful / seconds / dev.bandwidth, 4)}


def table(rows: list[dict]) -> str:
    head = (f"{'case':28} {'dev':5} {'kernel':10} {'grid':>7} {'blk':>4} {'regs':>4} {'ld':>3} "
            f"{'occ%':>4} {'SMs':>4} {'KB/SM':>6} {'bound GB/s':>10} {'frac':>5}")
    lines = [head]
    for r in rows:
        case = f"{r['op']} {r['dtype']} {r['n']}x{r['d']}"
        lines.append(f"{case:28} {r['device']:5} {r['kernel'].split('<')[0]:10} {r['grid']:7d} {r['block']:4d} "
                     f"{r['regs']:4d} {r['inflight']:3d} {100 * r['occupancy']:4.0f} {r['sms_used']:4d} "
                     f"{r['inflight_per_sm'] / 1024:6.1f} {r['bound_gbps']:10.1f} {r['frac']:5.2f}")
    return "\n".join(lines)


def run(cases: list[tuple[str, str, int, int]] | None = None, devices: tuple[Device, ...] = DEVICES,
        sass_json: Path = DEFAULT_SASS) -> list[dict]:
    """Predictions for ``cases`` (default :data:`HEADLINE`) on ``devices``.

    >>> rows = run([("fwd", "bfloat16", 16384, 4096)], devices=DEVICES[1:2])
    >>> rows[0]["device"], 0 < rows[0]["frac"] <= 1
    ('H200', True)
    """
    kernels = load_kernels(sass_json)
    return [predict(*c, dev, kernels) for c in (cases or HEADLINE) for dev in devices]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polynorm.bench.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="every GPU bench case, not only the headline ones")
    p.add_argument("--sass", type=Path, default=DEFAULT_SASS, help="sass_report JSON (register counts)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)

    # the model covers the plain kernels' launches; the fusion cases are measured only
    modelled = [c for c in cases() if c[0] in ("fwd", "add", "bwd")]
    rows = run(modelled if args.all else None, sass_json=args.sass)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"devices": [d.__dict__ for d in DEVICES], "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
