"""Numba kernels of the split hidden axis (:func:`polynorm.rms_norm_stats`,
:func:`polynorm.rms_norm_from_stats`).

``stats_rows`` is the forward's own row statistic (``kernels._row_sumsq``: float64
for float64 rows, float32 partials added in float64 for float32 rows and the float64
lanes for 16-bit rows), so a one-shard split sums in the unsplit forward's order.  A
float32 or 16-bit row whose sum is out of the partials' range (an Inf/NaN sum or one
below 2**-100: the rows the unsplit forward rescales from the whole row, which a shard
does not have) is summed again in float64, where their squares neither overflow nor
underflow.

``given_rows`` forms rstd from the whole row's sum as the unsplit forward's in-range
branch does (``kernels._rms_rstd``) and writes y with the unsplit forward's output
pass (``kernels._out_span``, ``kernels._fwd_row_wide``): for a row whose sum is in
range, the same sum gives the unsplit forward's rstd and y bits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from polynorm.backends.numba.kernels import (
    _LANES_TINY,
    EPS_INSIDE,
    _fwd_row_wide,
    _jit,
    _out_span,
    _partial_sums,
    _range_bounds,
    _range_count,
    _row_sumsq,
    _sumsq,
    as_type_of,
)
from polynorm.backends.numba.refs import row_of


@_jit()
def stats_rows(lo, hi, x, ss, k):
    for i in range(lo, hi):
        s = _row_sumsq(x, i, k)
        if _partial_sums(x) and not (s >= _LANES_TINY and s < math.inf):
            s = _sumsq(row_of(x, i), 0, k)
        ss[i] = s


@_jit()
def given_rows(lo, hi, x, w, b, y, rstd, ss, flags, kt, eps, offset):
    inside = (flags & EPS_INSIDE) != 0
    d = x.shape[1]
    for i in range(lo, hi):
        ms = ss[i] / kt
        if inside:
            r64 = 1.0 / math.sqrt(ms + eps)
        else:
            r64 = 1.0 / (math.sqrt(ms) + eps)
        rstd[i] = r64
        rc = rstd[i]  # rstd in the compute type
        oc = as_type_of(offset, rc)
        if r64 < math.inf and not rc < math.inf:
            _fwd_row_wide(i, x, w, b, y, r64, oc)
        else:
            _out_span(x, i, np.intp(0), d, w, b, y, rc, oc)


@_jit(parallel=True)
def stats_parallel(x, ss, k):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        stats_rows(lo, hi, x, ss, k)


@_jit(parallel=True)
def given_parallel(x, w, b, y, rstd, ss, flags, kt, eps, offset):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        given_rows(lo, hi, x, w, b, y, rstd, ss, flags, kt, eps, offset)
