"""Per-head weights in one kernel call: row ``i`` of ``(t * heads, d)`` rows takes
weight row ``i % heads`` (and bias row).

The front end views ``x`` of shape ``(T, H, D)`` with an ``(H, D)`` weight as
``T * H`` rows (:func:`polynorm.ops.norm.forward_heads`).  These drivers are
the plain, 16-bit and fused-add drivers of :mod:`.kernels` with the weight row
chosen per row: they call the same row functions (:func:`.kernels._fwd_norm_row`,
:func:`.kernels._fwd_add_row`) with ``w2[i % heads]``, so each row has the bits
of a plain call on that row with that weight row, by construction.  No streamed
twin: the streamed stores give the same bits as ordinary ones.  A module of its
own: a per-head call compiles (and caches) only these.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange
from numba.extending import overload

from polynorm.backends.numba.codec import prefetch_row
from polynorm.backends.numba.kernels import (
    _NO_BLOCKS,
    OUT_BLOCK,
    _absent,
    _blocks_ok,
    _borrowed,
    _fwd_add_row,
    _fwd_norm_row,
    _inline_ir,
    _jit,
    _prefetches,
    _range_bounds,
    _range_count,
    _row_sumsq,
)


def _row(a, j):  # pragma: no cover - replaced by the overload
    """``a[j]`` of an ``(heads, d)`` array, ``None`` for ``None`` (typing time)."""
    raise NotImplementedError


@overload(_row, inline="always")
def _ov_row(a, j):
    if _absent(a):
        return lambda a, j: None
    return lambda a, j: a[j]


@_inline_ir
def _head_blocks(lo, hi, a, w2, b2, y, offset):
    """``(heads, m)`` block weights of the heads that rows ``[lo, hi)`` use: each row
    what :func:`.kernels._pair_weights` makes of that head's weights, in one array
    (no allocation per head); ``m`` is 0 (every row element by element, the same
    bits) where the arrays take no blocks (:func:`.kernels._blocks_ok`, column
    strides) or a head's ``w + offset`` is not finite."""
    nh, d = w2.shape
    if not _blocks_ok(a, _row(b2, 0), y) or (
            a.strides[1] != a.itemsize or y.strides[1] != y.itemsize):
        return np.empty((nh, 0), np.float32)
    half = OUT_BLOCK // 2
    oc = np.float32(offset)
    wg2 = np.empty((nh, d - d % OUT_BLOCK), np.float32)
    for i in range(lo, min(hi, lo + nh)):
        j = i % nh
        finite = True
        for c in range(d):
            finite &= abs(w2[j, c] + oc) < math.inf
        if not finite:
            return np.empty((nh, 0), np.float32)
        for j0 in range(0, wg2.shape[1], OUT_BLOCK):
            for t in range(half):
                wg2[j, j0 + t] = w2[j, j0 + 2 * t] + oc
                wg2[j, j0 + half + t] = w2[j, j0 + 2 * t + 1] + oc
    return wg2


def _blocks_for(stage, lo, hi, a, w2, b2, y, offset):  # pragma: no cover - the overload
    """``stage`` where the parallel driver made the heads' block weights once (an
    array), else :func:`_head_blocks` of rows ``[lo, hi)`` (``None``: a serial call)."""
    raise NotImplementedError


@overload(_blocks_for, inline="always")
def _ov_blocks_for(stage, lo, hi, a, w2, b2, y, offset):
    if _absent(stage):
        return lambda stage, lo, hi, a, w2, b2, y, offset: _head_blocks(lo, hi, a, w2, b2, y,
                                                                         offset)
    return lambda stage, lo, hi, a, w2, b2, y, offset: stage


# The drivers' signature is that of .kernels' with w, b: (heads, d) (w ones where
# absent; b None where absent); stage: None, or in the 16-bit and fused-add drivers
# the (heads, m) block weights that their parallel driver makes once for all its
# ranges (a range of n/64 rows would otherwise make them again: for short rows
# about as much work as its rows).


@_jit()
def forward_heads_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of the plain forward (float32/float64), per-head weights."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    nh = w.shape[0]
    for i in range(lo, hi):
        ss = _row_sumsq(x, i, k)
        if i + 1 < x.shape[0] and _prefetches(x):
            prefetch_row(x, i + 1)
        j = i % nh
        _fwd_norm_row(i, i + 1, x, w[j], _row(b, j), y, rstd, flags, k, eps, offset, ss,
                      _NO_BLOCKS)


@_jit()
def forward_heads_bits_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of a 16-bit forward (pipelined), per-head weights."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    nh = w.shape[0]
    ss = _row_sumsq(x, lo, k) if lo < hi else 0.0
    wg2 = _blocks_for(stage, lo, hi, x, w, b, y, offset)
    for i in range(lo, hi):
        j = i % nh
        ss = _fwd_norm_row(i, hi, x, w[j], _row(b, j), y, rstd, flags, k, eps, offset, ss,
                           wg2[j])


@_jit()
def forward_heads_add_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of the fused add, per-head weights."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    nh = w.shape[0]
    wg2 = _blocks_for(stage, lo, hi, h, w, b, y, offset)
    for i in range(lo, hi):
        j = i % nh
        _fwd_add_row(i, x, r, w[j], _row(b, j), y, h, rstd, flags, k, eps, offset, wg2[j])


@_jit(parallel=True)
def forward_heads_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_heads_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage)


@_jit(parallel=True)
def forward_heads_bits_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    wg2 = _head_blocks(0, w.shape[0], x, w, b, y, offset)
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_heads_bits_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, wg2)


@_jit(parallel=True)
def forward_heads_add_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    wg2 = _head_blocks(0, w.shape[0], h, w, b, y, offset)
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_heads_add_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, wg2)


def forward_heads_kernels(residual: bool, bits: bool) -> tuple:
    """``(parallel, serial)`` per-head drivers, as :func:`.kernels.forward_kernels`."""
    if residual:
        return forward_heads_add_parallel, forward_heads_add_rows
    if bits:
        return forward_heads_bits_parallel, forward_heads_bits_rows
    return forward_heads_parallel, forward_heads_rows

