"""Machine-code report of the CUDA kernels, without a GPU.

Compiles every specialisation the dispatcher can request
(:func:`polynorm.backends.cuda.launch.specialisations`) with the backend's own
NVRTC options for sm_80 and sm_90, reads registers / spills / stack from
``cuobjdump -res-usage``, counts 16-byte global loads in flight from
``cuobjdump -sass``, and computes the theoretical occupancy of every launch
shape the dispatcher makes (``forward_launch`` / ``backward_launch`` /
``colsum_launch``) from the per-SM limits of the architecture.

Needs ``cuda-bindings`` + ``nvidia-cuda-nvrtc`` (as tests/test_nvrtc.py) and a
``cuobjdump`` binary (the ``nvidia-cuda-cuobjdump`` wheel, or a CUDA toolkit).

Loads in flight
    The SASS of one kernel is walked in program order.  A ``LDG.E.128`` (any
    modifiers) becomes *pending*; it stops being pending at the first
    instruction that reads or overwrites one of its four destination registers
    (the hardware must wait for it there).  The figure reported is the largest
    number of 16-byte loads pending at once.  Unconditional ``BRA``/``EXIT``/
    ``RET`` clear the pending set (the loads do not flow into the next
    instruction in program order), so branches make the count conservative.

Asynchronous copies (cp.async, ``LDGSTS``)
    A kernel that copies global memory into shared memory with ``LDGSTS``
    closes a commit group with ``LDGDEPBAR`` and waits with
    ``DEPBAR.LE SB0, N``: every group but the newest N has landed.  At each
    such wait with N > 0 the count is N times the 16-byte ``LDGSTS`` (any
    modifiers, predicated or not) of the group committed last before it in
    program order, plus the ``LDG.E.128`` pending there (as above): the copies
    still in flight while the thread works on the group it waited for.  The
    group being waited for is not counted, nor are copies of other sizes.  The
    figure reported is the largest over the waits; a kernel's "loads in flight"
    is the larger of the two counts.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from polynorm.backends.cuda import launch as cl

ARCHS = ("sm_80", "sm_90")

#: per-SM limits used for theoretical occupancy (CUDA occupancy calculator
#: values for compute capability 8.0 and 9.0)
LIMITS = {
    "sm_80": {"sms": 108, "regs": 65536, "warps": 64, "blocks": 32, "smem": 164 * 1024, "smem_block": 163 * 1024,
              "reserved_smem": 1024, "reg_unit": 256, "smem_unit": 128},
    "sm_90": {"sms": 132, "regs": 65536, "warps": 64, "blocks": 32, "smem": 228 * 1024, "smem_block": 227 * 1024,
              "reserved_smem": 1024, "reg_unit": 256, "smem_unit": 128},
}

#: row lengths whose launches are enumerated (every launch-rule boundary of
#: the register kernels for every VEC, plus long rows) and row counts
D_VALUES = sorted({1, 3, 8, 64, 100, 128, 255, 256, 257, 512, 1000, 1024, 2048, 3000, 4096, 5000, 6144,
                   8192, 10000, 12288, 16384, 16385, 32768, 65536, 262144}
                  | {v * t * i for v in (2, 4, 8) for t in (8, 16, 32, 64, 128, 256, 512) for i in (1, 2, 4)
                     if v * t * i <= 16384})
N_VALUES = (1, 8, 4096, 1 << 20)
OCC_D_MAX = 16384  # the occupancy target applies to launches at d <= this


def find_cuobjdump() -> str | None:
    """Path of a ``cuobjdump`` binary: $PATH, the NVIDIA wheels, then the CUDA toolkit."""
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cuda_cuobjdump"):
            p = Path(loc) / sub / "bin" / "cuobjdump"
            if p.exists():
                return str(p)
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "cuobjdump").exists():
            return str(Path(root) / "bin" / "cuobjdump")
    return None


# ------------------------------------------------------------------ SASS parsing

_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_REG = re.compile(r"(?<![\w.])R(\d+)(\.64)?\b")
_LDG128 = re.compile(r"^LDG(\.[A-Z0-9_]+)*\.128\b")
_LDGSTS128 = re.compile(r"^LDGSTS(\.[A-Z0-9_]+)*\.128\b")
_DEPBAR_SB0 = re.compile(r"^DEPBAR\.LE\s+SB0\s*,\s*(0x[0-9a-fA-F]+|\d+)\s*$")


def _regs(operand: str) -> set[int]:
    out: set[int] = set()
    for m in _REG.finditer(operand):
        r = int(m.group(1))
        out.add(r)
        if m.group(2):
            out.add(r + 1)
    return out


def split_functions(sass: str) -> dict[str, list[str]]:
    """Mangled kernel name -> its instructions (text between the address and ';')."""
    funcs: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in sass.splitlines():
        s = line.strip()
        if s.startswith("Function :"):
            cur = funcs.setdefault(s.split(":", 1)[1].strip(), [])
            continue
        if cur is None:
            continue
        m = _INSN.search(line)
        if m:
            cur.append(m.group(1))
    return funcs


def ldg128_inflight(insns: list[str]) -> tuple[int, int]:
    """(largest number of LDG.E.128 pending at once, LDG.E.128 count) for one kernel."""
    best, total, _ = _walk(insns)
    return best, total


def ldgsts_inflight(insns: list[str]) -> tuple[int, int]:
    """(16-byte loads in flight at a cp.async wait, LDGSTS.128 count) for one kernel:
    the largest N x (LDGSTS.128 of the last committed group) + LDG.E.128 pending
    over the ``DEPBAR.LE SB0, N`` waits (module docstring).

    >>> ldgsts_inflight(["LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]", "LDGSTS.E.BYPASS.128 [R5], [R6.64]",
    ...                  "LDGDEPBAR", "LDG.E.128 R8, [R10.64]", "DEPBAR.LE SB0, 0x3", "FADD R0, R8, R9"])
    (7, 2)
    """
    _, _, (best, total) = _walk(insns)
    return best, total


def _walk(insns: list[str]) -> tuple[int, int, tuple[int, int]]:
    pending: list[set[int]] = []
    best = total = 0
    group = last_group = 0  # LDGSTS.128 of the open group, of the last committed one
    sts_best = sts_total = 0
    for text in insns:
        t = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
        op, _, rest = t.partition(" ")
        ops = [o.strip() for o in rest.split(",")] if rest else []
        is_store = op.startswith(("ST", "RED", "ATOM"))
        dst = set() if is_store or not ops else _regs(ops[0])
        src: set[int] = set()
        for o in (ops if is_store else ops[1:]):
            src |= _regs(o)
        # consumption (read, or write-after-write) of a pending load's registers
        pending = [p for p in pending if not (p & (src | dst))]
        if _LDG128.match(op):
            total += 1
            base = min(dst) if dst else 0
            pending.append({base, base + 1, base + 2, base + 3})
            best = max(best, len(pending))
        elif _LDGSTS128.match(op):
            sts_total += 1
            group += 1
        elif op == "LDGDEPBAR":
            last_group, group = group, 0
        elif op == "DEPBAR.LE":
            m = _DEPBAR_SB0.match(t)
            if m:
                sts_best = max(sts_best, int(m.group(1), 0) * last_group + len(pending))
        if op in ("EXIT", "RET", "BRA") and not text.startswith("@"):
            pending = []
    return best, total, (sts_best, sts_total)


_FP64 = re.compile(r"^(D(ADD|MUL|FMA|SETP|MNMX|SET)\b|MUFU\.(RCP|RSQ)64H|[FI]2[FI]\S*\.F64)")


def fp64_count(insns: list[str]) -> int:
    """FP64-pipe instructions of one kernel in program order (DADD/DMUL/DFMA/DSETP/DMNMX,
    MUFU.RCP64H/RSQ64H and conversions to or from F64), counted once each: a static count,
    the rarely taken paths (exact fallbacks, the division and square root slow paths,
    the element-by-element twin) included."""
    n = 0
    for text in insns:
        op = re.sub(r"^@!?U?P[T0-9]+\s+", "", text).partition(" ")[0]
        n += bool(_FP64.match(op))
    return n


def resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage`` output -> {mangled name: {REG, STACK, SHARED, LOCAL}}."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Function "):
            cur = s[len("Function "):].rstrip(":")
        elif cur and s.startswith("REG:"):
            out[cur] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", s)
                        if k in ("REG", "STACK", "SHARED", "LOCAL")}
            cur = None
    return out


_SPILL = re.compile(r"Function properties for (\S+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
                    r"(\d+) bytes spill loads")


def ptxas_spills(log: str) -> dict[str, tuple[int, int]]:
    """NVRTC ``--ptxas-options=-v`` log -> {mangled name: (spill store bytes, spill load bytes)}."""
    return {m.group(1): (int(m.group(3)), int(m.group(4))) for m in _SPILL.finditer(log)}


# ------------------------------------------------------------------ occupancy


def occupancy(arch: str, regs: int, block: int, dyn_smem: int, static_smem: int) -> tuple[float, str]:
    """(resident warps / max warps, the limiting resource) for one launch.

    ``static_smem`` is cuobjdump's SHARED figure (it already includes the
    1 KiB the runtime reserves per block on sm_80+).
    """
    lim = LIMITS[arch]
    warps = math.ceil(block / 32)
    by = {"warps": lim["warps"] // warps, "blocks": lim["blocks"]}
    per_warp = math.ceil(max(regs, 1) * 32 / lim["reg_unit"]) * lim["reg_unit"]
    by["registers"] = (lim["regs"] // per_warp) // warps
    smem = math.ceil((dyn_smem + static_smem) / lim["smem_unit"]) * lim["smem_unit"]
    if dyn_smem + static_smem - lim["reserved_smem"] > lim["smem_block"]:
        by["shared"] = 0
    else:
        by["shared"] = lim["smem"] // smem if smem else lim["blocks"]
    limiter = min(by, key=lambda k: by[k])
    return min(by.values()) * warps / lim["warps"], limiter


def launches(arch: str) -> dict[str, list[dict]]:
    """Every distinct (block, dynamic shared) launch of each kernel over D_VALUES x N_VALUES
    on a device of ``arch`` (its SM count and opt-in shared memory, as the backend passes them)."""
    sms, smem = LIMITS[arch]["sms"], LIMITS[arch]["smem_block"]
    seen: dict[str, dict[tuple[int, int], dict]] = {}

    def add(lau, d, n, kind):
        key = (lau.block, lau.shared)
        rec = seen.setdefault(lau.name, {})
        if key not in rec or (d <= OCC_D_MAX and rec[key]["d"] > OCC_D_MAX):
            rec[key] = {"kind": kind, "d": d, "n": n, "block": lau.block, "shared": lau.shared,
                        "grid": lau.grid}

    for d in D_VALUES:
        for n in N_VALUES:
            for t in cl.FWD_TYPES:
                fl = cl.forward_launch(n, d, *t, max_smem=smem, num_sms=sms)
                add(fl, d, n, "forward")
                if fl.name2:  # pn_fwd_split's phase 2: the same grid and block
                    add(replace(fl, name=fl.name2), d, n, "forward")
            for t, hw, hg in ((t, hw, hg) for t in cl.BWD_TYPES for hw in (False, True) for hg in (False, True)):
                bl = cl.backward_launch(n, d, *t, num_sms=sms, max_smem=smem, has_w=hw, has_g=hg)
                add(bl, d, n, "backward")
                if bl.name2:
                    add(replace(bl, name=bl.name2), d, n, "backward")
                if bl.partial_rows:
                    ct = cl.compute_dtype(t[0])
                    for o in {cl.colsum_out(ct, t[0]), cl.colsum_out(ct, ct)}:
                        add(cl.colsum_launch(d, ct, o), d, n, "colsum")
            # the fusions: one group of d and, where it divides d, groups of 128
            for gs in {d, 128} if d % 128 == 0 else {d}:
                for t in cl.GATED_FWD_TYPES:
                    add(cl.gated_forward_launch(n, d, gs, *t, num_sms=sms), d, n, "gated forward")
                    add(cl.gated_forward_launch(n, d, gs, *t, rows=False), d, n, "gated forward")
                for t in cl.GATED_BWD_TYPES:
                    add(cl.gated_backward_launch(n, d, gs, *t), d, n, "gated backward")
            for x in cl.FLOAT_DTYPES:
                for fp8 in (True, False):
                    add(cl.quant_launch(n, d, x, fp8), d, n, "quant")
                    add(cl.quant_launch(n, d, x, fp8, group_size=d, num_sms=sms), d, n, "quant")
    return {k: list(v.values()) for k, v in seen.items()}


# ------------------------------------------------------------------ report


@dataclass
class KernelReport:
    name: str
    arch: str
    regs: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int
    ldg128_inflight: int
    ldg128_total: int
    ldgsts_inflight: int = 0
    ldgsts_total: int = 0
    inflight: int = 0  # 16-byte loads in flight per thread: the larger of the two counts
    fp64: int = 0  # static FP64-pipe instruction count (fp64_count)
    min_occupancy: float | None = None  # over the launches at d <= OCC_D_MAX
    min_occupancy_launch: dict | None = None
    launches: list[dict] = field(default_factory=list)


def build(archs: tuple[str, ...] = ARCHS, names: list[str] | None = None) -> list[KernelReport]:
    """Compile, disassemble and analyse; one KernelReport per (arch, kernel)."""
    from polynorm.backends.cuda import nvrtc as _nvrtc

    ok, why = _nvrtc.available()
    if not ok:
        raise RuntimeError(why)
    exe = find_cuobjdump()
    if exe is None:
        raise RuntimeError("cuobjdump not found; pip install nvidia-cuda-cuobjdump")
    names = names or cl.specialisations()
    reports = []
    for arch in archs:
        shapes = launches(arch)
        res = _nvrtc.compile_names(names, arch, ("--ptxas-options=-v",))
        if not res.ok:
            raise RuntimeError(f"{arch} compile failed:\n{res.log}")
        spills = ptxas_spills(res.log)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"polynorm_{arch}.cubin"
            path.write_bytes(res.cubin)
            usage = resource_usage(subprocess.run([exe, "-res-usage", str(path)], capture_output=True,
                                                  text=True, check=True).stdout)
            funcs = split_functions(subprocess.run([exe, "-sass", str(path)], capture_output=True,
                                                   text=True, check=True).stdout)
        for nm in names:
            low = res.lowered[nm]
            u = usage[low]
            st, ld = spills.get(low, (0, 0))
            inflight, total = ldg128_inflight(funcs.get(low, []))
            sts, sts_total = ldgsts_inflight(funcs.get(low, []))
            rep = KernelReport(nm, arch, u["REG"], st, ld, u["STACK"], u["SHARED"], inflight, total, sts,
                               sts_total, max(inflight, sts), fp64_count(funcs.get(low, [])))
            for lau in shapes.get(nm, []):
                occ, limiter = occupancy(arch, u["REG"], lau["block"], lau["shared"], u["SHARED"])
                rep.launches.append({**lau, "occupancy": round(occ, 4), "limiter": limiter})
            within = [la for la in rep.launches if la["d"] <= OCC_D_MAX]
            if within:
                worst = min(within, key=lambda la: la["occupancy"])
                rep.min_occupancy, rep.min_occupancy_launch = worst["occupancy"], worst
            reports.append(rep)
    return reports


def table(reports: list[KernelReport]) -> str:
    """One line per kernel: regs, spills, loads in flight, worst occupancy (d <= OCC_D_MAX)."""
    lines = [f"{'arch':6} {'kernel':62} {'regs':>4} {'spill':>6} {'ldg128':>6} {'ldgsts':>6} {'flight':>6} "
             f"{'occ%':>5}  worst launch"]
    for r in reports:
        occ = "-" if r.min_occupancy is None else f"{100 * r.min_occupancy:.0f}"
        w = r.min_occupancy_launch
        wl = f"d={w['d']} n={w['n']} block={w['block']} smem={w['shared']} ({w['limiter']})" if w else ""
        lines.append(f"{r.arch:6} {r.name:62} {r.regs:4d} {r.spill_stores:6d} {r.ldg128_total:6d} "
                     f"{r.ldgsts_total:6d} {r.inflight:6d} {occ:>5}  {wl}")
    return "\n".join(lines)


def summary(reports: list[KernelReport]) -> dict:
    """The targets of the kernel work, per kernel family and arch."""
    out: dict = {}
    for r in reports:
        fam = r.name.split("<", 1)[0]
        s = out.setdefault(r.arch, {}).setdefault(fam, {"max_regs": 0, "spilling": 0, "min_inflight": None,
                                                         "max_inflight": 0, "min_occupancy": None})
        s["max_regs"] = max(s["max_regs"], r.regs)
        s["spilling"] += bool(r.spill_stores or r.spill_loads)
        s["max_inflight"] = max(s["max_inflight"], r.inflight)
        s["min_inflight"] = r.inflight if s["min_inflight"] is None else min(s["min_inflight"], r.inflight)
        if r.min_occupancy is not None:
            s["min_occupancy"] = r.min_occupancy if s["min_occupancy"] is None else min(s["min_occupancy"],
                                                                                         r.min_occupancy)
    return out


def write_json(reports: list[KernelReport], path: Path) -> None:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    doc = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nvrtc": f"{major}.{minor}",
        "cuobjdump": find_cuobjdump(),
        "limits": LIMITS,
        "occupancy_d_max": OCC_D_MAX,
        "method": __doc__,
        "summary": summary(reports),
        "kernels": [asdict(r) for r in reports],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=ARCHS, help="default: both")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    args = ap.parse_args(argv)
    names = [n for n in cl.specialisations() if args.filter in n]
    reports = build(tuple(args.arch or ARCHS), names)
    print(table(reports))
    print(json.dumps(summary(reports), indent=1))
    if args.out:
        write_json(reports, args.out)
        print(f"wrote {args.out}")
    return 0
