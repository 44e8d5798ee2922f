"""Emulated bits of another revision's kernels against this tree's, for the kernels
whose machine code the register work changes (pn_fwd, pn_gated_bwd, pn_bwd_big and
pn_bwd_small for their variants; see KINDS): every output array compared byte for byte
on the CPU emulator (tests/emulator; needs g++), over row lengths, strides (the vector
and the element-by-element bodies), stash sizes, optional arrays and eps modes.
bench/bwd_bits_vs_rev.py does the same for pn_bwd.  The kernels are compiled without
FMA contraction (--fmad=false), so the emulator's rounding is the GPU's.

    git show main:polynorm/backends/cuda/polynorm.cu > /tmp/old.cu
    python bench/bits_vs_rev.py /tmp/old.cu [--kinds bwd_big,bwd_small,fwd,gated_bwd]
"""

import argparse
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


def _rs(a):
    return np.int64(0 if a is None else a.strides[0] // a.itemsize)


def _rows(rng, n, d, dt, pad):
    """(n, d) of dtype dt; with pad, a view of wider rows (stride d + pad: not a multiple of VEC)."""
    a = (rng.standard_normal((n, d + pad)) * 2).astype(NP[dt])
    return a[:, :d] if pad else a


# ---------------------------------------------------------------- pn_bwd_big

BWD_TYPES = cl.BWD_TYPES  # (x, dy, weight): every pn_bwd_big the dispatcher can launch


def bwd_big_names():
    return [cl.bwd_name(*t, None) for t in BWD_TYPES]


def bwd_big_cases(rng):
    for t in BWD_TYPES:
        x_t, dy_t, w_t = t
        vec = cl.VEC[x_t]
        for d, n, pad, smem in ((1000, 3, 0, cl.DEFAULT_SMEM), (3001, 2, 0, 8192), (2 * 1024 * vec + 5, 2, 0, 2048),
                                (997, 3, 1, cl.DEFAULT_SMEM), (4100, 2, 3, 4096)):
            for hw, hg, rs, eps_in in itertools.product((False, True), (False, True), (False, True), (1, 0)):
                x = _rows(rng, n, d, x_t, pad)
                dy = _rows(rng, n, d, dy_t, pad)
                if x_t == "float32":
                    x[0, 3] *= np.float32(1e25)  # the squares' double fallback
                    dy[1 % n, 5] *= np.float32(1e30)  # the g*dy*xhat double fallback
                w = rng.standard_normal(d).astype(NP[w_t]) if hw else None
                g = _rows(rng, n, d, dy_t, pad) if hg else None
                ct = cl.compute_dtype(x_t)
                rstd = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(1) + 1e-6)).astype(NP[ct]) if rs else None
                la = cl.backward_launch(n, d, x_t, dy_t, w_t, num_sms=2, max_smem=smem, force_big=True,
                                        has_w=hw, has_g=hg, split=False)
                assert la.big, la
                k = d if d < 1100 else d - 7
                eps = 0.5 if not eps_in else 1e-6

                def run(mod, la=la, x=x, dy=dy, w=w, g=g, rstd=rstd, n=n, d=d, k=k, eps=eps, eps_in=eps_in, ct=ct,
                        x_t=x_t):
                    dx = np.full((n, d), np.nan, NP[x_t])
                    dwp = np.zeros((la.partial_rows, la.ldp), NP[ct])
                    dbp = np.zeros((la.partial_rows, la.ldp), NP[ct])
                    args = (dy, _rs(dy), x, _rs(x), w, rstd, g, _rs(g), dx, _rs(dx), dwp, dbp, np.int64(la.ldp),
                            np.int64(n), np.int32(d), np.int32(k), np.int32(la.stash),
                            np.float64(eps), np.int32(eps_in), np.float64(0.25))
                    mod.launch(la.name, la.grid, la.block, args, la.shared)
                    return {"dx": dx, "dwp": dwp, "dbp": dbp}

                yield (la.name, d, n, pad, smem, hw, hg, rs, eps_in), la.name, run


# ---------------------------------------------------------------- pn_bwd_small

SMALL_D = (40, 97, 128, 200, 256)  # 16 and 8 lanes per row, the WIDE float rows, a tail


def _bwd_small_launches():
    seen = {}
    for t in BWD_TYPES:
        for d in SMALL_D:
            for hw, hg in itertools.product((False, True), (False, True)):
                la = cl.backward_launch(37, d, *t, num_sms=2, has_w=hw, has_g=hg, split=False)
                if la.name.startswith("pn_bwd_small"):
                    seen.setdefault(la.name, []).append((t, d, hw, hg))
    return seen


def bwd_small_names():
    return sorted(_bwd_small_launches())


def bwd_small_cases(rng):
    for name, cases in sorted(_bwd_small_launches().items()):
        for (x_t, dy_t, w_t), d, hw, hg in cases:
            for n, pad in ((37, 0), (5, 1)):
                for rs, eps_in, partials in itertools.product((False, True), (1, 0), (True, False)):
                    x = _rows(rng, n, d, x_t, pad)
                    dy = _rows(rng, n, d, dy_t, pad)
                    w = rng.standard_normal(d).astype(NP[w_t]) if hw else None
                    g = _rows(rng, n, d, dy_t, pad) if hg else None
                    ct = cl.compute_dtype(x_t)
                    rstd = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(1) + 1e-6)).astype(NP[ct]) if rs else None
                    la = cl.backward_launch(n, d, x_t, dy_t, w_t, num_sms=2, has_w=hw, has_g=hg, split=False,
                                            partials=partials)
                    if la.name != name:
                        continue
                    k = d - 3 if d == 97 else d
                    eps = 0.5 if not eps_in else 1e-6

                    def run(mod, la=la, x=x, dy=dy, w=w, g=g, rstd=rstd, n=n, d=d, k=k, eps=eps, eps_in=eps_in,
                            ct=ct, x_t=x_t, partials=partials):
                        dx = np.full((n, d), np.nan, NP[x_t])
                        dwp = np.full((la.partial_rows, la.ldp), np.nan, NP[ct]) if partials else None
                        dbp = np.full((la.partial_rows, la.ldp), np.nan, NP[ct]) if partials else None
                        args = (dy, _rs(dy), x, _rs(x), w, rstd, g, _rs(g), dx, _rs(dx), dwp, dbp,
                                np.int64(la.ldp), np.int64(n), np.int32(d), np.int32(k), np.int32(la.tpr),
                                np.float64(eps), np.int32(eps_in), np.float64(0.25))
                        mod.launch(la.name, la.grid, la.block, args, la.shared)
                        return {"dx": dx, **({"dwp": dwp[:, :d], "dbp": dbp[:, :d]} if partials else {})}

                    yield (name, d, n, pad, rs, eps_in, partials), name, run


# ---------------------------------------------------------------- pn_fwd (the fused residual add)

FWD_D = (100, 1000, 3000, 8000, 997)  # ITEMS 1 and 2, and a tail


def _fwd_launches():
    seen = {}
    for t in cl.FWD_TYPES:
        for d in FWD_D:
            la = cl.forward_launch(3, d, *t, small=False, split=False)
            if la.name.startswith("pn_fwd<"):
                seen.setdefault(la.name, []).append((t, d))
    return seen


def fwd_names():
    return sorted(_fwd_launches())


def fwd_cases(rng):
    for name, tds in sorted(_fwd_launches().items()):
        for (x_t, r_t, w_t, o_t), d in tds:
            for n, pad in ((3, 0), (2, 1)):
                for has_r, hw, hb, eps_in, llama in itertools.product((True, False), (True, False), (False, True),
                                                                      (1, 0), (0, 1)):
                    x = _rows(rng, n, d, x_t, pad)
                    x[0, 1], x[n - 1, 2] = np.nan, np.inf  # the residual sum of non-finite values
                    res = _rows(rng, n, d, r_t, pad) if has_r else None
                    ht = cl.promote(x_t, r_t) if has_r else x_t
                    ct = cl.compute_dtype(ht)
                    w = rng.standard_normal(d).astype(NP[w_t]) if hw else None
                    b = rng.standard_normal(d).astype(NP[ct]) if hb else None
                    la = cl.forward_launch(n, d, x_t, r_t, w_t, o_t, small=False, split=False)
                    if la.name != name:
                        continue
                    k = d if d < 1100 else d - 7

                    def run(mod, la=la, x=x, res=res, w=w, b=b, n=n, d=d, k=k, eps_in=eps_in, llama=llama, ht=ht,
                            ct=ct, o_t=o_t):
                        h = np.full((n, d), np.nan, NP[ht]) if res is not None else None
                        y = np.full((n, d), np.nan, NP[o_t])
                        rstd = np.full((n,), np.nan, NP[ct])
                        args = (x, _rs(x), res, _rs(res), h, _rs(h), w, b, y, _rs(y), rstd, np.int64(n), np.int32(d),
                                np.int32(k), np.int32(la.tpr), np.float64(0.5 if not eps_in else 1e-6),
                                np.int32(eps_in), np.float64(0.25), np.int32(llama))
                        mod.launch(la.name, la.grid, la.block, args, la.shared)
                        return {"y": y, "rstd": rstd, **({"h": h} if h is not None else {})}

                    yield (name, d, n, pad, has_r, hw, hb, eps_in, llama), name, run


# ---------------------------------------------------------------- pn_gated_bwd

def gated_bwd_names():
    return [cl.gated_bwd_name(*t) for t in cl.GATED_BWD_TYPES]


def gated_bwd_cases(rng):
    for x_t, z_t, dy_t in cl.GATED_BWD_TYPES:
        ct = cl.compute_dtype(x_t)
        for n, d, gs in ((3, 100, 100), (2, 1000, 1000), (2, 1024, 128), (1, 5000, 5000)):
            for nbg, hw, hb, rs, eps_in, part in itertools.product((0, 1), (True, False), (True, False), (False, True),
                                                                   (1, 0), (False, True)):
                x = (rng.standard_normal((n, d)) * 2).astype(NP[x_t])
                z = (rng.standard_normal((n, d)) * 4).astype(NP[z_t])
                z[0, :3] = (100.0, -100.0, 1e-30)  # exp's overflow and underflow, a tiny gate
                dy = rng.standard_normal((n, d)).astype(NP[dy_t])
                w = rng.standard_normal(d).astype(NP[ct]) if hw else None
                b = rng.standard_normal(d).astype(NP[ct]) if hb else None
                groups = d // gs
                rstd = rng.uniform(0.5, 2, (n, groups)).astype(NP[ct]) if rs else None
                la = cl.gated_backward_launch(n, d, gs, x_t, z_t, dy_t)
                k = gs - 3 if part else gs

                def run(mod, la=la, x=x, z=z, dy=dy, w=w, b=b, rstd=rstd, n=n, d=d, gs=gs, k=k, eps_in=eps_in,
                        nbg=nbg, ct=ct, x_t=x_t, z_t=z_t):
                    dx = np.full((n, d), np.nan, NP[x_t])
                    dz = np.full((n, d), np.nan, NP[z_t])
                    lw = np.full((n, d), np.nan, NP[ct]) if w is not None else None
                    lb = np.full((n, d), np.nan, NP[ct]) if b is not None else None
                    args = (dy, x, z, w, b, rstd, dx, dz, lw, lb, np.int64(n), np.int32(d), np.int32(gs), np.int32(k),
                            np.int32(la.tpr), np.float64(0.5 if not eps_in else 1e-6), np.int32(eps_in),
                            np.float64(0.25), np.int32(nbg))
                    mod.launch(la.name, la.grid, la.block, args, la.shared)
                    out = {"dx": dx, "dz": dz}
                    if lw is not None:
                        out["lw"] = lw
                    if lb is not None:
                        out["lb"] = lb
                    return out

                yield (la.name, d, gs, n, nbg, hw, hb, rs, eps_in, part), la.name, run


KINDS = {"bwd_big": (bwd_big_names, bwd_big_cases), "bwd_small": (bwd_small_names, bwd_small_cases),
         "fwd": (fwd_names, fwd_cases),
         "gated_bwd": (gated_bwd_names, gated_bwd_cases)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the other revision's generated polynorm.cu")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {sorted(KINDS)}")
    args = ap.parse_args(argv)
    for kind in args.kinds.split(","):
        names_of, cases = KINDS[kind]
        names = names_of()
        old = compile_source(Path(args.old), names)
        new = compile_source(cl.SOURCE_PATH, names)
        rng = np.random.default_rng(0)
        count = 0
        for case, _name, run in cases(rng):
            a, b = run(old), run(new)
            for what in a:
                if a[what].tobytes() != b[what].tobytes():
                    print("MISMATCH", kind, case, what)
                    return 1
            count += 1
        print(f"{kind}: {count} launches of {len(names)} kernels, every output bit-identical "
              f"({args.old} vs this tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
