"""Launch model of the CUDA kernels, calibrated on the H200 records: time per call, as a fraction of a copy.

What is modelled.  For a case (op, dtype, tokens, d) the dispatcher's launches
(:mod:`polynorm.backends.cuda.launch`: kernel, grid, block, shared memory) and the kernels'
machine-code figures (ptxas registers and 16-byte loads in flight per thread,
``bench/results/sass-kernels.json``) give each launch its shape: resident blocks per SM
(occupancy), waves of the grid over the SMs, rows (or row slices) per block iteration, row
iterations per block (the persistent backward grids loop), DRAM bytes and elements per
iteration, and rounds of loads per iteration (reported only: fitted with a latency per round,
that latency went to 0 and ``Z_f`` below took it).  The model predicts

* ``copy_kernel`` -- the kernels alone (their launches replayed back to back, as
  ``bench/gpu.py`` times them) as a fraction of a device copy of the same bytes: the
  quantity the kernels own;
* ``copy`` -- the end-to-end call (host planning included) as the same fraction;

from these terms (:class:`Params`; 26 numbers fitted on the records, 21 of them for the kernels, :func:`calibrate`):

* block iteration time ``t_iter = smax(Z_f, Na * b / B_sm, Na * e * c_f)``: the time one
  block takes for one row iteration (``Z_f``, per kernel family: its loads' latency plus the
  reduction, block barriers and double-precision epilogue that its own loads do not
  overlap) -- so an SM moves ``Na * b`` bytes per ``Z_f``, Little's law with the ``Na``
  resident blocks' bytes ``b`` in flight; the SM's share of DRAM bandwidth ``B_sm`` for those
  bytes; and the SM's instruction issue for ``e`` elements each at ``c_f`` seconds per
  element (the fusions' silu and element-wise loads make them issue-bound).  ``smax`` is a
  smooth maximum (p-norm);
* kernel time = the sum over the grid's waves
  (full waves with every resident slot busy, then the partial last wave with fewer blocks
  per SM: the tail effect) of ``iterations * t_iter``;
* the replayed launches are issued by a Python loop: a call's kernel time is at least
  ``launches * H_launch`` (the floor every small case sits on);
* the copy it is compared with: ``smax(H_copy, T0_copy + bytes / B_copy)``;
* end to end: ``smax(H_op, kernels)``, the host's time per call of the op (planning, casts,
  DLPack) overlapping the device's.

The parameters were fitted by least squares (soft-L1, i.e. close to the median absolute
error) of both fractions on the 364 records of ``bench/results/gpu-2026-12-04b-h200.json``;
:func:`holdout` refits on half of the shapes and reports the error on the other half.
``polynorm bench --gpu-model`` prints the error and the prediction beside each measurement;
``--json`` writes them (``bench/results/model-2026-12-06-h200.json``).

>>> p = predict("fwd", "bfloat16", 32768, 4096, rows=False)  # the launch measured on 12-04
>>> p["kernels"][0]["kernel"].split("<")[0], 0.3 < p["copy_kernel"] < 0.7
('pn_fwd', True)
>>> p = predict("fwd", "bfloat16", 32768, 4096)  # pn_fwd_rows: estimated numbers (ESTIMATED_Z/C)
>>> p["kernels"][0]["kernel"].split("<")[0], 0.7 < p["copy_kernel"] < 0.8
('pn_fwd_rows', True)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from polynorm.backends.cuda import launch as cl
from polynorm.bench import sass
from polynorm.bench.gpu_cases import op_bytes

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SASS = ROOT / "bench" / "results" / "sass-kernels.json"
RECORDS = ROOT / "bench" / "results" / "gpu-2026-12-04b-h200.json"
DEFAULT_JSON = ROOT / "bench" / "results" / "model-2026-12-06-h200.json"


@dataclass(frozen=True)
class Device:
    name: str
    arch: str  # whose register counts are used
    sms: int
    bandwidth: float  # DRAM bytes / s (data sheet)
    warps: int  # max resident warps per SM
    blocks: int  # max resident blocks per SM
    smem: int  # shared memory per SM (bytes)
    smem_block: int  # opt-in shared memory per block


H200 = Device("H200", "sm_90", 132, 4.8e12, 64, 32, 228 * 1024, 227 * 1024)

#: kernel families: the part of the name before '<', split kernels by phase
FAMILIES = ("fwd", "fwd_small", "fwd_big", "fwd_split", "bwd", "bwd_small", "bwd_big", "bwd_split",
            "colsum", "gated", "quant", "fwd_rows", "bwd_rows", "gated_rows", "quant_rows")


@dataclass(frozen=True)
class Params:
    """The model's fitted numbers (seconds, bytes/s).  ``z``: per-family time of one row
    iteration of a block when neither bound below binds (the latency Little's law divides
    the bytes in flight by); ``c``: per-family issue time per element per SM (families
    without an entry never reach an issue bound)."""

    bw: float  # B: DRAM bandwidth the kernels reach (B_sm = B / SMs)
    host_launch: float  # H_launch: the replay loop's host time per launch
    copy_host: float  # H_copy: the copy's host floor
    copy_launch: float  # T0_copy: the copy's device time beyond bytes / B_copy
    copy_bw: float  # B_copy
    p: float  # smooth-max exponent
    z: dict  # family -> Z_f
    c: dict  # family -> c_f
    host_op: dict  # op -> H_op (end to end only)

    def count(self) -> int:
        """How many numbers were fitted."""
        return 6 + len(self.z) + len(self.c) + len(self.host_op)


#: the families with a fixed iteration time / an issue bound (the others' fits went to 0)
Z_FAMILIES = ("fwd", "fwd_small", "fwd_big", "fwd_split", "bwd", "bwd_small", "bwd_big", "bwd_split", "gated")
C_FAMILIES = ("fwd", "fwd_big", "bwd", "bwd_big", "gated", "quant")
OPS = ("fwd", "add", "bwd", "gated", "quant")

# fitted by `python -m polynorm.bench.model --fit` on RECORDS (calibrate); pasted here
PARAMS = Params(
    bw=4.215e12, host_launch=1.290e-05, copy_host=6.478e-06, copy_launch=2.285e-07, copy_bw=4.214e12, p=2.399,
    z={"fwd": 2.175e-06, "fwd_small": 2.412e-06, "fwd_big": 3.142e-06, "fwd_split": 3.488e-06,
       "bwd": 1.806e-06, "bwd_small": 4.350e-06, "bwd_big": 3.072e-06, "bwd_split": 4.177e-06,
       "gated": 2.407e-06},
    c={"fwd": 1.737e-10, "fwd_big": 3.109e-10, "bwd": 3.152e-10, "bwd_big": 7.964e-10, "gated": 8.178e-10,
       "quant": 6.479e-10},
    host_op={"fwd": 1.403e-04, "add": 1.538e-04, "bwd": 1.900e-04, "gated": 2.816e-04, "quant": 3.498e-04},
)

#: families not yet measured: their numbers are ESTIMATES, not fitted (see ESTIMATE_NOTES);
#: launch_time uses them where PARAMS has no entry
ESTIMATED_Z = {"fwd_rows": 2.175e-06, "bwd_rows": 2.175e-06, "gated_rows": 2.407e-06, "quant_rows": 2.175e-06}
ESTIMATED_C = {"fwd_rows": 1.095e-10, "bwd_rows": 1.992e-10, "gated_rows": 2.418e-10, "quant_rows": 2.588e-10}
#: the SASS figures the estimates rest on (sm_90, static instructions per kernel / elements per
#: thread of one row iteration); filled from polynorm.bench.sass
ESTIMATE_SASS: dict = {
    "method": ("static sm_90 SASS instructions (NOPs left out) of the vector twin without the exact "
               "fallback, per element a thread (lane) holds; c_rows = c_fwd x per_element(rows 2,4) / "
               "per_element(pn_fwd 2)"),
    "kernels": {
        "pn_fwd<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 2>":
            {"instructions": 1504, "fp64": 129, "elements_per_thread": 16, "per_element": 94.0, "fp64_per_element": 8.06},
        "pn_fwd_rows<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 2, 4>":
            {"instructions": 3794, "fp64": 164, "elements_per_thread": 64, "per_element": 59.28, "fp64_per_element": 2.56},
        "pn_fwd_rows<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, 8>":
            {"instructions": 3895, "fp64": 188, "elements_per_thread": 64, "per_element": 60.86, "fp64_per_element": 2.94},
        "pn_fwd<float, float, float, float, 2>":
            {"instructions": 955, "fp64": 129, "elements_per_thread": 8, "per_element": 119.38, "fp64_per_element": 16.12},
        "pn_fwd_rows<float, float, float, float, 2, 4>":
            {"instructions": 1647, "fp64": 171, "elements_per_thread": 32, "per_element": 51.47, "fp64_per_element": 5.34},
    },
    "ratio": 0.6306,
    # the fusions on the rows body: twin_instructions() (sm_90), each kernel's benchmarked case
    # compiled alone; c = c_fwd_rows x per_element(kernel) / per_element(pn_fwd_rows), bfloat16
    "fusions": {
        "method": ("static sm_90 SASS instructions (NOPs left out) of the benchmarked case's twin compiled "
                   "alone (model.twin_instructions: 16-byte loads, exact fallback kept, quant's dynamic-scale "
                   "path kept), per element a lane holds; c_f = c_fwd_rows x per_element(f) / "
                   "per_element(pn_fwd_rows<bf16, 2, 4>), bfloat16 twins"),
        "kernels": {
            "pn_fwd_rows<bf16, 2, 4> fwd": {"instructions": 2584, "fp64": 359, "elements_per_thread": 64,
                                            "per_element": 40.38, "fp64_per_element": 5.61},
            "pn_gated_rows<bf16, 2, 2> nbg=False": {"instructions": 2853, "fp64": 239, "elements_per_thread": 32,
                                                    "per_element": 89.16, "fp64_per_element": 7.47},
            "pn_quant_rows<bf16, 1, 2, 2> res static": {"instructions": 3054, "fp64": 239,
                                                        "elements_per_thread": 32, "per_element": 95.44,
                                                        "fp64_per_element": 7.47},
            "pn_fwd_rows<float, 2, 4> fwd": {"instructions": 1464, "fp64": 263, "elements_per_thread": 32,
                                             "per_element": 45.75, "fp64_per_element": 8.22},
            "pn_gated_rows<float, 2, 2> nbg=False": {"instructions": 1842, "fp64": 191, "elements_per_thread": 16,
                                                     "per_element": 115.12, "fp64_per_element": 11.94},
            "pn_quant_rows<float, 1, 2, 2> res static": {"instructions": 1922, "fp64": 191,
                                                         "elements_per_thread": 16, "per_element": 120.12,
                                                         "fp64_per_element": 11.94},
        },
        "ratios": {"gated_rows": 2.208, "quant_rows": 2.364},
    },
}
#: the SASS figures pn_bwd_rows' estimate rests on (sm_90, static instructions without NOPs of the
#: whole kernel: both twins, both trees for pn_bwd_rows, the exact fallbacks)
ESTIMATE_SASS_BWD: dict = {
    "method": ("static sm_90 SASS instructions (NOPs left out) of the whole kernel per element a lane holds "
               "in one row iteration; pn_bwd_rows carries pn_bwd's and pn_bwd_big's trees (one runs), so "
               "its count is halved; c_bwd_rows = c_bwd x per_element(rows 1,2) / per_element(pn_bwd)"),
    "kernels": {
        "pn_bwd<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, true, false>":
            {"instructions": 2293, "fp64": 244, "elements_per_thread": 8, "per_element": 286.6},
        "pn_bwd_big<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>":
            {"instructions": 2963, "fp64": 444},
        "pn_bwd_rows<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1, 2, true, false>":
            {"instructions": 5797, "fp64": 932, "elements_per_thread": 16, "per_element": 181.2},
        "pn_bwd<float, float, float, 1, true, false>":
            {"instructions": 1770, "fp64": 215, "elements_per_thread": 4, "per_element": 442.5},
        "pn_bwd_rows<float, float, float, 1, 4, true, false>":
            {"instructions": 5740, "fp64": 1032, "elements_per_thread": 16, "per_element": 179.4},
    },
    "ratio": 0.632,
}
ESTIMATE_NOTES = {
    "bwd_rows.z": "pn_fwd's fitted Z_f (2.175 us), not pn_bwd's (1.806 us, which its row ring of cp.async "
                  "copies S - 1 rows ahead lowers): a pn_bwd_rows block iteration issues one row group's "
                  "loads, waits, runs two or three row sums (block barriers for R > 1) and stores, with no "
                  "prefetch of the next group; an estimate, not a fit",
    "bwd_rows.c": "pn_bwd's fitted c_f (3.152e-10 s per element per SM) scaled by the static SASS "
                  "instructions per element of a lane (bfloat16; see ESTIMATE_SASS_BWD); an estimate, "
                  "not a fit",
    "gated_rows.z": "pn_gated_fwd's fitted Z_f (2.407 us): one segment group per block through the rows "
                    "body's chain (loads, silu, float runs, butterflies, one double epilogue, y); an estimate",
    "gated_rows.c": "pn_fwd_rows' estimated c (1.095e-10) x 2.208, the static SASS instructions per element "
                    "of pn_gated_rows' benchmarked twin over pn_fwd_rows' (ESTIMATE_SASS['fusions']); an "
                    "estimate, not a fit",
    "quant_rows.z": "pn_fwd's fitted Z_f (2.175 us), as pn_fwd_rows' (pn_quant_fwd's own fit went to 0); an "
                    "estimate",
    "quant_rows.c": "pn_fwd_rows' estimated c x 2.364 (pn_quant_rows' twin over pn_fwd_rows': the division "
                    "and encoding per element); an estimate, not a fit",
    "fwd_rows.z": "pn_fwd's fitted Z_f (2.175 us): one row group per block goes through the same "
                  "chain (loads, float runs, butterflies, one double epilogue, weight, y, store), "
                  "with block barriers only for R > 1; an estimate, not a fit",
    "fwd_rows.c": "pn_fwd's fitted c_f (1.737e-10 s per element per SM) scaled by the static SASS "
                  "instructions per element of a lane (sm_90, both twins and the exact fallback "
                  "counted as pn_fwd's are): see ESTIMATE_SASS; an estimate, not a fit",
}

#: the benchmarked case of each rows-body kernel compiled alone (one twin: 16-byte loads,
#: the benchmark's optional arrays as null or not): name -> (elements a lane holds, the call
#: inside a wrapper kernel whose arguments are x, a, o, w, rstd, s, n, d, k, shape, eps)
TWINS = {
    "pn_fwd_rows<bf16, 2, 4> fwd": (64, "pn_fwd_rows_body<B, B, B, B, 2, 4, true>(x, d, (const B*)nullptr, d, "
                                        "(B*)nullptr, d, w, (const float*)nullptr, o, d, rstd, n, d, k, shape, "
                                        "eps, 1, 0.0, 0, pn_layout<8>(x, d, n, d), red)"),
    "pn_gated_rows<bf16, 2, 2> nbg=False": (32, "pn_gated_rows_body<B, B, 2, 2, true, false>(x, d, a, d, wf, "
                                                "(const float*)nullptr, o, d, rstd, n, d, d, k, shape, eps, 1, "
                                                "0.0, red)"),
    "pn_quant_rows<bf16, 1, 2, 2> res static": (32, "pn_quant_rows_body<B, 1, 2, 2, true>(x, d, a, d, o, d, wf, "
                                                    "(const float*)nullptr, q, d, (float*)nullptr, s, n, d, k, "
                                                    "shape, eps, 1, 0.0, 0, red, mx)"),
    "pn_fwd_rows<float, 2, 4> fwd": (32, "pn_fwd_rows_body<F, F, F, F, 2, 4, true>(xf, d, (const F*)nullptr, d, "
                                         "(F*)nullptr, d, wf, (const float*)nullptr, of, d, rstd, n, d, k, shape, "
                                         "eps, 1, 0.0, 0, pn_layout<4>(xf, d, n, d), red)"),
    "pn_gated_rows<float, 2, 2> nbg=False": (16, "pn_gated_rows_body<F, F, 2, 2, true, false>(xf, d, af, d, wf, "
                                                 "(const float*)nullptr, of, d, rstd, n, d, d, k, shape, eps, 1, "
                                                 "0.0, red)"),
    "pn_quant_rows<float, 1, 2, 2> res static": (16, "pn_quant_rows_body<F, 1, 2, 2, true>(xf, d, af, d, of, d, wf, "
                                                     "(const float*)nullptr, q, d, (float*)nullptr, s, n, d, k, "
                                                     "shape, eps, 1, 0.0, 0, red, mx)"),
}


def twin_instructions(arch: str = "sm_90") -> dict:
    """Static SASS instructions (NOPs left out) and FP64-pipe instructions of each of
    :data:`TWINS`, per element a lane holds: how ESTIMATE_SASS's fusion numbers were obtained
    (needs NVRTC and cuobjdump).  The twins keep the exact fallback and, for the quantized
    forward, the dynamic-scale path (a runtime pointer decides)."""
    import subprocess
    import tempfile

    from cuda.bindings import nvrtc

    from polynorm.backends.cuda import nvrtc as _nv

    wrap = ["typedef __nv_bfloat16 B; typedef float F;"]
    for i, (_, (_, call)) in enumerate(TWINS.items()):
        wrap.append(
            f'extern "C" __global__ void __launch_bounds__({cl.ROWS_THREADS}, 2) pn_twin_{i}('
            "const B* x, const B* a, B* o, const B* w, const F* xf, const F* af, F* of, const float* wf, "
            "unsigned char* q, const float* s, float* rstd, long long n, int d, int k, int shape, double eps) {"
            f" __shared__ double red[{cl.ROWS_RED}]; __shared__ unsigned mx[{cl.ROWS_THREADS // 32}]; {call}; }}")
    src = cl.source() + "\n" + "\n".join(wrap) + "\n"
    prog = _nv._check(nvrtc.nvrtcCreateProgram(src.encode(), b"twins.cu", 0, [], []))
    try:
        opts = [*_nv.OPTIONS, f"--gpu-architecture={arch}", *(f"-I{d}" for d in cl.include_dirs())]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = _nv._check(nvrtc.nvrtcGetProgramLogSize(prog))
            buf = b" " * size
            _nv._check(nvrtc.nvrtcGetProgramLog(prog, buf))
            raise RuntimeError(buf.decode(errors="replace"))
        size = _nv._check(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _nv._check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    exe = sass.find_cuobjdump()
    if exe is None:
        raise RuntimeError("cuobjdump not found")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "twins.cubin"
        path.write_bytes(cubin)
        funcs = sass.split_functions(subprocess.run([exe, "-sass", str(path)], capture_output=True, text=True,
                                                    check=True).stdout)
    out = {}
    for i, (label, (elems, _)) in enumerate(TWINS.items()):
        ins = [t for t in funcs[f"pn_twin_{i}"] if not t.startswith("NOP")]
        fp64 = sass.fp64_count(ins)
        out[label] = {"instructions": len(ins), "fp64": fp64, "elements_per_thread": elems,
                      "per_element": round(len(ins) / elems, 2), "fp64_per_element": round(fp64 / elems, 2)}
    return out


HEADLINE = (("fwd", "bfloat16", 32768, 4096), ("add", "bfloat16", 32768, 4096),
            ("bwd", "bfloat16", 32768, 4096), ("fwd", "bfloat16", 4096, 16384),
            ("bwd", "bfloat16", 32768, 8192), ("gated", "bfloat16", 32768, 4096),
            ("quant", "bfloat16", 32768, 4096), ("fwd", "bfloat16", 1 << 21, 128),
            ("bwd", "bfloat16", 1 << 21, 128), ("fwd", "bfloat16", 8, 262144))


_QUANT_FORMAT = re.compile(r"^(pn_quant_fwd<[^,]+), ([012])>$")


def recorded_name(name: str) -> str:
    """The name ``name`` had in the committed SASS report and records: the quantized
    forward then took ``bool fp8`` where it now takes a format code (0 int8, 1 e4m3fn,
    2 e5m2, which runs the e4m3fn kernel's code with other constants).

    >>> recorded_name("pn_quant_fwd<__half, 2>"), recorded_name("pn_fwd<float, float, float, float, 1>")
    ('pn_quant_fwd<__half, true>', 'pn_fwd<float, float, float, float, 1>')
    """
    m = _QUANT_FORMAT.match(name)
    return f"{m.group(1)}, {'false' if m.group(2) == '0' else 'true'}>" if m else name


def load_kernels(path: Path = DEFAULT_SASS) -> dict[tuple[str, str], dict]:
    """(arch, kernel name) -> {regs, inflight, static_smem, ...} from a sass_report JSON."""
    doc = json.loads(Path(path).read_text())
    return {(k["arch"], k["name"]): k for k in doc["kernels"]}


def occupancy(dev: Device, regs: int, block: int, dyn: int, static: int) -> tuple[int, str]:
    """Resident blocks per SM and the limiting resource (as :func:`sass.occupancy`)."""
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


# ------------------------------------------------------------------ the launches of a case


def family(name: str) -> str:
    base = name.split("<")[0][3:]  # drop "pn_"
    return {"gated_fwd": "gated", "quant_fwd": "quant"}.get(base, base)


@dataclass(frozen=True)
class Shape:
    """One launch as the model sees it."""

    kernel: str
    family: str
    grid: int
    block: int
    shared: int
    regs: int
    per_sm: int  # resident blocks per SM
    iters: int  # row iterations per block
    rounds: int  # rounds of loads per iteration (16-byte loads in flight per thread); reported only
    bytes_iter: float  # DRAM bytes per block iteration
    elems_iter: float  # elements per block iteration


def launches(op: str, dtype: str, n: int, d: int, dev: Device = H200,
             kernels: dict | None = None, rows: bool = True) -> list[Shape]:
    """The launches the cupy backend makes for the case, described for the model
    (``rows=False``: the forward's launches without pn_fwd_rows, as measured on 12-04)."""
    kernels = kernels if kernels is not None else _kernels()
    item = cl.ITEMSIZE[dtype]
    vec = cl.VEC[dtype]
    smem_cap = dev.smem_block
    ct = cl.ITEMSIZE[cl.compute_dtype(dtype)]
    out: list[Shape] = []

    def shape(name, grid, block, shared, iters, rounds, bytes_iter, elems_iter):
        k = kernels[(dev.arch, recorded_name(name))]
        per_sm, _ = occupancy(dev, k["regs"], block, shared, k["static_smem"])
        out.append(Shape(name, family(name), grid, block, shared, k["regs"], per_sm, iters,
                         rounds, bytes_iter, elems_iter))

    def loads(k_name: str) -> int:
        return max(1, kernels[(dev.arch, recorded_name(k_name))].get("inflight", 1))

    arrays = {"fwd": 2, "add": 4, "bwd": 3, "gated": 3}  # token-sized arrays moved
    if op in ("fwd", "add"):
        la = cl.forward_launch(n, d, dtype, dtype if op == "add" else None, dtype, dtype,
                               max_smem=smem_cap, num_sms=dev.sms, rows=rows, has_res=op == "add")
        row = arrays[op] * d * item
        if la.name.startswith("pn_fwd_rows"):  # rows per block = block / (32 * warps per row)
            rpb = la.block // (32 * cl.rows_shape(la.tpr)[2])
            shape(la.name, la.grid, la.block, 0, 1, 1, rpb * row, rpb * d)
        elif la.slices:  # two phases over (row, slice) blocks; phase 2 re-reads the slice
            span = d / la.slices
            cpt = math.ceil(span / vec / la.block)
            first = (1 if op == "fwd" else 3) * span * item
            shape(la.name, la.grid, la.block, 0, 1, math.ceil(cpt / loads(la.name)), first, span)
            second = (2 if op == "fwd" else 2) * span * item
            shape(la.name2, la.grid, la.block, 0, 1, math.ceil(cpt / loads(la.name2)), second, span)
        elif la.big:  # one row per block, two passes; chunks beyond the stash read again
            cpt = math.ceil(d / vec / la.block)
            reread = max(0, d // vec - la.stash) * vec * item
            shape(la.name, la.grid, la.block, la.shared, 1, 2 * math.ceil(cpt / loads(la.name)),
                  row + reread, d)
        else:
            rows = la.block // la.tpr
            shape(la.name, la.grid, la.block, la.shared, 1, 1, rows * row, rows * d)
    elif op == "bwd":
        la = cl.backward_launch(n, d, dtype, dtype, dtype, num_sms=dev.sms, max_smem=smem_cap, rows=rows)
        row = arrays[op] * d * item
        part = la.partial_rows * la.ldp * ct
        if la.name.startswith("pn_bwd_rows"):  # persistent: row groups of block / (32 * R) rows
            rpb = la.block // (32 * cl.rows_shape(la.tpr)[2])
            iters = math.ceil(n / (la.grid * rpb))
            shape(la.name, la.grid, la.block, la.shared, iters, 1,
                  rpb * row + part / max(1, iters * la.grid), rpb * d)
        elif la.slices:
            span = d / la.slices
            cpt = math.ceil(span / vec / la.block)
            shape(la.name, la.grid, la.block, 0, 1, math.ceil(cpt / loads(la.name)), 2 * span * item, span)
            shape(la.name2, la.grid, la.block, 0, 1, math.ceil(cpt / loads(la.name2)),
                  3 * span * item + part / la.grid, span)
        elif la.big:  # persistent: grid blocks loop over the rows
            cpt = math.ceil(d / vec / la.block)
            reread = max(0, d // vec - la.stash) * vec * 2 * item
            iters = math.ceil(n / la.grid)
            shape(la.name, la.grid, la.block, la.shared, iters, 2 * math.ceil(cpt / loads(la.name)),
                  row + reread + part / max(1, n), d)
        else:
            rows = la.block // la.tpr
            iters = math.ceil(n / (la.grid * rows))
            shape(la.name, la.grid, la.block, la.shared, iters, 1,
                  rows * row + part / max(1, iters * la.grid) * 1.0, rows * d)
        cs = cl.colsum_launch(d, cl.compute_dtype(dtype), dtype)
        # pn_colsum: each block sums 32 columns over the partial rows
        shape(cs.name, cs.grid, cs.block, 0, 1, math.ceil(la.partial_rows * 32 / cs.block),
              la.partial_rows * 32 * ct, la.partial_rows * 32)
    elif op in ("gated", "quant"):
        if op == "gated":
            la = cl.gated_forward_launch(n, d, d, dtype, rows=rows, num_sms=dev.sms)
        else:
            la = cl.quant_launch(n, d, dtype, group_size=d, rows=rows, num_sms=dev.sms)
        row = (3 * d * item) if op == "gated" else (3 * d * item + d)
        if la.name.startswith(("pn_gated_rows", "pn_quant_rows")):  # segments per block = block / (32 R)
            rpb = la.block // (32 * cl.rows_shape(la.tpr)[2])
            shape(la.name, la.grid, la.block, 0, 1, 1, rpb * row, rpb * d)
        else:
            rows = la.block // la.tpr
            cpt = math.ceil(d / vec / la.tpr)
            shape(la.name, la.grid, la.block, 0, 1, 2 * math.ceil(cpt / loads(la.name)), rows * row, rows * d)
    else:
        raise ValueError(f"op must be one of fwd, add, bwd, gated, quant, not {op!r}")
    return out


_KERNELS: dict | None = None


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = load_kernels()
    return _KERNELS


# ------------------------------------------------------------------ the time model


def smax(vals: list[float], p: float) -> float:
    """Smooth maximum: the p-norm of ``vals`` (max as p grows)."""
    top = max(vals)
    return top * sum((v / top) ** p for v in vals) ** (1.0 / p) if top > 0 else 0.0


def launch_time(s: Shape, prm: Params, dev: Device = H200) -> float:
    """Device seconds of one launch (see the module docstring)."""
    z = prm.z.get(s.family, ESTIMATED_Z.get(s.family, 0.0))
    c = prm.c.get(s.family, ESTIMATED_C.get(s.family, 0.0))
    b_sm = prm.bw / dev.sms
    per_sm = max(1, s.per_sm)

    def t_iter(na: int) -> float:
        return smax([z, na * s.bytes_iter / b_sm, na * s.elems_iter * c], prm.p)

    slots = per_sm * dev.sms
    full, rest = divmod(s.grid, slots)
    t = full * s.iters * t_iter(per_sm)
    if rest:
        t += s.iters * t_iter(math.ceil(rest / dev.sms))
    return t


def copy_time(nbytes: int, prm: Params) -> float:
    return smax([prm.copy_host, prm.copy_launch + nbytes / prm.copy_bw], prm.p)


def predict(op: str, dtype: str, n: int, d: int, prm: Params = PARAMS, dev: Device = H200,
            kernels: dict | None = None, rows: bool = True) -> dict:
    """Predicted kernel and end-to-end seconds and fractions of a copy for one case.

    >>> p = predict("add", "bfloat16", 32768, 4096)
    >>> [k["kernel"].split("<")[0] for k in p["kernels"]], p["copy_kernel"] > p["copy"]
    (['pn_fwd_rows'], True)
    """
    shapes = launches(op, dtype, n, d, dev, kernels, rows)
    dev_t = sum(launch_time(s, prm, dev) for s in shapes)
    kern = smax([len(shapes) * prm.host_launch, dev_t], prm.p)
    e2e = smax([prm.host_op[op], kern], prm.p)
    t_copy = copy_time(op_bytes(op, dtype, n, d), prm)
    return {"op": op, "dtype": dtype, "tokens": n, "d": d,
            "kernels": [{"kernel": s.kernel, "grid": s.grid, "block": s.block, "shared": s.shared,
                         "per_sm": s.per_sm, "iters": s.iters, "rounds": s.rounds,
                         "seconds": launch_time(s, prm, dev)} for s in shapes],
            "device_seconds": dev_t, "kernel_seconds": kern, "seconds": e2e, "copy_seconds": t_copy,
            "copy_kernel": t_copy / kern, "copy": t_copy / e2e}


# ------------------------------------------------------------------ the records, the error, the fit


def load_records(path: Path = RECORDS) -> list[dict]:
    """The GPU benchmark's records (``bench/gpu.py`` JSON) that have a kernel time."""
    recs = json.loads(Path(path).read_text())["records"]
    return [r for r in recs if "copy_kernel" in r["ratios"] and "kernel_seconds" in r["extra"]]


def _rows_record(r: dict) -> bool:
    """Whether a record ran a rows-body kernel (records before them: the launches then)."""
    return any(k.startswith(("pn_fwd_rows", "pn_bwd_rows", "pn_gated_rows", "pn_quant_rows"))
               for k in r["extra"].get("launches", []))


def compare(records: list[dict], prm: Params = PARAMS, kernels: dict | None = None) -> list[dict]:
    """Prediction beside measurement for each record (its case and launches)."""
    kernels = kernels if kernels is not None else _kernels()
    rows = []
    for r in records:
        p = predict(r["op"], r["dtype"], r["tokens"], r["d"], prm, kernels=kernels, rows=_rows_record(r))
        e = r["extra"]
        rows.append({"op": r["op"], "dtype": r["dtype"], "tokens": r["tokens"], "d": r["d"],
                     "kernel": e["kernel"], "grid": e["grid"], "block": e["block"], "shared": e["shared"],
                     "launches": len(e["launches"]),
                     "launch_matches": [recorded_name(k["kernel"]) for k in p["kernels"]] == e["launches"]
                     and (p["kernels"][0]["grid"], p["kernels"][0]["block"], p["kernels"][0]["shared"])
                     == (e["grid"], e["block"], e["shared"]),
                     "copy_kernel": round(r["ratios"]["copy_kernel"], 4), "pred_copy_kernel": round(p["copy_kernel"], 4),
                     "copy": round(r["ratios"]["copy"], 4), "pred_copy": round(p["copy"], 4),
                     "kernel_us": round(e["kernel_seconds"] * 1e6, 2), "pred_kernel_us": round(p["kernel_seconds"] * 1e6, 2)})
    return rows


def _q(vals: list[float], f: float) -> float:
    v = sorted(vals)
    return v[min(len(v) - 1, int(f * len(v)))]


def errors(rows: list[dict]) -> dict:
    """Median and 90th percentile of |prediction - measurement|, overall and per op."""

    def summ(sub: list[dict]) -> dict:
        out = {"n": len(sub)}
        for key in ("copy_kernel", "copy"):
            err = [abs(r[f"pred_{key}"] - r[key]) for r in sub]
            out[key] = {"median": round(statistics.median(err), 4), "p90": round(_q(err, 0.9), 4)}
        return out

    res = {"all": summ(rows)}
    for op in OPS:
        sub = [r for r in rows if r["op"] == op]
        if sub:
            res[op] = summ(sub)
    return res


def _pack(prm: Params) -> list[float]:
    return ([math.log(getattr(prm, f.name)) for f in fields(Params) if f.name not in ("z", "c", "host_op")]
            + [math.log(prm.z[f]) for f in Z_FAMILIES] + [math.log(prm.c[f]) for f in C_FAMILIES]
            + [math.log(prm.host_op[o]) for o in OPS])


def _unpack(x: list[float]) -> Params:
    names = [f.name for f in fields(Params) if f.name not in ("z", "c", "host_op")]
    g = {k: math.exp(v) for k, v in zip(names, x[:len(names)], strict=True)}
    i = len(names)
    z = {f: math.exp(x[i + j]) for j, f in enumerate(Z_FAMILIES)}
    i += len(Z_FAMILIES)
    c = {f: math.exp(x[i + j]) for j, f in enumerate(C_FAMILIES)}
    i += len(C_FAMILIES)
    return Params(**g, z=z, c=c, host_op={o: math.exp(x[i + j]) for j, o in enumerate(OPS)})


def calibrate(records: list[dict], start: Params = PARAMS, time_weight: float = 0.1) -> Params:
    """Least squares (soft L1, scale 0.02: close to the median absolute error) of both
    fractions of a copy, plus ``time_weight`` x the log of predicted over measured seconds
    (kernels, end to end, copy) so that the times, not only their ratios, are physical.
    Needs scipy."""
    import numpy as np
    from scipy.optimize import least_squares

    kernels = _kernels()
    shapes = [launches(r["op"], r["dtype"], r["tokens"], r["d"], kernels=kernels, rows=_rows_record(r))
              for r in records]
    x0 = _pack(start)
    ip = [f.name for f in fields(Params)].index("p")

    def res(x):
        prm = _unpack(x)
        out = []
        for r, sh in zip(records, shapes, strict=True):
            dev_t = sum(launch_time(s, prm) for s in sh)
            kern = smax([len(sh) * prm.host_launch, dev_t], prm.p)
            e2e = smax([prm.host_op[r["op"]], kern], prm.p)
            tc = copy_time(r["bytes"], prm)
            mt = r["seconds"]
            out += [tc / kern - r["ratios"]["copy_kernel"], tc / e2e - r["ratios"]["copy"],
                    time_weight * math.log(kern / r["extra"]["kernel_seconds"]),
                    time_weight * math.log(e2e / mt), time_weight * math.log(tc / (r["ratios"]["copy"] * mt))]
        return np.array(out)

    lb, ub = [-np.inf] * len(x0), [np.inf] * len(x0)
    lb[ip], ub[ip] = 0.0, math.log(30.0)
    x0[ip] = min(max(x0[ip], 0.01), math.log(29.0))
    fit = least_squares(res, x0, bounds=(lb, ub), loss="soft_l1", f_scale=0.02, max_nfev=2000)
    return _unpack(list(fit.x))


def holdout(records: list[dict], start: Params = PARAMS) -> dict:
    """Fit on half of the (tokens, d) shapes (every other one, sorted), report the error on
    the other half; and the other way round."""
    shapes = sorted({(r["tokens"], r["d"]) for r in records})
    halves = (set(shapes[0::2]), set(shapes[1::2]))
    out = {}
    for name, fit_on in zip(("A", "B"), halves, strict=True):
        a = [r for r in records if (r["tokens"], r["d"]) in fit_on]
        b = [r for r in records if (r["tokens"], r["d"]) not in fit_on]
        prm = calibrate(a, start)
        out[f"fit on {name}"] = {"shapes": sorted(fit_on), "fitted": errors(compare(a, prm))["all"],
                                 "held out": errors(compare(b, prm))}
    return out


# ------------------------------------------------------------------ report


def table(rows: list[dict]) -> str:
    head = (f"{'case':26} {'kernel':13} {'grid':>6} {'blk':>4} {'L':>1} | {'kernel-only copy':>16} | "
            f"{'end-to-end copy':>15} | {'kernel us':>17}")
    sub = f"{'':26} {'':13} {'':>6} {'':>4} {'':>1} | {'meas':>7} {'pred':>8} | {'meas':>6} {'pred':>8} | {'meas':>8} {'pred':>8}"
    lines = [head, sub]
    for r in rows:
        case = f"{r['op']} {r['dtype']} {r['tokens']}x{r['d']}"
        lines.append(f"{case:26} {r['kernel'].split('<')[0]:13} {r['grid']:6d} {r['block']:4d} {r['launches']:1d} | "
                     f"{r['copy_kernel']:7.3f} {r['pred_copy_kernel']:8.3f} | {r['copy']:6.3f} {r['pred_copy']:8.3f} | "
                     f"{r['kernel_us']:8.1f} {r['pred_kernel_us']:8.1f}")
    return "\n".join(lines)


def error_lines(err: dict) -> str:
    lines = [f"{'':6} {'n':>4}  copy_kernel |err| median / p90   copy |err| median / p90"]
    for k, v in err.items():
        lines.append(f"{k:6} {v['n']:4d}  {v['copy_kernel']['median']:8.3f} / {v['copy_kernel']['p90']:.3f}"
                     f"{'':18}{v['copy']['median']:8.3f} / {v['copy']['p90']:.3f}")
    return "\n".join(lines)


def predictions(cases: list[tuple[str, str, int, int]], prm: Params = PARAMS) -> list[dict]:
    """Predicted fractions for cases without a measurement (e.g. new launches)."""
    out = []
    for c in cases:
        p = predict(*c, prm)
        out.append({"op": c[0], "dtype": c[1], "tokens": c[2], "d": c[3],
                    "kernels": [k["kernel"].split("<")[0] for k in p["kernels"]],
                    "pred_copy_kernel": round(p["copy_kernel"], 4), "pred_copy": round(p["copy"], 4)})
    return out


#: the forward cases whose pn_fwd_rows launches are predicted against the launches before
ROWS_CASES = [(op, dt, n, d) for op in ("fwd", "add") for dt in ("bfloat16", "float16", "float32")
              for n in (4096, 32768) for d in (1024, 4096, 8192, 16384)]


def rows_prediction(prm: Params = PARAMS, records_path: Path = RECORDS) -> dict:
    """pn_fwd_rows' predicted fractions of a copy beside the launches before it (the
    prediction of those and, where the 12-04 records have the case, their measurement)."""
    measured = {(r["op"], r["dtype"], r["tokens"], r["d"]): r["ratios"].get("copy_kernel")
                for r in load_records(records_path)}
    out = []
    for c in ROWS_CASES:
        new, old = predict(*c, prm), predict(*c, prm, rows=False)
        k = new["kernels"][0]
        out.append({"op": c[0], "dtype": c[1], "tokens": c[2], "d": c[3],
                    "kernel": k["kernel"], "grid": k["grid"], "block": k["block"], "per_sm": k["per_sm"],
                    "pred_copy_kernel": round(new["copy_kernel"], 4),
                    "before_kernel": old["kernels"][0]["kernel"].split("<")[0],
                    "before_pred_copy_kernel": round(old["copy_kernel"], 4),
                    "before_measured_copy_kernel": measured.get(c)})
    return {"what": "Launch model (polynorm/bench/model.py) prediction of pn_fwd_rows (the forward and "
                    "fused add) on the H200 beside the launches before it; kernels alone as a fraction "
                    "of a device copy (python -m polynorm.bench.model --predict-rows FILE)",
            "device": H200.name, "estimated": {"z": ESTIMATED_Z, "c": ESTIMATED_C, "notes": ESTIMATE_NOTES,
                                               "sass": ESTIMATE_SASS},
            "fitted_params": "PARAMS (fitted on gpu-2026-12-04b-h200.json); pn_fwd_rows' own numbers are "
                             "the estimates above, to be refitted on the first records that run it",
            "rows": out}


#: the backward cases of the 12-04 records (bfloat16, float16, float32 at the measured shapes)
def _bwd_cases(records_path: Path = RECORDS) -> list[tuple[str, str, int, int]]:
    return sorted({("bwd", r["dtype"], r["tokens"], r["d"]) for r in load_records(records_path)
                   if r["op"] == "bwd"}, key=lambda c: (c[1], c[3], c[2]))


def bwd_rows_prediction(prm: Params = PARAMS, records_path: Path = RECORDS) -> dict:
    """pn_bwd_rows' predicted fractions of a copy beside the launches before it (their
    prediction and the 12-04 measurement) for every backward case of the records.

    >>> doc = bwd_rows_prediction()
    >>> r = next(r for r in doc["rows"] if (r["dtype"], r["tokens"], r["d"]) == ("bfloat16", 32768, 8192))
    >>> r["kernel"].split("<")[0], r["before_kernel"], r["pred_copy_kernel"] > r["before_pred_copy_kernel"]
    ('pn_bwd_rows', 'pn_bwd_big', True)
    """
    measured = {(r["op"], r["dtype"], r["tokens"], r["d"]): r["ratios"].get("copy_kernel")
                for r in load_records(records_path)}
    out = []
    for c in _bwd_cases(records_path):
        new, old = predict(*c, prm), predict(*c, prm, rows=False)
        k = new["kernels"][0]
        out.append({"op": c[0], "dtype": c[1], "tokens": c[2], "d": c[3],
                    "kernel": k["kernel"], "grid": k["grid"], "block": k["block"], "per_sm": k["per_sm"],
                    "pred_copy_kernel": round(new["copy_kernel"], 4),
                    "before_kernel": old["kernels"][0]["kernel"].split("<")[0],
                    "before_pred_copy_kernel": round(old["copy_kernel"], 4),
                    "before_measured_copy_kernel": measured.get(c)})
    return {"what": "Launch model (polynorm/bench/model.py) prediction of pn_bwd_rows (the backward, dx + "
                    "dweight partial rows + pn_colsum) on the H200 beside the launches before it, for the "
                    "backward cases of gpu-2026-12-04b-h200.json; kernels alone as a fraction of a device "
                    "copy (python -m polynorm.bench.model --predict-bwd-rows FILE)",
            "device": H200.name,
            "estimated": {"z": {"bwd_rows": ESTIMATED_Z["bwd_rows"]}, "c": {"bwd_rows": ESTIMATED_C["bwd_rows"]},
                          "notes": {k: v for k, v in ESTIMATE_NOTES.items() if k.startswith("bwd_rows")},
                          "sass": ESTIMATE_SASS_BWD},
            "fitted_params": "PARAMS (fitted on gpu-2026-12-04b-h200.json); pn_bwd_rows' own numbers are "
                             "the estimates above, to be refitted on the first records that run it",
            "rows": out}


def fusion_prediction(prm: Params = PARAMS, records_path: Path = RECORDS) -> dict:
    """pn_gated_rows' / pn_quant_rows' predicted fractions of a copy for the gated and quant
    cases of the records, beside the segment kernels' (pn_gated_fwd / pn_quant_fwd: their
    prediction and their measurement); cases the rows body does not take keep the segment
    kernel (the same prediction)."""
    out = []
    for r in load_records(records_path):
        if r["op"] not in ("gated", "quant"):
            continue
        c = (r["op"], r["dtype"], r["tokens"], r["d"])
        new, old = predict(*c, prm), predict(*c, prm, rows=False)
        k = new["kernels"][0]
        out.append({"op": c[0], "dtype": c[1], "tokens": c[2], "d": c[3],
                    "kernel": k["kernel"], "grid": k["grid"], "block": k["block"], "per_sm": k["per_sm"],
                    "pred_copy_kernel": round(new["copy_kernel"], 4),
                    "before_kernel": old["kernels"][0]["kernel"].split("<")[0],
                    "before_pred_copy_kernel": round(old["copy_kernel"], 4),
                    "before_measured_copy_kernel": round(r["ratios"]["copy_kernel"], 4)})
    summary: dict = {}
    for op in ("gated", "quant"):
        for dt in ("bfloat16", "float16", "float32"):
            sub = [x for x in out if x["op"] == op and x["dtype"] == dt and x["tokens"] >= 4096
                   and 1024 <= x["d"] <= 16384]
            if sub:
                summary[f"{op} {dt}"] = {
                    "cases": len(sub), "rows_body": sum(x["kernel"].split("<")[0].endswith("_rows") for x in sub),
                    "pred": [min(x["pred_copy_kernel"] for x in sub), max(x["pred_copy_kernel"] for x in sub)],
                    "before_pred": [min(x["before_pred_copy_kernel"] for x in sub),
                                    max(x["before_pred_copy_kernel"] for x in sub)],
                    "before_measured": [min(x["before_measured_copy_kernel"] for x in sub),
                                        max(x["before_measured_copy_kernel"] for x in sub)]}
    return {"what": "Launch model (polynorm/bench/model.py) prediction of pn_gated_rows / pn_quant_rows (the "
                    "gated forward, norm_before_gate=False, one group; the quantized forward with a residual "
                    "and a static float8_e4m3fn scale: the benchmark's cases) on the H200 beside the segment "
                    "kernels before them, for every gated / quant case of the records; kernels alone as a "
                    "fraction of a device copy (python -m polynorm.bench.model --predict-fusions FILE)",
            "device": H200.name, "records_file": Path(records_path).name,
            "estimated": {"z": ESTIMATED_Z, "c": ESTIMATED_C, "notes": ESTIMATE_NOTES, "sass": ESTIMATE_SASS},
            "fitted_params": "PARAMS (fitted on gpu-2026-12-04b-h200.json); the rows-body kernels' own numbers "
                             "are the estimates above, to be refitted on the first records that run them",
            "summary (tokens >= 4096, 1024 <= d <= 16384: [min, max])": summary,
            "rows": out}


def report(records_path: Path = RECORDS, prm: Params = PARAMS, headline_only: bool = False) -> tuple[str, dict]:
    """The text ``polynorm bench --gpu-model`` prints and the JSON document it can write."""
    rows = compare(load_records(records_path), prm)
    err = errors(rows)
    shown = [r for r in rows if (r["op"], r["dtype"], r["tokens"], r["d"]) in HEADLINE] if headline_only else rows
    text = "\n".join([
        f"launch model (polynorm/bench/model.py, {prm.count()} fitted numbers) against "
        f"{Path(records_path).name}: {len(rows)} records, "
        f"{sum(r['launch_matches'] for r in rows)} with the same launches as the dispatcher's today",
        error_lines(err), "", table(shown)])
    doc = {"what": f"Launch model (polynorm/bench/model.py) against {Path(records_path).name}: prediction "
                   "beside measurement per record, the error, the fitted parameters "
                   "(python -m polynorm.bench.model --holdout --json FILE)",
           "records_file": str(Path(records_path).name), "device": H200.name,
           "modelled": "copy_kernel: kernels alone (launches replayed) / device copy of the same bytes; "
                       "copy: end to end (host included) / the same copy",
           "params": asdict(prm), "fitted_numbers": prm.count(), "errors": err, "rows": rows}
    return text, doc


#: main's prediction options: the document each writes and the line it prints per case
_PREDICTIONS = {
    "predict_bwd_rows": (lambda: bwd_rows_prediction(),
                         "{dtype:9} {tokens:6}x{d:<6} {name:12} pred {pred_copy_kernel:.3f} | before "
                         "{before_kernel:11} pred {before_pred_copy_kernel:.3f} measured {before_measured_copy_kernel}"),
    "predict_fusions": (lambda: fusion_prediction(),
                        "{op:5} {dtype:9} {tokens:7}x{d:<6} {name:13} pred {pred_copy_kernel:.3f} | before "
                        "{before_kernel:12} pred {before_pred_copy_kernel:.3f} measured {before_measured_copy_kernel}"),
    "predict_rows": (lambda: rows_prediction(),
                     "{op:4} {dtype:9} {tokens:6}x{d:<6} {name:12} pred {pred_copy_kernel:.3f} | before "
                     "{before_kernel:11} pred {before_pred_copy_kernel:.3f} measured {before_measured_copy_kernel}"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polynorm.bench.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=Path, default=RECORDS, help="bench/gpu.py JSON to compare with")
    p.add_argument("--headline", action="store_true", help="the table for the headline cases only")
    p.add_argument("--json", type=Path, help="write the predictions and errors here")
    p.add_argument("--fit", action="store_true", help="refit the parameters on --records and print them (scipy)")
    p.add_argument("--holdout", action="store_true", help="fit on half of the shapes, report the other half (scipy)")
    p.add_argument("--predict-rows", type=Path, help="write pn_fwd_rows' predictions (beside the kernels before) here")
    p.add_argument("--predict-bwd-rows", type=Path,
                   help="write pn_bwd_rows' predictions (beside the kernels before) here")
    p.add_argument("--predict-fusions", type=Path,
                   help="write pn_gated_rows' / pn_quant_rows' predictions (beside the kernels before) here")
    args = p.parse_args(argv)
    for option, (predict, line) in _PREDICTIONS.items():
        path = getattr(args, option)
        if path:
            doc = predict()
            path.write_text(json.dumps(doc, indent=1) + "\n")
            for r in doc["rows"]:
                print(line.format(name=r["kernel"].split("<")[0], **r))
            return 0
    prm = PARAMS
    extra: dict = {}
    if args.fit:
        prm = calibrate(load_records(args.records))
        print(prm)
    if args.holdout:
        extra["holdout"] = holdout(load_records(args.records), prm)
    text, doc = report(args.records, prm, args.headline)
    print(text)
    if extra:
        print(json.dumps(extra, indent=1))
    if args.json:
        args.json.write_text(json.dumps({**doc, **extra}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
