"""The Numba backward kernel on ``(n, d)`` rows: dx, and dweight/dbias tree nodes.

Shares the flags, row statistics and codecs of :mod:`.numba.kernels`
(whose docstring states the numerics); this module adds the backward
(formula in :mod:`polynorm.core.options`).  ``dweight``/``dbias`` are summed over
the row tree of :mod:`.rowtree`, an order fixed by the global row index:
:func:`backward_range` streams a range of rows and leaves the tree nodes it
completes; ranges may be row blocks on threads or dask chunks on a cluster,
and the bits are those of one call on all rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_thread_id, prange, types
from numba.extending import overload

from polynorm.backends.numba.codec import load, prefetch_row, prefetch_span, store
from polynorm.backends.numba.kernels import (
    _PREFETCH_EARLY_BYTES,
    _PREFETCH_MAX_BYTES,
    DOT_BLOCK,
    EPS_INSIDE,
    HAS_B,
    HAS_GR,
    HAS_RSTD,
    STREAM_DX,
    _borrow_opt,
    _inline,
    _is_bits,
    _jit,
    _reduce,
    _row_bytes,
    _stats,
    as_type_of,
)
from polynorm.backends.numba.pairs import (
    PAIR_BLOCK,
    dot_pairs,
    dx_pairs,
    pair_position,
    pair_weight,
    pairs_kernel,
)
from polynorm.backends.numba.refs import borrow, row_of
from polynorm.backends.numba.stream import LINE, line_gap, stream_copy, stream_fence
from polynorm.backends.rowtree import TREE_G

assert TREE_G == 4, "_group_node spells out the adds of a 16-row node"

# --------------------------------------------------------------------------- backward


@_inline
def _ld(a, i, j, rc):
    """``a[i, j]`` in the compute type of ``rc``."""
    return as_type_of(load(a[i, j]), rc)


#: Columns of a dx-pass chunk, each with the next row's prefetches of its
#: columns (rows > 4 KB with a weight): spread over the pass, they do not
#: stall on the cache's miss buffers as one whole-row burst does
#: (``python bench/compare.py`` times a change of it).
_BWD_CHUNK = 256

#: Elements of padding on each side of a row of the leaf pool (>= 256 bytes).
_PAD = 64


#: Bytes of a whole 16-row node's terms (16 float32 pool rows) up to which a
#: range's rows go through :func:`_group_node`; wider rows fold their
#: waiting siblings in as they go, which costs the dx pass less than reading
#: 16 rows back from the far half of the L2 or beyond.  float16's folding
#: loop (LLVM's, with a conversion each way per element) costs more than the
#: others': its rows group up to the size of an L2.  float64 rows, and
#: bfloat16 rows that do not take the pair pass, always group.  ``python
#: bench/compare.py --ops bwd`` times a change of these; the measurements are
#: in bench/results/bwd-bf16-pairs-2026-12-05-avx2.txt and
#: bench/results/bwd-fold-2026-12-05-avx2.txt.
_GROUP_MAX_BYTES = 128 * 1024
_GROUP_MAX_BYTES_F16 = 512 * 1024


def _group_max_bytes(x, npair):  # pragma: no cover - replaced by the overload
    """:data:`_GROUP_MAX_BYTES` for rows ``x`` (``npair``: columns in the pair
    pass); bfloat16 rows without the pair pass and float64 rows: no limit."""
    raise NotImplementedError


@overload(_group_max_bytes, inline="always")
def _ov_group_max_bytes(x, npair):
    if x.dtype == types.uint16:  # bfloat16 bits: the pair pass folds cheaply
        return lambda x, npair: _GROUP_MAX_BYTES if npair else 1 << 62
    if x.dtype == types.int16:  # float16 bits
        return lambda x, npair: _GROUP_MAX_BYTES_F16
    limit = _GROUP_MAX_BYTES if x.dtype == types.float32 else 1 << 62
    return lambda x, npair: limit


@_reduce
def _dot_row(dy, x, w, i, rc, oc):
    """``c = sum_j g_j * dy[i, j] * xhat[i, j]``: float32 partials over blocks of
    DOT_BLOCK elements, added in float64 (in float64 throughout for float64 x).

    Float64 element by element costs a large part of the backward; the
    blocks keep the error at ~DOT_BLOCK/64 float32 roundings of the row's
    sum of magnitudes.  A pure reduction (no stores): LLVM vectorizes it the
    same way for every row, so a row's ``c`` has the same bits wherever the
    row falls.  bfloat16 rows with a weight take :func:`.numba.pairs.dot_pairs`
    instead (the same blocks, an order written out).
    """
    d = x.shape[1]
    c = 0.0
    # unsigned indices: no negative-index wraparound, or the loops do not vectorize
    for b in range(np.uint64(0), np.uint64(d), np.uint64(DOT_BLOCK)):
        e = min(b + np.uint64(DOT_BLOCK), np.uint64(d))
        s = as_type_of(0.0, rc)
        if w is not None:
            for j in range(b, e):
                s += (as_type_of(w[j], rc) + oc) * (_ld(dy, i, j, rc) * (load(x[i, j]) * rc))
        else:
            for j in range(b, e):
                s += _ld(dy, i, j, rc) * (load(x[i, j]) * rc)
        c += np.float64(s)
    return c


@_inline
def _bwd_row(i, dy, x, w, rstd_in, gr, dx, flags, k, eps, offset, depth, pc, ro, rw, rneg,
             rtmp, stage, g2):
    """dx of row ``i``, and its node of the row tree.

    The row's terms (``[dy*xhat | dy]``, for whichever of weight/bias there
    is) joined with the ``depth`` (< TREE_G) waiting left siblings in pool
    rows ``rw[0..depth-1]`` -- the tree's adds, in its order -- go to pool
    row ``ro``.  Absent siblings read row ``rneg``, -0.0, which adds nothing:
    one loop serves every depth.  dweight's adds are fused into the dx pass.
    ``g2``: the weight in the pair layout (:mod:`.numba.pairs`) for its
    first ``len(g2)`` columns, whose terms go to the pool in that layout.

    ``gr`` is an array whether the call has one or not (a stand-in; flag
    HAS_GR): calls with and without it share one compiled kernel.  The
    branch on the flag is at each call of the column loops, which are
    compiled for each case (a wrapper function that branched instead made
    LLVM compile the float32 loops slower: 2048 x 4096 rows took 20% longer).

    Pool rows are indices, not array views: a view per row costs Numba
    reference-count calls on every row.
    """
    d = x.shape[1]
    inside = (flags & EPS_INSIDE) != 0
    has_gr = (flags & HAS_GR) != 0
    e0 = rw[0] if depth >= 1 else rneg
    e1 = rw[1] if depth >= 2 else rneg
    e2 = rw[2] if depth >= 3 else rneg
    if i + 1 < x.shape[0] and _row_bytes(x) <= _PREFETCH_EARLY_BYTES:
        # short rows: the next row's x and dy stream in during both passes of this one
        prefetch_row(x, i + 1)
        prefetch_row(dy, i + 1)
    have_rstd = (flags & HAS_RSTD) != 0
    rms = 0.0
    r64 = 0.0
    if not have_rstd or not inside:
        rms, r64 = _stats(x, i, k, eps, inside)
    if have_rstd:
        r64 = np.float64(rstd_in[i])
        if not r64 < math.inf:  # a float32 rstd that overflowed: recompute it in float64
            rms, r64 = _stats(x, i, k, eps, inside)
    # rc: rstd in the compute type (float64 for float64 x, else float32)
    rc = as_type_of(r64, load(x[i, 0]))
    if flags & HAS_B:
        # dbias's terms before dx is written: dx may be dy's memory (out=dy)
        ob = d if w is not None else 0
        P = _PAD
        for j in range(d):
            pc[rtmp, P + j] = as_type_of(load(dy[i, j]), pc[rtmp, P])
        _fold(pc, ro, e0, e1, e2, rtmp, ob, d)
    if r64 < math.inf and not rc < math.inf:
        _bwd_row_wide(i, dy, x, w, gr, dx, flags, k, eps, offset, r64, rms, pc, ro, e0, e1, e2,
                      rtmp, g2.shape[0])
    else:
        oc = as_type_of(offset, rc)
        # rows as (1, d) C arrays (row_of): one compiled dot for every layout
        if pairs_kernel(x, w, None) and g2.shape[0] > 0:
            c = dot_pairs(x, dy, g2, w, i, rc, oc)
        else:
            c = _dot_row(row_of(dy, i), row_of(x, i), w, 0, rc, oc)
        coef64 = c / k
        if not inside:
            coef64 = 0.0 if rms == 0.0 else coef64 * ((rms + eps) / rms)
        coef = as_type_of(coef64, rc)
        chunked = (w is not None and i + 1 < x.shape[0]
                   and _row_bytes(x) > _PREFETCH_EARLY_BYTES)
        if (not chunked and i + 1 < x.shape[0]
                and _PREFETCH_EARLY_BYTES < _row_bytes(x) <= _PREFETCH_MAX_BYTES):
            prefetch_row(x, i + 1)
            prefetch_row(dy, i + 1)
        # the masked term only for j < k: two ranges, each a branch-free loop
        # (a non-finite x beyond k gives NaN there instead of rstd*g*dy: the
        # token is non-finite either way)
        zero = as_type_of(0.0, rc)
        if w is not None:
            # rows > 4 KB in chunks, each asking for the next row's x and dy
            # of its columns: DRAM streams under the compute
            fold = depth > 0
            step = _BWD_CHUNK if chunked else max(d, 1)
            # whole 64-byte lines of dx a chunk at a time: through the stage (in L1)
            # and streaming stores, which do not read the lines first
            # (16-bit dx never: _is_bits is a compile-time constant, and their
            # kernels compile without the branch)
            streams = (not _is_bits(dx) and (flags & STREAM_DX) != 0 and chunked
                       and line_gap(dx, i) == 0 and (step * dx.itemsize) % LINE == 0)
            npair = g2.shape[0]
            for jc in range(0, d, step):
                je = min(jc + step, d)
                if chunked:
                    prefetch_span(x, i + 1, jc, je - jc)
                    prefetch_span(dy, i + 1, jc, je - jc)
                if pairs_kernel(x, w, None) and jc < npair:
                    # whole blocks as pairs (jc is a multiple of the block); the
                    # row's last columns, if any, as below
                    jp = min(je, npair)
                    dx_pairs(x, dy, dx, g2, pc, _PAD, i, jc, jp, k, rc, coef, ro, e0, e1, e2,
                             fold)
                    jc = jp
                    if jc == je:
                        continue
                jm = min(max(k, jc), je)
                if streams and je - jc == step:
                    # two passes where the chunk spans k, as below (one pass with the
                    # coefficient selected ran 1.6-1.8x slower)
                    if jc < jm:
                        if has_gr:
                            _dx_pass(i, jc, jm, dy, x, w, gr, stage, 0, jc, rc, oc, coef, pc, ro,
                                     e0, e1, e2, fold)
                        else:
                            _dx_pass(i, jc, jm, dy, x, w, None, stage, 0, jc, rc, oc, coef, pc, ro,
                                     e0, e1, e2, fold)
                    if jm < je:
                        if has_gr:
                            _dx_pass(i, jm, je, dy, x, w, gr, stage, 0, jc, rc, oc, zero, pc, ro,
                                     e0, e1, e2, fold)
                        else:
                            _dx_pass(i, jm, je, dy, x, w, None, stage, 0, jc, rc, oc, zero, pc, ro,
                                     e0, e1, e2, fold)
                    stream_copy(dx, i, jc, stage, step)
                    continue
                if jc < jm:
                    if has_gr:
                        _dx_pass(i, jc, jm, dy, x, w, gr, dx, i, 0, rc, oc, coef, pc, ro,
                                 e0, e1, e2, fold)
                    else:
                        _dx_pass(i, jc, jm, dy, x, w, None, dx, i, 0, rc, oc, coef, pc, ro,
                                 e0, e1, e2, fold)
                if jm < je:
                    if has_gr:
                        _dx_pass(i, jm, je, dy, x, w, gr, dx, i, 0, rc, oc, zero, pc, ro,
                                 e0, e1, e2, fold)
                    else:
                        _dx_pass(i, jm, je, dy, x, w, None, dx, i, 0, rc, oc, zero, pc, ro,
                                 e0, e1, e2, fold)
        elif has_gr:
            _dx_plain(i, np.intp(0), k, dy, x, gr, dx, rc, oc, coef)
            if k < d:
                _dx_plain(i, k, d, dy, x, gr, dx, rc, oc, zero)
        else:
            _dx_plain(i, np.intp(0), k, dy, x, None, dx, rc, oc, coef)
            if k < d:
                _dx_plain(i, k, d, dy, x, None, dx, rc, oc, zero)


@_inline
def _g64(w, j, offset):
    """``w[j] + offset`` in float64; 1 without a weight (None)."""
    if w is not None:
        return np.float64(w[j]) + offset
    return 1.0


@_inline
def _bwd_row_wide(i, dy, x, w, gr, dx, flags, k, eps, offset, r64, rms, pc, ro, e0, e1, e2,
                  rtmp, npair):
    """The backward of a row whose rstd overflows float32, in float64 (rare: a
    float32 row of rms < ~3e-39 with a tiny eps; dx itself is then beyond float32).
    Its dweight terms go where the others do: the first ``npair`` columns in pairs."""
    d = x.shape[1]
    c = 0.0
    for j in range(d):
        g = _g64(w, j, offset)
        c += g * np.float64(load(dy[i, j])) * (np.float64(load(x[i, j])) * r64)
    coef = c / k
    if not flags & EPS_INSIDE:
        coef = 0.0 if rms == 0.0 else coef * ((rms + eps) / rms)
    dxi = dx[i]
    for j in range(d):
        xh = np.float64(load(x[i, j])) * r64
        dyv = np.float64(load(dy[i, j]))
        g = _g64(w, j, offset)
        v = r64 * (g * dyv - (xh * coef if j < k else 0.0))
        if flags & HAS_GR:
            v += np.float64(load(gr[i, j]))
        store(dxi, j, v)
        pc[rtmp, _PAD + pair_position(j, npair)] = as_type_of(dyv * xh, pc[rtmp, _PAD])
    if w is not None:
        _fold(pc, ro, e0, e1, e2, rtmp, np.intp(0), d)


@_inline
def _fold(pc, ro, e0, e1, e2, rsrc, lo, m):
    """Pool row ``ro[lo:lo+m] = e2 + (e1 + (e0 + src))``: terms (pool row
    ``rsrc[:m]``) joined with their waiting left siblings, in the tree's order."""
    for j in range(m):
        c = _PAD + lo + j
        pc[ro, c] = pc[e2, c] + (pc[e1, c] + (pc[e0, c] + pc[rsrc, _PAD + j]))


@_inline
def _dx_val(x, dy, w, gr, i, j, rc, oc, coef):
    """``(dx, dy * xhat)`` of element ``(i, j)``; ``w``, ``gr``: None where absent
    (their branches are resolved when the function is compiled)."""
    xh = load(x[i, j]) * rc
    dyc = as_type_of(load(dy[i, j]), rc)
    if w is not None:
        v = rc * (dyc * (as_type_of(w[j], rc) + oc) - xh * coef)
    else:
        v = rc * (dyc * as_type_of(1.0, rc) - xh * coef)
    if gr is not None:
        v = v + as_type_of(load(gr[i, j]), rc)
    return v, dyc * xh


@_inline
def _dx_plain(i, lo, hi, dy, x, gr, dx, rc, oc, coef):
    """``dx[i, lo:hi]`` without a weight (its own function: beside the weighted
    loop in one function, the weighted loop compiled slower)."""
    # unsigned indices: Numba then has no negative-index wraparound to do
    # (with it in the loop, the loop does not vectorize)
    for j in range(np.uint64(lo), np.uint64(hi)):
        v, _ = _dx_val(x, dy, None, gr, i, j, rc, oc, coef)
        store(dx, (i, j), v)


@_inline
def _dx_pass(i, lo, hi, dy, x, w, gr, dx, di, dj, rc, oc, coef, pc, ro, e0, e1, e2, fold):
    """``dx[i, lo:hi] = rstd * (g*dy - xhat*coef) (+ grad_residual)``, stored at
    ``dx[di, j - dj]`` (``dx, i, 0``, or the stage of a streamed chunk), and, in
    the same loop, the row's dweight terms ``dy*xhat`` of columns ``lo:hi``
    into pool row ``ro`` -- joined with the waiting left siblings
    ``e2 + (e1 + (e0 + dy*xhat))`` if ``fold``.

    One folding loop whatever the depth: with a loop per depth, LLVM made all
    of them slower.  The plain
    loop (no sibling reads) serves the rows that start a node and the rows of
    a whole group (:func:`_group_node`).
    """
    P = np.uint64(_PAD)
    o = np.uint64(dj)
    if fold:
        for j in range(np.uint64(lo), np.uint64(hi)):
            v, p = _dx_val(x, dy, w, gr, i, j, rc, oc, coef)
            store(dx, (di, j - o), v)
            c = P + j
            pc[ro, c] = pc[e2, c] + (pc[e1, c] + (pc[e0, c] + p))
    else:
        for j in range(np.uint64(lo), np.uint64(hi)):
            v, p = _dx_val(x, dy, w, gr, i, j, rc, oc, coef)
            store(dx, (di, j - o), v)
            pc[ro, P + j] = p


@_inline
def _group_node(pc, s0, p64, r64, m):
    """The row tree's level-TREE_G node of the 2**TREE_G rows whose terms are
    in pool rows ``s0 ..`` (columns ``[0, m)``), into p64 row ``r64``: the
    pairwise float32 adds of levels 1-3 and the float64 add of level 4, in
    the tree's order (those of the row-by-row fold, bit for bit)."""
    for j in range(np.uint64(_PAD), np.uint64(_PAD + m)):
        a = ((pc[s0, j] + pc[s0 + 1, j]) + (pc[s0 + 2, j] + pc[s0 + 3, j])) + (
            (pc[s0 + 4, j] + pc[s0 + 5, j]) + (pc[s0 + 6, j] + pc[s0 + 7, j]))
        b = ((pc[s0 + 8, j] + pc[s0 + 9, j]) + (pc[s0 + 10, j] + pc[s0 + 11, j])) + (
            (pc[s0 + 12, j] + pc[s0 + 13, j]) + (pc[s0 + 14, j] + pc[s0 + 15, j]))
        p64[r64, j] = np.float64(a) + np.float64(b)


# --------------------------------------------------------------------------- the row tree
#
# dweight/dbias are summed over a binary tree fixed by the GLOBAL row index
# (polynorm/backends/rowtree.py states it and merges nodes in numpy): node
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
def _emit(lv, j, r, pc, p64, out_lvl, out_idx, out_val, o, npair):
    """Append node ``(lv, j)``, held in pool row ``r``, to the output slots, its
    columns in order (the first ``npair`` are in pairs in the pools)."""
    out_lvl[o] = lv
    out_idx[o] = j
    dst = out_val[o]
    if lv < TREE_G:
        _unpair(_row(pc, r), dst, npair)
    else:
        _unpair(_row(p64, r), dst, npair)
    return o + 1


@_inline
def _unpair(src, dst, npair):
    """``dst = src`` in float64, the first ``npair`` columns put back in order from
    the pair layout (:func:`.numba.pairs.pair_position`).  A block at a time, with
    constant offsets: an index worked out per column keeps the loop scalar, which
    costs more than the rest of a one-row bfloat16 backward."""
    # unsigned throughout: a signed literal would make the indices float64
    half, two, one = np.uint64(PAIR_BLOCK // 2), np.uint64(2), np.uint64(1)
    for b in range(np.uint64(0), np.uint64(npair), np.uint64(PAIR_BLOCK)):
        for t in range(half):
            dst[b + two * t] = src[b + t]
            dst[b + two * t + one] = src[b + half + t]
    for t in range(np.uint64(npair), np.uint64(dst.shape[0])):
        dst[t] = src[t]


@_inline
def _carry(lv, j, glo, ntot, cap, pc, p64, prow, crow, pend, out_lvl, out_idx, out_val, o,
           npair):
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
                 o, npair)


@_jit()
def backward_range(glo, ghi, row0, ntot, cap, dy, x, w, rstd_in, gr, dx, flags, k, eps, offset,
                   out_lvl, out_idx, out_val, o, pc, p64):
    """Global rows ``[glo, ghi)`` (local row = global - ``row0``; ``ntot`` rows in all).

    Writes their dx and appends the row tree's nodes of the range, carried
    at most to level ``cap``, to ``out_*`` from slot ``o`` (a range that
    covers an aligned ``2**cap`` block, or the rows of one up to ``ntot``,
    gives exactly one node).  Returns the new slot count.

    ``pc`` and ``p64`` are scratch pools (see :func:`pool_shapes`): ``pc``
    holds the waiting nodes below TREE_G (rows ``prow[0..3]``), the current
    one (``crow[0]``), a scratch row, a row of -0.0 and the 2**TREE_G term
    rows of a whole group; ``p64`` the float64 levels.  Rows are padded so
    that no two arrays of a loop ever lie close (see ``_PAD``).
    """
    dy, x, dx = borrow(dy), borrow(x), borrow(dx)
    w, rstd_in, gr = _borrow_opt(w), borrow(rstd_in), _borrow_opt(gr)
    out_lvl, out_idx, out_val, pc, p64 = (borrow(out_lvl), borrow(out_idx), borrow(out_val),
                                          borrow(pc), borrow(p64))
    W = out_val.shape[1]
    levels = max(cap, TREE_G) + 1
    rtmp = TREE_G + 1
    rneg = TREE_G + 2  # stands in for absent siblings: -0.0 adds nothing
    pc[rneg, :] = -0.0
    # levels >= TREE_G index p64 (from row 0), the others pc
    prow = np.arange(levels)
    # element by element: an array-to-slice assignment would compile Numba's
    # formatted shape-mismatch error (its string formatting) into the kernel
    for lv in range(TREE_G, levels):
        prow[lv] -= TREE_G
    crow = np.array([TREE_G, levels - TREE_G])
    pend = np.full(levels, -1, np.int64)
    stage = np.empty((1, _BWD_CHUNK), dx.dtype)  # STREAM_DX's chunk of dx
    # bfloat16 rows with a weight: whole blocks of columns as pairs
    d = x.shape[1]
    npair = 0
    # (not with a grad_residual: the arrays' types are those of calls without one)
    if (pairs_kernel(x, w, None) and not (flags & HAS_GR)
            and x.strides[1] == 2 and dy.strides[1] == 2 and dx.strides[1] == 2):
        npair = d - d % PAIR_BLOCK
    g2 = pair_weight(w, offset, npair)
    G = 1 << TREE_G
    s0 = TREE_G + 3  # the group's term rows
    group = W and cap >= TREE_G and G * W * 4 <= _group_max_bytes(x, npair)
    g = glo
    while g < ghi:
        if group and (g & (G - 1)) == 0 and g + G <= ghi:
            # a whole level-TREE_G node in the range: each row's terms to its own
            # pool row, then the node's adds in one pass over the columns (the
            # row-by-row fold reads three sibling rows per row instead)
            for r in range(G):
                # np.intp: literal ints would compile another variant of the callee
                _bwd_row(g + r - row0, dy, x, w, rstd_in, gr, dx, flags, k, eps, offset,
                         np.intp(0), pc, s0 + r, prow, rneg, rtmp, stage, g2)
            _group_node(pc, s0, p64, crow[1], W)
            o = _carry(np.intp(TREE_G), g >> TREE_G, glo, ntot, cap, pc, p64, prow, crow, pend,
                       out_lvl, out_idx, out_val, o, npair)
            g += G
            continue
        # how many of the row's ancestors complete with it: the levels whose
        # left sibling waits (it lies in the range); their adds are fused (up
        # to level 3; the float64 add of level 4 and above are _carry's)
        depth = 0
        if W:
            while (depth < TREE_G - 1 and (g >> depth) & 1
                   and ((g >> depth) - 1) << depth >= glo):
                depth += 1
        _bwd_row(g - row0, dy, x, w, rstd_in, gr, dx, flags, k, eps, offset, depth, pc, crow[0],
                 prow, rneg, rtmp, stage, g2)
        if W:
            for lv in range(depth):
                pend[lv] = -1
            j = g >> depth
            if (j & 1) == 0 and ((j + 1) << depth) < ntot:
                # the common case, inline: the node waits for its right sibling
                prow[depth], crow[0] = crow[0], prow[depth]
                pend[depth] = j
            else:
                o = _carry(depth, j, glo, ntot, cap, pc, p64, prow, crow, pend, out_lvl,
                           out_idx, out_val, o, npair)
        g += 1
    if flags & STREAM_DX:
        stream_fence()  # before another thread, or the caller, reads dx
    # nodes still waiting for a right sibling beyond the range, left to right
    for lv in range(levels - 1, -1, -1):
        if pend[lv] >= 0:
            o = _emit(lv, pend[lv], prow[lv], pc, p64, out_lvl, out_idx, out_val, o, npair)
    return o


def pool_shapes(cap: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the scratch pools ``(pc, p64)`` of :func:`backward_range`."""
    levels = max(cap, TREE_G) + 1
    cols = width + 2 * _PAD
    return (TREE_G + 3 + (1 << TREE_G), cols), (levels - TREE_G + 1, cols)


@_jit(parallel=True)
def backward_blocks_parallel(b0, nb, m, row0, nrows, ntot, dy, x, w, rstd_in, gr, dx, flags, k,
                             eps, offset, out_lvl, out_idx, out_val, pcs, p64s):
    """Aligned ``2**m``-row blocks ``b0 .. b0+nb-1``, each wholly inside the rows
    (global ``[row0, row0+nrows)``): one node per block, in slot ``block - b0``.
    ``pcs``/``p64s``: one pair of pools per thread (any pool gives the same bits)."""
    for t in prange(nb):
        s = np.int64(t)  # prange's index may be unsigned: int64 + uint64 is float64
        b = b0 + s
        tid = get_thread_id()
        backward_range(b << m, min(row0 + nrows, (b + 1) << m), row0, ntot, m, dy, x, w, rstd_in,
                       gr, dx, flags, k, eps, offset, out_lvl, out_idx, out_val, s, pcs[tid],
                       p64s[tid])


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
def round_into(src, dst):
    """``dst[:] = src`` (float64) rounded once to ``dst``'s type (16-bit bits: see
    ``numba.codec.load``)."""
    for j in range(dst.shape[0]):
        store(dst, j, src[j])
