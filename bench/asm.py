"""Vector instructions per 16 elements in the 16-bit kernels' hot loops (machine code, not time).

Compiles the Numba forward (``forward_bits_rows``: the pipelined rows;
``forward_streamed_rows``: streamed ``out=`` rows), backward (``backward_range``), gated
forward (``numba.gated.forward_rows``) and quantized forward (``quant_rows``: float8,
per-token scale) for bfloat16 and float16 on this CPU,
takes each innermost loop of their machine code that converts 16-bit data
(``vpmovzxwd``/``vcvtph2ps`` in, ``vpmovdw``/``vpackusdw``/``vcvtps2ph``/
``vcvtneps2bf16`` out; bfloat16 pairs split and joined by ``vpblendw``) or packs codes into bytes (the quantized forward's float8
encode: ``vpackuswb``/``vpmovdb``) and prints, per 16 elements: all instructions, the vector
ones (an ``xmm``/``ymm``/``zmm``/mask register operand), the rounding ones (the
integer bfloat16 encode: ``vpsrld vpandd vpaddd vpcmpgtd vpord vptestnmd
vpblendmd vcmpunordps vpmovdw ...``; or the hardware one, ``vcvtneps2bf16``
with its subnormal test ``vfpclassps``/``korw``), and the loop's streams (16-bit arrays loaded/stored, float32
arrays loaded/stored).  A count of instructions is steady where timings on a
shared machine are not; ``--save DIR`` keeps the whole listings.

    python bench/asm.py [--dtypes bfloat16 float16] [--save DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# compile afresh: a kernel loaded from Numba's on-disk cache has no listing to inspect
os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="polynorm-asm-")

import numpy as np  # noqa: E402

_LABEL = re.compile(r"^([.\w$]+):")
_JUMP = re.compile(r"^j\w+\s+([.\w$]+)$")
_VEC = re.compile(r"%[xyz]mm\d+|%k\d")
_STEP = re.compile(r"^(?:addq|subq)\s+\$(-?\d+),\s*(%\w+)$")
#: the integer bfloat16 encode and 16-bit packing (float16 goes through vcvtps2ph)
ROUNDING = {"vpsrld", "vpandd", "vpand", "vpaddd", "vpcmpgtd", "vpcmpeqd", "vpmaxud", "vpord",
            "vpor", "vptestnmd", "vptestmd", "vpblendmd", "vblendvps", "vcmpunordps",
            "vandps", "vorps", "vpmovdw", "vpackusdw", "vpermq", "vinserti64x4",
            "vcvtneps2bf16", "vfpclassps", "korw", "vpblendw"}
DECODE_IN = ("vpmovzxwd", "vcvtph2ps")
ENCODE_OUT = ("vpmovdw", "vpackusdw", "vcvtps2ph", "vcvtneps2bf16")
#: the bfloat16 output blocks read and write 16-bit pairs whole: the halves are
#: split by a shift and a word blend, and blended back (``_bf16_out_block``)
PAIRS = ("vpblendw",)
#: the quantized forward's float8/int8 encode loops pack float32 codes into bytes
BYTES_OUT = ("vpackuswb", "vpmovdb", "vpmovusdb")


def innermost_loops(asm: str) -> list[list[str]]:
    """The bodies of the innermost loops (a label and a later jump back to it)."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in asm.splitlines():
        s = line.strip()
        m = _LABEL.match(s)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        if not s or s.startswith((".", "#", ";")):
            continue
        ins.append(s.split("#")[0].strip())
    spans = []
    for k, t in enumerate(ins):
        m = _JUMP.match(t)
        if m and m.group(1) in labels and labels[m.group(1)] <= k:
            spans.append((labels[m.group(1)], k))
    inner = [(a, b) for a, b in spans
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    return [ins[a:b + 1] for a, b in inner]


def elements_per_iteration(body: list[str]) -> int | None:
    """The loop's step in elements: an index register added to once per iteration
    and used scaled by 2 or 4 (an element index) in the loop's addresses; one also
    used unscaled beside its scale-2 uses counts the 16-bit data's bytes (half a
    step's elements); else a counter that is compared and in no address."""
    text = " ".join(body)
    for t in body:
        m = _STEP.match(t)
        if m and int(m.group(1)) > 0:
            reg = re.escape(m.group(2))
            if re.search(rf",{reg},[24]\)", text):
                if re.search(rf",{reg}\)", text) and re.search(rf",{reg},2\)", text):
                    return int(m.group(1)) // 2
                return int(m.group(1))
    # loops that bump pointers (the explicit-vector ones) count columns in a
    # register of their own: stepped, compared, and in no address
    for t in body:
        m = _STEP.match(t)
        if m and int(m.group(1)) > 0:
            reg = re.escape(m.group(2))
            if (re.search(rf"^cmpq\s+.*{reg}$", "\n".join(body), re.M)
                    and not re.search(rf"\([^)]*{reg}[^)]*\)", text)):
                return int(m.group(1))
    return None


def describe(body: list[str]) -> dict | None:
    """Counts per 16 elements of a loop that converts 16-bit data, else None."""
    ops = collections.Counter(t.split()[0] for t in body)
    if not any(ops[o] for o in DECODE_IN + BYTES_OUT + PAIRS):
        return None
    n = elements_per_iteration(body)
    if not n:
        return None
    vec = [t for t in body if _VEC.search(t)]
    per = 16.0 / n
    wide = "zmm" if any("zmm" in t for t in body) else "ymm" if any("ymm" in t for t in body) \
        else "xmm"
    mem16_in = sum(1 for t in body if t.split()[0] in DECODE_IN and "(" in t)
    out16 = sum(1 for t in body if t.split()[0] in ENCODE_OUT)
    if ops["vpblendw"]:  # pairs: whole 16-bit vectors moved in and out
        mem16_in += sum(1 for t in body if t.startswith("vmovdqu\t(") or
                        t.startswith("vmovdqu (") and t.endswith("mm"))
        out16 += sum(1 for t in body if t.split()[0] == "vmovdqu" and t.endswith(")"))
    # float32 vectors read (a memory operand scaled by 4) and written
    ld32 = sum(1 for t in body if _VEC.search(t) and re.search(r"^[^,]*\(%\w+,%\w+,4\),", t)
               and not t.split()[0].startswith(("vmovnt",)))
    st32 = sum(1 for t in body if re.search(r",\s*-?\d*\(%\w+,%\w+,4\)$", t))
    return {
        "elements": n, "width": wide,
        "all": len(body) * per, "vector": len(vec) * per,
        "rounding": sum(c for o, c in ops.items() if o in ROUNDING) * per,
        "in16": mem16_in * per, "out16": out16 * per, "ld32": ld32 * per, "st32": st32 * per,
        "ops": dict(sorted(ops.items())),
        "body": body,
    }


def mca_cycles(body: list[str], cpu: str, iterations: int = 300) -> float | None:
    """llvm-mca's steady-state cycles per iteration of a loop body on ``cpu``
    (None without an ``llvm-mca`` executable)."""
    exe = shutil.which("llvm-mca") or next(
        (e for v in range(20, 10, -1) if (e := shutil.which(f"llvm-mca-{v}"))), None)
    if exe is None:
        return None
    src = "\n".join(body[:-1]) + "\n"  # without the jump back
    res = subprocess.run([exe, f"-mcpu={cpu}", f"-iterations={iterations}", "-all-stats=false",
                          "-instruction-info=false"], input=src, capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s*(\d+)", res.stdout)
    return int(m.group(1)) / iterations if m else None


def kernel_asm(dtypes: list[str]) -> dict[str, str]:
    """``{"fwd bfloat16": asm, "bwd bfloat16": asm, ...}``, compiled by small calls."""
    import polynorm as pn
    from polynorm.backends import numba as nb
    from polynorm.backends.numba import backward_kernels as KB
    from polynorm.backends.numba import gated as G
    from polynorm.backends.numba import kernels as K
    from polynorm.backends.numba import quant as Q
    from polynorm.core.dtypes import numpy_dtype

    rng = np.random.default_rng(0)
    for dt in dtypes:
        x, r = (rng.standard_normal((64, 4096), dtype=np.float32).astype(numpy_dtype(dt))
                for _ in range(2))
        w = np.ones(4096, np.float32)
        pn.rms_norm(x, w, backend="numba")
        pn.add_rms_norm(x, r, w, backend="numba")
        keep = nb.STREAM_MIN_BYTES, nb.STREAM_16
        # compile the streamed out= rows as well, whether or not this CPU streams 16-bit rows
        nb.STREAM_MIN_BYTES, nb.STREAM_16 = 0, True
        try:
            pn.rms_norm(x, w, backend="numba", out=np.empty_like(x))
        finally:
            nb.STREAM_MIN_BYTES, nb.STREAM_16 = keep
        pn.rms_norm_backward(r, x, w, backend="numba")
        pn.rms_norm_gated(x, r, w, backend="numba")
        pn.rms_norm_quant(x, w, backend="numba")
    out = {}
    bits = {"bfloat16": "uint16", "float16": "int16"}
    for tag, fn, pos in (("fwd", K.forward_bits_rows, 2), ("fwd out", K.forward_streamed_rows, 2),
                         ("bwd", KB.backward_range, 5), ("gated", G.forward_rows, 2),
                         ("quant", Q.quant_rows, 2)):
        for sig, asm in fn.inspect_asm().items():
            for dt in dtypes:
                if str(sig[pos].dtype) == bits[dt]:
                    out[f"{tag} {dt}"] = asm
    return out


def _mca_note(d: dict, cpu: str | None) -> str:
    if not cpu:
        return ""
    c = mca_cycles(d["body"], cpu)
    return "" if c is None else f";  mca {cpu} {c * 16 / d['elements']:5.1f} cycles"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"],
                    choices=["bfloat16", "float16"])
    ap.add_argument("--save", default=None, help="a folder for the whole listings")
    ap.add_argument("--mca", default=None, metavar="CPU",
                    help="add llvm-mca's cycles per 16 elements on this -mcpu (e.g. znver2)")
    args = ap.parse_args(argv)
    listings = kernel_asm(args.dtypes)
    for name, asm in sorted(listings.items()):
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            (Path(args.save) / (name.replace(" ", "_") + ".s")).write_text(asm)
        rows = [d for d in map(describe, innermost_loops(asm))
                if d and d["width"] != "xmm" and d["elements"] >= 8]
        print(f"== {name}: vectorized loops converting 16-bit data or packing bytes; per 16 elements: all / "
              "vector / rounding+packing instructions; vector loads and stores of 16-bit "
              "and float32 data")
        seen = set()
        for d in sorted(rows, key=lambda d: (-d["in16"], -d["ld32"], d["vector"])):
            key = tuple(round(d[k], 2) for k in ("all", "vector", "rounding", "in16", "out16",
                                                   "ld32", "st32"))
            if key in seen:
                continue
            seen.add(key)
            print(f"  {d['width']} x{d['elements']:<3} {d['all']:5.1f} / {d['vector']:5.1f} / "
                  f"{d['rounding']:4.1f};  ld16 {d['in16']:g}  st16 {d['out16']:g}  "
                  f"ld32 {d['ld32']:g}  st32 {d['st32']:g}" + _mca_note(d, args.mca))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
