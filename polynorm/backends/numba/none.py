"""Numba kernel of ``casting="none"`` (Liger's ``casting_mode="none"``), the forward.

The formula is :data:`polynorm.core.options.NONE_CASTING`: every step is computed in
the compute type and rounded once to the input's format ``T`` (:func:`.codec.round_to`
with the format's runtime code), as the reference does with ``astype``.  16-bit x and
y travel as bits (:mod:`.codec`).  The weight arrives as ``P(weight + T(offset))``
and the bias as its values, both in the type ``W`` the rest of the row is computed
in (the compute type, float64 where the weight or bias makes the product's dtype
float64), prepared on the host; ``pcode``/``bcode`` are the formats the product and
the sum with the bias are rounded to.  The squares' sum runs in the compute type in
an order fixed by the compiled code (the reductions' ``reassoc``), the same for every
row and thread count; rounding the mean to ``T`` hides that order from the 16-bit
results almost always (the reference sums in numpy's order).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from polynorm.backends.numba.codec import load, round_to, store
from polynorm.backends.numba.kernels import _inline, _jit, _reduce

#: flags: eps inside the square root; a bias is added
EPS_INSIDE = 1
HAS_B = 2


@_reduce
def _sumsq_t(x, i, k, tcode, zero):
    s = zero
    for j in range(k):
        v = load(x[i, j])
        s += round_to(v * v, tcode)
    return s


@_inline
def _row(x, g, bb, y, rstd, i, k, kc, one, eps, tcode, pcode, bcode, flags):
    ms = round_to(_sumsq_t(x, i, k, tcode, one - one) / kc, tcode)
    if flags & EPS_INSIDE:
        r = round_to(one / np.sqrt(round_to(ms + eps, tcode)), tcode)
    else:
        r = round_to(one / round_to(round_to(np.sqrt(ms), tcode) + eps, tcode), tcode)
    rstd[i] = r
    yrow = y[i]
    for j in range(x.shape[1]):
        v = round_to(round_to(load(x[i, j]) * r, tcode) * g[j], pcode)
        if flags & HAS_B:
            v = round_to(v + bb[j], bcode)
        store(yrow, j, v)


@_jit(parallel=True)
def forward_parallel(x, g, bb, y, rstd, k, kc, one, eps, tcode, pcode, bcode, flags):
    for i in prange(x.shape[0]):
        _row(x, g, bb, y, rstd, i, k, kc, one, eps, tcode, pcode, bcode, flags)


@_jit()
def forward_rows(start, end, x, g, bb, y, rstd, k, kc, one, eps, tcode, pcode, bcode, flags):
    for i in range(start, end):
        _row(x, g, bb, y, rstd, i, k, kc, one, eps, tcode, pcode, bcode, flags)
