"""The Numba backward kernel on ``(n, d)`` rows: dx, and dweight/dbias partials.

Shares the flags, row statistics and codecs of :mod:`._numba_kernels`
(whose docstring states the numerics); this module only adds the backward
(formula in :mod:`polynorm._options`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba_codec import load, prefetch_row, store
from ._numba_kernels import (
    _PREFETCH_EARLY_BYTES,
    _PREFETCH_MAX_BYTES,
    BF_B,
    BF_H,
    BF_W,
    BF_X,
    BF_Y,
    EPS_INSIDE,
    HAS_B,
    HAS_GR,
    HAS_RSTD,
    HAS_W,
    _inline,
    _jit,
    _reduce,
    _row_bytes,
    _stats,
    like,
)

# --------------------------------------------------------------------------- backward


@_inline
def _ld(a, i, j, bf, rc):
    """``a[i, j]`` in the compute type of ``rc``."""
    return like(load(a[i, j], bf), rc)


@_reduce
def _dot_row(dy, x, w, i, rc, oc, flags, part, blk):
    """``sum_j g_j * dy[i, j] * xhat[i, j]``, accumulated in float64.

    With a weight, the same loop adds ``dy * xhat`` to this row block's
    dweight partial (``part[blk, :d]``), saving a pass over the row.
    """
    xbf = (flags & BF_X) != 0
    dybf = (flags & BF_Y) != 0
    c = 0.0
    if flags & HAS_W:
        pw = part[blk, : x.shape[1]]
        for j in range(x.shape[1]):
            p = _ld(dy, i, j, dybf, rc) * (load(x[i, j], xbf) * rc)
            pw[j] += p
            c += np.float64((like(w[j], rc) + oc) * p)
    else:
        for j in range(x.shape[1]):
            c += np.float64(_ld(dy, i, j, dybf, rc) * (load(x[i, j], xbf) * rc))
    return c


@_inline
def _bwd_row(i, dy, x, w, rstd_in, gr, dx, part, blk, flags, k, eps, offset):
    d = x.shape[1]
    xbf = (flags & BF_X) != 0
    dybf = (flags & BF_Y) != 0
    inside = (flags & EPS_INSIDE) != 0
    has_rstd = (flags & HAS_RSTD) != 0
    if i + 1 < x.shape[0] and _row_bytes(x) <= _PREFETCH_EARLY_BYTES:
        # short rows: the next row's x and dy stream in during both passes of this one
        prefetch_row(x, i + 1)
        prefetch_row(dy, i + 1)
    rms = 0.0
    r64 = 0.0
    if not has_rstd or not inside:
        rms, r64 = _stats(x, i, k, xbf, eps, inside)
    if has_rstd:
        r64 = np.float64(rstd_in[i])
        if not r64 < math.inf:  # a float32 rstd that overflowed: recompute it in float64
            rms, r64 = _stats(x, i, k, xbf, eps, inside)
    # rc: rstd in the compute type (float64 for float64 x, else float32)
    rc = like(r64, load(x[i, 0], xbf))
    if r64 < math.inf and not rc < math.inf:
        _bwd_row_wide(i, dy, x, w, gr, dx, part, blk, flags, k, eps, offset, r64, rms)
        return
    oc = like(offset, rc)
    # c = sum_j g*dy*xhat over all d columns, in float64
    c = _dot_row(dy, x, w, i, rc, oc, flags, part, blk)
    coef64 = c / k
    if not inside:
        coef64 = 0.0 if rms == 0.0 else coef64 * ((rms + eps) / rms)
    coef = like(coef64, rc)
    dxi = dx[i]
    if i + 1 < x.shape[0] and _PREFETCH_EARLY_BYTES < _row_bytes(x) <= _PREFETCH_MAX_BYTES:
        prefetch_row(x, i + 1)
        prefetch_row(dy, i + 1)
    # branch-free loops (so that they vectorize): the masked term only for j < k.
    # (A non-finite x beyond k gives NaN there instead of rstd*g*dy: the token is
    # non-finite either way.)
    _dx_range(i, 0, k, dy, x, w, gr, dxi, rc, oc, coef, flags)
    if k < d:
        _dx_range(i, k, d, dy, x, w, gr, dxi, rc, oc, like(0.0, rc), flags)
    # dbias partial of this row block (dweight's is done in _dot_row);
    # its own loop: LLVM cannot rule out that the two halves of ``part`` overlap
    if flags & HAS_B:
        pb = part[blk, d:]
        for j in range(d):
            pb[j] += _ld(dy, i, j, dybf, rc)


@_inline
def _bwd_row_wide(i, dy, x, w, gr, dx, part, blk, flags, k, eps, offset, r64, rms):
    """The backward of a row whose rstd overflows float32, in float64 (rare: a
    float32 row of rms < ~3e-39 with a tiny eps; dx itself is then beyond float32)."""
    d = x.shape[1]
    xbf = (flags & BF_X) != 0
    dybf = (flags & BF_Y) != 0
    has_w = (flags & HAS_W) != 0
    c = 0.0
    for j in range(d):
        g = np.float64(w[j]) + offset if has_w else 1.0
        c += g * np.float64(load(dy[i, j], dybf)) * (np.float64(load(x[i, j], xbf)) * r64)
    coef = c / k
    if not flags & EPS_INSIDE:
        coef = 0.0 if rms == 0.0 else coef * ((rms + eps) / rms)
    dxi = dx[i]
    for j in range(d):
        xh = np.float64(load(x[i, j], xbf)) * r64
        dyv = np.float64(load(dy[i, j], dybf))
        g = np.float64(w[j]) + offset if has_w else 1.0
        v = r64 * (g * dyv - (xh * coef if j < k else 0.0))
        if flags & HAS_GR:
            v += np.float64(load(gr[i, j], (flags & BF_H) != 0))
        store(dxi, j, v, xbf)
        if has_w:
            part[blk, j] += dyv * xh
        if flags & HAS_B:
            part[blk, d + j] += dyv


@_inline
def _dx_range(i, lo, hi, dy, x, w, gr, dxi, rc, oc, coef, flags):
    """``dx[i, lo:hi] = rstd * (g*dy - xhat*coef) (+ grad_residual)``, one loop per case."""
    xbf = (flags & BF_X) != 0
    dybf = (flags & BF_Y) != 0
    grbf = (flags & BF_H) != 0
    has_w = (flags & HAS_W) != 0
    if flags & HAS_GR:
        if has_w:
            for j in range(lo, hi):
                xh = load(x[i, j], xbf) * rc
                g = like(w[j], rc) + oc
                v = rc * (_ld(dy, i, j, dybf, rc) * g - xh * coef)
                store(dxi, j, v + _ld(gr, i, j, grbf, rc), xbf)
        else:
            for j in range(lo, hi):
                xh = load(x[i, j], xbf) * rc
                v = rc * (_ld(dy, i, j, dybf, rc) - xh * coef)
                store(dxi, j, v + _ld(gr, i, j, grbf, rc), xbf)
    elif has_w:
        for j in range(lo, hi):
            xh = load(x[i, j], xbf) * rc
            g = like(w[j], rc) + oc
            store(dxi, j, rc * (_ld(dy, i, j, dybf, rc) * g - xh * coef), xbf)
    else:
        for j in range(lo, hi):
            xh = load(x[i, j], xbf) * rc
            store(dxi, j, rc * (_ld(dy, i, j, dybf, rc) - xh * coef), xbf)


@_jit()
def backward_blocks(lo, hi, rows, dy, x, w, rstd_in, gr, dx, part, flags, k, eps, offset):
    """Row blocks [lo, hi) on one thread: the serial path, and the parallel path's task."""
    n = x.shape[0]
    for blk in range(lo, hi):
        for i in range(blk * rows, min(n, (blk + 1) * rows)):
            _bwd_row(i, dy, x, w, rstd_in, gr, dx, part, blk, flags, k, eps, offset)


@_jit(parallel=True)
def backward_parallel(rows, dy, x, w, rstd_in, gr, dx, part, flags, k, eps, offset):
    for blk in prange(part.shape[0]):
        backward_blocks(blk, blk + 1, rows, dy, x, w, rstd_in, gr, dx, part, flags, k, eps,
                        offset)


@_jit()
def reduce_cols(lo, hi, part, dw, db, flags):
    """dweight/dbias columns [lo, hi): the block partials summed in block order
    (the same bits for any thread count), rounded once to their dtypes."""
    d = dw.shape[0]
    nblk = part.shape[0]
    wbf = (flags & BF_W) != 0
    bbf = (flags & BF_B) != 0
    if flags & HAS_W:
        for j in range(lo, hi):
            sw = 0.0
            for blk in range(nblk):
                sw += part[blk, j]
            store(dw, j, sw, wbf)
    if flags & HAS_B:
        for j in range(lo, hi):
            sb = 0.0
            for blk in range(nblk):
                sb += part[blk, d + j]
            store(db, j, sb, bbf)


@_jit(parallel=True)
def reduce_parallel(part, dw, db, flags):
    d = dw.shape[0]
    chunk = 1024
    for c in prange((d + chunk - 1) // chunk):
        reduce_cols(c * chunk, min(d, (c + 1) * chunk), part, dw, db, flags)
