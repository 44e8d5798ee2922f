"""The Numba backward kernel on ``(n, d)`` rows: dx, and dweight/dbias tree nodes.

Shares the flags, row statistics and codecs of :mod:`._numba_kernels`
(whose docstring states the numerics); this module adds the backward
(formula in :mod:`polynorm._options`).  ``dweight``/``dbias`` are summed over
the row tree of :mod:`._rowtree`, an order fixed by the global row index:
:func:`backward_range` streams a range of rows and leaves the tree nodes it
completes; ranges may be row blocks on threads or dask chunks on a cluster,
and the bits are those of one call on all rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._numba_codec import load, prefetch_row, store
from ._numba_kernels import (
    _PREFETCH_EARLY_BYTES,
    _PREFETCH_MAX_BYTES,
    BF_H,
    BF_X,
    BF_Y,
    EPS_INSIDE,
    HAS_B,
    HAS_GR,
    HAS_RSTD,
    HAS_W,
    _inline,
    _jit,
    _row_bytes,
    _stats,
    like,
)

# --------------------------------------------------------------------------- backward


@_inline
def _ld(a, i, j, bf, rc):
    """``a[i, j]`` in the compute type of ``rc``."""
    return like(load(a[i, j], bf), rc)


#: Elements of padding on each side of a row of the leaf pool (>= 256 bytes).
_PAD = 64

#: Tree nodes below this level (2**4 rows) are summed in the compute dtype,
#: from it up in float64 (see :mod:`polynorm.backends._rowtree`).
TREE_G = 4


# "reassoc" only (no "contract"): a leaf's add ``addend + dy*xhat`` must be the
# plain add that the tree's other adds are (an FMA would round differently);
# c's float64 add of a float32 product cannot be contracted anyway.
_dot_reduce = njit(nogil=True, fastmath={"reassoc"})


@_dot_reduce
def _dot_row(dy, x, w, i, rc, oc, flags, leaf, addend):
    """``sum_j g_j * dy[i, j] * xhat[i, j]``, accumulated in float64.

    With a weight, the same loop writes ``addend[:d] + dy * xhat`` (compute
    dtype) into ``leaf[:d]``: the row's dweight leaf joined with its left
    sibling (the tree's first add), or alone when ``addend`` is -0.0 (which
    adds nothing, not even to a zero's sign).  One loop for both, so that ``c``
    has the same bits whichever it is.
    """
    xbf = (flags & BF_X) != 0
    dybf = (flags & BF_Y) != 0
    c = 0.0
    if flags & HAS_W:
        for j in range(x.shape[1]):
            p = _ld(dy, i, j, dybf, rc) * (load(x[i, j], xbf) * rc)
            leaf[j] = addend[j] + p
            c += np.float64((like(w[j], rc) + oc) * p)
    else:
        for j in range(x.shape[1]):
            c += np.float64(_ld(dy, i, j, dybf, rc) * (load(x[i, j], xbf) * rc))
    return c


@_inline
def _bwd_row(i, dy, x, w, rstd_in, gr, dx, leaf, addend, flags, k, eps, offset):
    """dx of row ``i``; its dweight/dbias leaf (``dy*xhat`` then ``dy``, for
    whichever of weight/bias there is) plus ``addend`` goes to ``leaf``."""
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
        _bwd_row_wide(i, dy, x, w, gr, dx, leaf, addend, flags, k, eps, offset, r64, rms)
        return
    oc = like(offset, rc)
    # c = sum_j g*dy*xhat over all d columns, in float64
    c = _dot_row(dy, x, w, i, rc, oc, flags, leaf, addend)
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
    if flags & HAS_B:
        ob = d if flags & HAS_W else 0
        for j in range(d):
            leaf[ob + j] = addend[ob + j] + _ld(dy, i, j, dybf, rc)


@_inline
def _bwd_row_wide(i, dy, x, w, gr, dx, leaf, addend, flags, k, eps, offset, r64, rms):
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
    ob = d if has_w else 0
    for j in range(d):
        xh = np.float64(load(x[i, j], xbf)) * r64
        dyv = np.float64(load(dy[i, j], dybf))
        g = np.float64(w[j]) + offset if has_w else 1.0
        v = r64 * (g * dyv - (xh * coef if j < k else 0.0))
        if flags & HAS_GR:
            v += np.float64(load(gr[i, j], (flags & BF_H) != 0))
        store(dxi, j, v, xbf)
        if has_w:
            leaf[j] = addend[j] + like(dyv * xh, leaf[0])
        if flags & HAS_B:
            leaf[ob + j] = addend[ob + j] + like(dyv, leaf[0])


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


# --------------------------------------------------------------------------- the row tree
#
# dweight/dbias are summed over a binary tree fixed by the GLOBAL row index
# (polynorm/backends/_rowtree.py states it and merges nodes in numpy): node
# (level, j) covers rows [j*2**level, (j+1)*2**level); a node whose right child
# holds no row is its left child.  Any split of the rows into contiguous ranges --
# threads, blocks, dask chunks -- computes the same nodes, so the result has
# the same bits.  The adds here are plain IEEE adds (no fastmath), exactly
# the numpy adds of _rowtree.


@_inline
def _row(pool, r):
    """Row ``r`` of a padded pool (contiguous: its loops vectorize)."""
    return pool[r, _PAD:pool.shape[1] - _PAD]


@_inline
def _emit(lv, j, r, pc, p64, out_lvl, out_idx, out_val, o):
    """Append node ``(lv, j)``, held in pool row ``r``, to the output slots."""
    out_lvl[o] = lv
    out_idx[o] = j
    dst = out_val[o]
    if lv < TREE_G:
        src = _row(pc, r)
        for t in range(dst.shape[0]):
            dst[t] = src[t]
    else:
        src64 = _row(p64, r)
        for t in range(dst.shape[0]):
            dst[t] = src64[t]
    return o + 1


@_inline
def _carry(lv, j, glo, ntot, cap, pc, p64, prow, crow, pend, out_lvl, out_idx, out_val, o):
    """Carry the finished node ``(lv, j)`` (held in the current pool row) up the tree.

    It merges with its pending left sibling, waits (pending) for a right
    sibling that has rows, or is passed up when the right sibling is empty;
    it is emitted when it reaches level ``cap`` or its left sibling lies
    before the range start ``glo``.  Nodes below TREE_G live in the pool
    ``pc`` (compute dtype), the others in ``p64``; ``prow[lv]`` is the row
    of level ``lv``'s pending node and ``crow`` = [current row in pc, in p64]:
    a node that waits swaps rows instead of being copied.  Returns the
    number of emitted nodes.
    """
    while lv < cap:
        if j & 1:
            if ((j - 1) << lv) < glo:
                break
            if lv + 1 < TREE_G:
                a, r = _row(pc, prow[lv]), _row(pc, crow[0])
                for t in range(r.shape[0]):
                    r[t] = a[t] + r[t]
            elif lv + 1 == TREE_G:
                a, r, r64 = _row(pc, prow[lv]), _row(pc, crow[0]), _row(p64, crow[1])
                for t in range(r.shape[0]):
                    r64[t] = np.float64(a[t]) + np.float64(r[t])
            else:
                a, r64 = _row(p64, prow[lv]), _row(p64, crow[1])
                for t in range(r64.shape[0]):
                    r64[t] = a[t] + r64[t]
            pend[lv] = -1
        elif ((j + 1) << lv) < ntot:
            side = 0 if lv < TREE_G else 1
            prow[lv], crow[side] = crow[side], prow[lv]
            pend[lv] = j
            return o
        elif lv + 1 == TREE_G:
            r, r64 = _row(pc, crow[0]), _row(p64, crow[1])
            for t in range(r.shape[0]):
                r64[t] = r[t]
        lv += 1
        j >>= 1
    return _emit(lv, j, crow[0] if lv < TREE_G else crow[1], pc, p64, out_lvl, out_idx, out_val,
                 o)


@_inline
def _group16(g, row0, ntot, cap, glo, dy, x, w, rstd_in, gr, dx, flags, k, eps, offset, grp,
             nothing, pc, p64, prow, crow, pend, out_lvl, out_idx, out_val, o):
    """The 16 rows of a whole aligned group from ``g``: its level-4 node (TREE_G = 4).

    Each pair of rows leaves its level-1 node in a row of ``grp`` (the first
    add fused into the odd row's pass); then one elementwise pass sums the
    eight pair nodes in the tree's order, in registers -- instead of seven
    passes over rows of partials.  Then the node is carried on up.
    """
    tmp = _row(grp, 8)
    for t in range(8):
        i = g + 2 * t - row0
        _bwd_row(i, dy, x, w, rstd_in, gr, dx, tmp, nothing, flags, k, eps, offset)
        _bwd_row(i + 1, dy, x, w, rstd_in, gr, dx, _row(grp, t), tmp, flags, k, eps, offset)
    b0, b1, b2, b3 = _row(grp, 0), _row(grp, 1), _row(grp, 2), _row(grp, 3)
    b4, b5, b6, b7 = _row(grp, 4), _row(grp, 5), _row(grp, 6), _row(grp, 7)
    r64 = _row(p64, crow[1])
    for e in range(r64.shape[0]):
        left = (b0[e] + b1[e]) + (b2[e] + b3[e])
        right = (b4[e] + b5[e]) + (b6[e] + b7[e])
        r64[e] = np.float64(left) + np.float64(right)
    return _carry(TREE_G, g >> TREE_G, glo, ntot, cap, pc, p64, prow, crow, pend, out_lvl,
                  out_idx, out_val, o)


@_jit()
def backward_range(glo, ghi, row0, ntot, cap, dy, x, w, rstd_in, gr, dx, flags, k, eps, offset,
                   out_lvl, out_idx, out_val, o):
    """Global rows ``[glo, ghi)`` (local row = global - ``row0``; ``ntot`` rows in all).

    Writes their dx and appends the row tree's nodes of the range, carried
    at most to level ``cap``, to ``out_*`` from slot ``o`` (a range that
    covers an aligned ``2**cap`` block, or the rows of one up to ``ntot``,
    gives exactly one node).  Returns the new slot count.
    """
    W = out_val.shape[1]
    if W == 0:
        for g in range(glo, ghi):
            _bwd_row(g - row0, dy, x, w, rstd_in, gr, dx, out_val[0], out_val[0], flags, k, eps,
                     offset)
        return o
    levels = max(cap, TREE_G) + 1
    # The row pass's loop stores leaves while it sums c; LLVM vectorizes it
    # behind a runtime check that the stores cannot reach the arrays read, and
    # falls back to a scalar loop (another summation order for c: other bits)
    # when two of them lie close.  Padding every pool row keeps all of them
    # far apart, so the vector loop always runs.
    pc = np.empty((TREE_G + 2, W + 2 * _PAD), w.dtype)
    p64 = np.empty((levels + 1, W + 2 * _PAD), np.float64)
    nothing = _row(pc, TREE_G + 1)  # the addend of a leaf that has no sibling to join
    nothing[:] = -0.0
    prow = np.arange(levels)  # levels >= TREE_G index p64, the others pc
    crow = np.array([TREE_G, levels])
    pend = np.full(levels, -1, np.int64)
    grp = np.empty((9, W + 2 * _PAD), w.dtype)  # a 16-row group: 8 pair nodes, 1 even leaf
    g = glo
    while g < ghi:
        if (g & 15) == 0 and g + 16 <= ghi and g + 16 <= ntot:
            o = _group16(g, row0, ntot, cap, glo, dy, x, w, rstd_in, gr, dx, flags, k, eps,
                         offset, grp, nothing, pc, p64, prow, crow, pend, out_lvl, out_idx,
                         out_val, o)
            g += 16
            continue
        i = g - row0
        if (g & 1) == 0 and g + 1 < ntot and cap > 0:
            # a left leaf whose sibling has rows: written straight to its waiting row
            _bwd_row(i, dy, x, w, rstd_in, gr, dx, _row(pc, prow[0]), nothing, flags, k, eps,
                     offset)
            pend[0] = g
        elif g & 1 and g - 1 >= glo:
            # a right leaf: the first add (with its waiting sibling) fused into the row pass
            _bwd_row(i, dy, x, w, rstd_in, gr, dx, _row(pc, crow[0]), _row(pc, prow[0]), flags,
                     k, eps, offset)
            pend[0] = -1
            o = _carry(1, g >> 1, glo, ntot, cap, pc, p64, prow, crow, pend, out_lvl, out_idx,
                       out_val, o)
        else:
            _bwd_row(i, dy, x, w, rstd_in, gr, dx, _row(pc, crow[0]), nothing, flags, k, eps,
                     offset)
            o = _carry(0, g, glo, ntot, cap, pc, p64, prow, crow, pend, out_lvl, out_idx,
                       out_val, o)
        g += 1
    # nodes still waiting for a right sibling beyond the range, left to right
    for lv in range(levels - 1, -1, -1):
        if pend[lv] >= 0:
            o = _emit(lv, pend[lv], prow[lv], pc, p64, out_lvl, out_idx, out_val, o)
    return o


@_jit(parallel=True)
def backward_blocks_parallel(b0, nb, m, row0, nrows, ntot, dy, x, w, rstd_in, gr, dx, flags, k,
                             eps, offset, out_lvl, out_idx, out_val):
    """Aligned ``2**m``-row blocks ``b0 .. b0+nb-1``, each wholly inside the rows
    (global ``[row0, row0+nrows)``): one node per block, in slot ``block - b0``."""
    for t in prange(nb):
        s = np.int64(t)  # prange's index may be unsigned: int64 + uint64 is float64
        b = b0 + s
        backward_range(b << m, min(row0 + nrows, (b + 1) << m), row0, ntot, m, dy, x, w, rstd_in,
                       gr, dx, flags, k, eps, offset, out_lvl, out_idx, out_val, s)


@_jit()
def tree_cols(lo, hi, vals, cnt):
    """Columns ``[lo, hi)`` of ``cnt`` consecutive sibling-aligned nodes of one
    level (the first of them at an even index): summed pairwise, level by
    level, into ``vals[0]``, in place; the last odd node is passed up."""
    while cnt > 1:
        half = cnt // 2
        for jj in range(half):
            for t in range(lo, hi):
                vals[jj, t] = vals[2 * jj, t] + vals[2 * jj + 1, t]
        if cnt & 1:
            for t in range(lo, hi):
                vals[half, t] = vals[cnt - 1, t]
        cnt = half + (cnt & 1)


@_jit(parallel=True)
def tree_parallel(vals, cnt):
    W = vals.shape[1]
    chunk = 1024
    for c in prange((W + chunk - 1) // chunk):
        tree_cols(c * chunk, min(W, (c + 1) * chunk), vals, cnt)


@_jit()
def round_into(src, dst, bf):
    """``dst[:] = src`` (float64) rounded once to ``dst``'s type (uint16 bits:
    bfloat16 if ``bf``, else float16)."""
    for j in range(dst.shape[0]):
        store(dst, j, src[j], bf)
