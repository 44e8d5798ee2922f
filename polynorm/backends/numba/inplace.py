"""The fused add written over its inputs (``add_rms_norm_``): ``h`` into the residual.

The fused-add drivers of :mod:`.kernels` take ``h`` as an argument of its own;
when it is the residual's memory, LLVM's runtime overlap test between the
stores to ``h`` and the loads of the residual fails and the add runs its
scalar loop (three times slower for 16-bit rows).  These drivers pass the
residual itself as ``h`` to the same row code (:func:`.kernels._add_rows`),
so the compiler sees one pointer, loaded and stored at the same index, and
vectorizes.  The same arithmetic, so the same bits.  A module of its own:
its compiled variants (16-bit rows of one dtype) are cached apart from the
kernels'.
"""

from __future__ import annotations

from numba import prange

from polynorm.backends.numba.kernels import (
    _add_rows,
    _borrowed,
    _jit,
    _range_bounds,
    _range_count,
)


@_jit()
def forward_add_inplace_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of the fused add with ``h`` written over ``r`` (``h``:
    None, ``stage``: None); ``y`` may be ``x``."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    _add_rows(lo, hi, x, r, w, b, y, r, rstd, flags, k, eps, offset)


@_jit(parallel=True)
def forward_add_inplace_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_add_inplace_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage)
