"""g++ CPU of the CUDA emulator's kernel libraries, one per x dtype family.

The default test run builds these libraries (tests/test_emul_kernels.py's
``module(family)``: every specialisation of polynorm/backends/cuda/polynorm.cu
with that x dtype, plus pn_colsum) when ``POLYNORM_EMUL_CACHE`` is empty.  Each
build here goes to a new empty cache folder and is timed by the CPU of the
harness's child processes (g++, readelf).  ``--old REV`` builds with the
prelude (tests/emulator/cuda_emul.h) of a git revision too, the two
alternating in each round, so a prelude change is measured paired.

Run::

    python bench/emul_build.py                          # the working tree's prelude
    python bench/emul_build.py --old HEAD~1 --rounds 2 --json bench/results/emul-build.json
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from emulator import harness  # noqa: E402
from test_emul_kernels import DTYPES, _names  # noqa: E402

from polynorm.backends.cuda import launch as cl  # noqa: E402


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="git revision whose prelude is built too (paired)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="emul-build-"))
    preludes = {"new": harness.HERE / "cuda_emul.h"}
    if args.old:
        old = work / "cuda_emul.h"
        old.write_text(subprocess.run(["git", "show", f"{args.old}:tests/emulator/cuda_emul.h"], cwd=ROOT,
                                      capture_output=True, text=True, check=True).stdout)
        preludes = {"old": old, **preludes}
    runs: dict[str, dict[str, list[float]]] = {k: {f: [] for f in DTYPES} for k in preludes}
    for _ in range(args.rounds):
        for which, prelude in preludes.items():
            harness.PRELUDE = prelude
            for fam in DTYPES:
                os.environ["POLYNORM_EMUL_CACHE"] = tempfile.mkdtemp(dir=work)
                t = _children_cpu()
                harness.compile_source(cl.SOURCE_PATH, _names(fam))
                runs[which][fam].append(round(_children_cpu() - t, 2))
                print(f"{which:4s} {fam:9s} {runs[which][fam][-1]:6.1f} s", flush=True)
    for which, fams in runs.items():
        print(f"{which}: " + ", ".join(f"{f} {min(v):.1f}" for f, v in fams.items())
              + f"; total {sum(min(v) for v in fams.values()):.1f} s (best of {args.rounds})")
    if args.json:
        rev = subprocess.run(["git", "rev-parse", "--short", args.old or "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        what = "g++ CPU of the CUDA emulator's kernel libraries per dtype family"
        Path(args.json).write_text(json.dumps({"what": what, "date": time.strftime("%Y-%m-%d"), "old": args.old and rev, "rounds": args.rounds, "cpu_s": runs,
                                               "compiler": harness.toolchain()[2]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
