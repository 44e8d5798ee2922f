"""Emulated bits of another revision's pn_bwd<XT, DYT, WT, 1[, HAS_W, HAS_G]> against this tree's
pn_bwd<XT, DYT, WT, 1, HAS_W, HAS_G>: dx and the raw dweight / dbias partial rows, on the
CPU emulator (tests/emulator; needs g++), for the launches the dispatcher makes.

    git show main:polynorm/backends/cuda/polynorm.cu > /tmp/old.cu
    python bench/bwd_bits_vs_rev.py /tmp/old.cu
"""

import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from emulator import compile_source  # noqa: E402

from polynorm.backends.cuda import launch as cl  # noqa: E402

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
TYPES = [("bfloat16", "bfloat16", "bfloat16"), ("float16", "float32", "float32"), ("float32",) * 3, ("float64",) * 3,
         ("bfloat16", "bfloat16", "float32")]


def _old_name(old_has_wg: bool, t: tuple, hw: bool, hg: bool) -> str:
    return cl.bwd_name(*t, 1, hw, hg) if old_has_wg else f"pn_bwd<{cl._ct(*t)}, 1>"


def main(old_source: str) -> int:
    # revisions before the HAS_W / HAS_G template parameters name pn_bwd<XT, DYT, WT, ITEMS>
    old_has_wg = "int ITEMS, bool HAS_W, bool HAS_G>\n__global__" in Path(old_source).read_text()
    old = compile_source(Path(old_source), sorted({_old_name(old_has_wg, t, hw, hg) for t in TYPES
                                                   for hw in (False, True) for hg in (False, True)}))
    new = compile_source(cl.SOURCE_PATH, [cl.bwd_name(*t, 1, hw, hg) for t in TYPES for hw in (False, True)
                                          for hg in (False, True)])
    rng = np.random.default_rng(0)
    cases = 0
    for t in TYPES:
        x_t, dy_t, w_t = t
        ct = cl.compute_dtype(x_t)
        for d, n, hw, hg, rs, eps_in in itertools.product((5, 64, 100, 1000, 3000), (1, 37, 150), (False, True),
                                                          (False, True), (False, True), (1, 0)):
            # n = 150 at short rows: several rows per lane (the row ring wraps)
            if d // cl.VEC[x_t] > 512 or (n == 150 and (d > 100 or rs)):
                continue
            x = (rng.standard_normal((n, d)) * 2).astype(NP[x_t])
            dy = rng.standard_normal((n, d)).astype(NP[dy_t])
            if x_t == "float32" and n > 4:
                x[2] *= np.float32(1e25)  # the squares' double fallback
                dy[4] *= np.float32(1e30)  # the g*dy*xhat double fallback
            w = rng.standard_normal(d).astype(NP[w_t]) if hw else None
            g = rng.standard_normal((n, d)).astype(NP[dy_t]) if hg else None
            rstd = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(1) + 1e-6)).astype(NP[ct]) if rs else None
            la = cl.backward_launch(n, d, x_t, dy_t, w_t, num_sms=3, has_w=hw, has_g=hg)
            outs = []
            for mod, nm in ((old, _old_name(old_has_wg, t, hw, hg)), (new, la.name)):
                dx = np.full((n, d), np.nan, NP[x_t])
                dwp = np.full((la.partial_rows, la.ldp), np.nan, NP[ct])
                dbp = np.full((la.partial_rows, la.ldp), np.nan, NP[ct])

                def rs_(a):
                    return np.int64(0 if a is None else a.strides[0] // a.itemsize)

                args = (dy, rs_(dy), x, rs_(x), w, rstd, g, rs_(g), dx, rs_(dx), dwp, dbp, np.int64(la.ldp),
                        np.int64(n), np.int32(d), np.int32(d if d < 100 else d - 7), np.int32(la.tpr),
                        np.float64(0.5 if not eps_in else 1e-6), np.int32(eps_in), np.float64(0.25))
                mod.launch(nm, la.grid, la.block, args, la.shared)
                outs.append((dx, dwp[:, :d], dbp[:, :d]))
            for a, b, what in zip(outs[0], outs[1], ("dx", "dwp", "dbp"), strict=True):
                if a.tobytes() != b.tobytes():
                    print("MISMATCH", t, d, n, hw, hg, rs, eps_in, what)
                    return 1
            cases += 1
    print(f"{cases} launches: dx, dweight partials, dbias partials bit-identical ({old_source} vs this tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
