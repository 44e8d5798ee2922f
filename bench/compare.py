"""Time the working tree's kernels against another commit's, alternating in one process.

On a shared machine the copy roof can move by 2x between runs, while the
ratio of two kernels timed alternately in the same process stays put: this
is the measurement to quote for a kernel change.  The other commit's
``polynorm`` is extracted with ``git archive`` into a temporary folder and
imported under another name beside the working tree's.

    python bench/compare.py --rev HEAD~1 --dtype bfloat16 --shape 16384x4096 --ops bwd fwd

prints, per op, ``new/old`` time ratios of three paired medians (< 1: the
working tree is faster) and whether the two outputs have the same bits.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polynorm.bench.common import paired_median  # noqa: E402
from polynorm.core.dtypes import numpy_dtype  # noqa: E402


def import_rev(rev: str, where: Path):
    """The ``polynorm`` package of commit ``rev``, imported as ``polynorm_old``."""
    tar = subprocess.run(["git", "archive", rev, "polynorm"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(where, filter="data")
    pkg = where / "polynorm_old"
    (where / "polynorm").rename(pkg)
    for f in pkg.rglob("*.py"):
        src = f.read_text()
        src = re.sub(r"\bpolynorm\.", "polynorm_old.", src)
        src = re.sub(r"\bfrom polynorm import\b", "from polynorm_old import", src)
        src = re.sub(r"\bimport polynorm\b", "import polynorm_old", src)
        f.write_text(src)
    sys.path.insert(0, str(where))
    import polynorm_old

    return polynorm_old


OPS = ("fwd", "out", "add", "bwd", "bwd-gr", "gated", "gated-nbg", "gated-bwd", "gated-nbg-bwd", "quant")


def calls(pn, x, w, r, dy, out, rstd):
    return {
        "fwd": lambda: pn.rms_norm(x, w),
        "out": lambda: pn.rms_norm(x, w, out=out),
        "add": lambda: pn.add_rms_norm(x, r, w),
        "bwd": lambda: pn.rms_norm_backward(dy, x, w, rstd=rstd),
        "bwd-gr": lambda: pn.rms_norm_backward(dy, x, w, rstd=rstd, grad_residual=r),
        "gated": lambda: pn.rms_norm_gated(x, r, w),
        "gated-nbg": lambda: pn.rms_norm_gated(x, r, w, norm_before_gate=True),
        "gated-bwd": lambda: pn.rms_norm_gated_backward(dy, x, r, w),
        "gated-nbg-bwd": lambda: pn.rms_norm_gated_backward(dy, x, r, w, norm_before_gate=True),
        "quant": lambda: pn.rms_norm_quant(x, w),
    }


def _bytes(a) -> bytes:
    """Every array an op returns (all of a tuple's), as bytes."""
    parts = a if isinstance(a, tuple) else (a,)
    return b"".join(np.ascontiguousarray(np.asarray(p)).view(np.uint8).tobytes()
                    for p in parts if p is not None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the commit to compare against (default HEAD)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--shape", default="16384x4096", help="tokens x d")
    ap.add_argument("--ops", nargs="+", default=["bwd"], choices=list(OPS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-weight", action="store_true", help="the calls without a weight")
    args = ap.parse_args(argv)
    import polynorm as pn

    n, d = (int(v) for v in args.shape.split("x"))
    dt = numpy_dtype(args.dtype)
    rng = np.random.default_rng(0)
    x, r, dy = (rng.standard_normal((n, d), dtype=np.float32).astype(dt) for _ in range(3))
    w = (1 + 0.1 * rng.standard_normal(d, dtype=np.float32)).astype(dt)
    if args.no_weight:
        w = None
    rstd = pn.rms_norm(x, w, return_rstd=True)[1]
    # one out= array for both: two arrays of the same size can sit on pages of
    # different speed (a copy into each measured 52 and 82 GB/s in one process)
    out = np.empty_like(x)
    with tempfile.TemporaryDirectory() as tmp:
        old = import_rev(args.rev, Path(tmp))
        new_calls = calls(pn, x, w, r, dy, out, rstd)
        old_calls = calls(old, x, w, r, dy, out, rstd)
        for op in args.ops:
            a = _bytes(new_calls[op]())
            same = a == _bytes(old_calls[op]())
            ratios = []
            for _ in range(args.repeats):
                t, t_old = paired_median(new_calls[op], old_calls[op], min_time=0.4)
                ratios.append(f"{t * 1e3:.2f}/{t_old * 1e3:.2f} ms = {t / t_old:.3f}")
            print(f"{op} {args.dtype} {n}x{d} new/old vs {args.rev}: {'  '.join(ratios)}"
                  f"  [same bits: {same}]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
