"""The Numba kernels: forward (plain and fused add) and backward on ``(n, d)`` rows.

Every option of the :class:`polynorm._options.Plan` arrives as a runtime
scalar or a bit of ``flags``, so a kernel is specialised only on the element
types and memory layouts of its arrays.  Weight and bias arrive in the
compute type (the caller converts those ``(d,)`` arrays), and an absent
array is replaced by a stand-in of the type it would have (x itself for a
missing residual), with its flag bit cleared: the common calls share one
compiled kernel per input dtype.  float16 and bfloat16 arrays arrive as
``uint16`` views; a flag bit per array says which of the two formats it holds.

Numerics (see the module docstring of :mod:`polynorm._options`):

- the sum of squares is accumulated in float64: exact range for float16,
  bfloat16 and float32 input (``1e25**2`` is nothing for float64).  For
  float64 input a row whose sum overflows or underflows (or is zero) is
  recomputed scaled by its largest magnitude; on ordinary data this branch
  is never taken.
- each row is reduced by one compiled function (vectorized, see ``_reduce``)
  whatever the driver or thread count, so the bits never depend on either.
- ``dweight``/``dbias`` are summed per fixed block of rows into partials in
  the compute type (float32 lanes are twice as many as float64 ones; a block
  is at most n/256 rows), then the partials are added in block order in float64.

Each kernel exists twice, ``*_serial`` and ``*_parallel`` (``prange`` over
tokens or blocks), with the same row function inlined into both.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._numba_codec import load, prefetch_row, round_to, store

# --------------------------------------------------------------------------- flags

HAS_R = 1 << 0
HAS_W = 1 << 1
HAS_B = 1 << 2
EPS_INSIDE = 1 << 3
LLAMA = 1 << 4
HAS_RSTD = 1 << 5  # backward: rstd given
HAS_GR = 1 << 6  # backward: grad_residual given
# "this uint16 array holds bfloat16" bits, one per array slot
BF_X = 1 << 8
BF_R = 1 << 9
BF_W = 1 << 10
BF_B = 1 << 11
BF_Y = 1 << 12  # y (forward) / dy (backward)
BF_H = 1 << 13  # h (forward) / grad_residual (backward)
# llama rounding formats (codes of _numba_codec.round_to), two bits each
XCODE_SHIFT = 16
WCODE_SHIFT = 18
PCODE_SHIFT = 20

_TINY = 2.0**-960  # a float64 sum of squares below this has lost bits


def _jit(**kw):
    """``njit`` with an on-disk cache where one can be written, in memory otherwise."""

    def deco(fn):
        try:
            return njit(cache=True, nogil=True, **kw)(fn)
        except Exception:  # e.g. NUMBA_CACHE_DIR not writable: compile per process
            return njit(cache=False, nogil=True, **kw)(fn)

    return deco


# Row helpers: plain njit functions; LLVM inlines them into each driver.
_inline = njit(nogil=True)
# Row reductions: "reassoc" lets LLVM vectorize them (6x faster than a scalar
# chain).  The summation order is then LLVM's (vector lanes, then a fixed
# tree), fixed in the compiled code: the same bits on every run and for every
# thread count, since each row is reduced by the same code whatever the
# driver or the number of threads.  No "nnan"/"ninf": NaN and Inf propagate.
_reduce = njit(nogil=True, fastmath={"reassoc", "contract"})


def like(v, ref):  # pragma: no cover - replaced by the overload
    """``v`` converted to the type of ``ref`` (the compute type)."""
    raise NotImplementedError


@overload(like)
def _ov_like(v, ref):
    if ref == types.float32:
        return lambda v, ref: np.float32(v)
    if ref == types.float64:
        return lambda v, ref: np.float64(v)
    return None


#: Rows of at most this many bytes have the next row prefetched.  A longer
#: row's burst of prefetches (one per 64-byte line) stalls more than it
#: overlaps: without it, float32 16384x4096 bwd took 29.1 instead of 32.2 ms,
#: fwd 17.8 instead of 18.5 ms (2-core AMD EPYC); bfloat16 4096x16384 no worse.
_PREFETCH_MAX_BYTES = 8192
#: The backward prefetches rows of at most this many bytes before the row's
#: first pass instead of before its last: float32 65536x1024 bwd 31.5-32.4 ->
#: 27.1-27.7 ms; 16-bit 65536x1024 no worse; bfloat16 16384x4096 (8 KB rows)
#: was slower that way (21.2 -> 24.1 ms), so longer rows keep the late prefetch.
_PREFETCH_EARLY_BYTES = 4096


@_inline
def _row_bytes(a):
    return a.shape[1] * a.itemsize


@_inline
def _prefetches(a):
    return _row_bytes(a) <= _PREFETCH_MAX_BYTES


# --------------------------------------------------------------------------- row statistics


@_reduce
def _sumsq(a, i, k, bf):
    """float64 sum of squares of ``a[i, :k]``."""
    s = 0.0
    for j in range(k):
        v = np.float64(load(a[i, j], bf))
        s += v * v
    return s


@_inline
def _scaled_rms(a, i, k, bf):
    """``sqrt(mean(a[i, :k]**2))`` scaled by the largest magnitude (no overflow)."""
    m = 0.0
    for j in range(k):
        v = abs(np.float64(load(a[i, j], bf)))
        if not v <= m:  # also catches NaN
            m = v
    if m == 0.0:
        return 0.0
    if not math.isfinite(m):
        return math.nan  # Inf or NaN in the row: the whole token is NaN
    s = 0.0
    for j in range(k):
        v = np.float64(load(a[i, j], bf)) / m
        s += v * v
    return m * math.sqrt(s / k)


@_inline
def _stats(a, i, k, bf, eps, inside):
    """``(rms, rstd)`` of row ``i`` in float64."""
    ss = _sumsq(a, i, k, bf)
    if ss < math.inf and ss >= _TINY:
        ms = ss / k
        rms = math.sqrt(ms)
        if inside:
            return rms, 1.0 / math.sqrt(ms + eps)
        return rms, 1.0 / (rms + eps)
    rms = _scaled_rms(a, i, k, bf)
    if inside:
        return rms, 1.0 / math.hypot(rms, math.sqrt(eps))
    return rms, 1.0 / (rms + eps)


# --------------------------------------------------------------------------- forward


@_inline
def _fwd_norm_row(i, a, abf, w, b, y, rstd, flags, k, eps, offset):
    """``y[i] = a[i] * rstd * (w + offset) + b`` in the compute type, rounded once."""
    d = a.shape[1]
    has_w = (flags & HAS_W) != 0
    has_b = (flags & HAS_B) != 0
    ybf = (flags & BF_Y) != 0
    _, r64 = _stats(a, i, k, abf, eps, (flags & EPS_INSIDE) != 0)
    rstd[i] = r64
    rc = rstd[i]  # rstd in the compute type
    yi = y[i]
    oc = like(offset, rc)
    if r64 < math.inf and not rc < math.inf:
        _fwd_row_wide(i, a, abf, w, b, yi, r64, flags, oc)
        return
    if not flags & HAS_R and i + 1 < a.shape[0] and _prefetches(a):
        # the next row's reads overlap this row's compute-bound pass (measured:
        # bfloat16 16384x4096 0.72 -> 0.77 of the copy roof)
        prefetch_row(a, i + 1)
    # one loop per case, free of per-element branches (they vectorize)
    if has_w and not has_b:
        for j in range(d):
            store(yi, j, load(a[i, j], abf) * rc * (like(w[j], rc) + oc), ybf)
    elif not has_w and not has_b:
        for j in range(d):
            store(yi, j, load(a[i, j], abf) * rc, ybf)
    elif has_w:
        for j in range(d):
            val = load(a[i, j], abf) * rc * (like(w[j], rc) + oc)
            store(yi, j, val + like(b[j], rc), ybf)
    else:
        for j in range(d):
            store(yi, j, load(a[i, j], abf) * rc + like(b[j], rc), ybf)


@_inline
def _fwd_row_wide(i, a, abf, w, b, yi, r64, flags, oc):
    """A row whose rstd overflows float32 (a float32 row of rms < ~3e-39 with a
    tiny eps): xhat = (v * 2**64) * (rstd * 2**-64), both factors in range."""
    rc = like(r64 * 2.0**-64, oc)
    up = like(2.0**64, oc)
    for j in range(a.shape[1]):
        val = load(a[i, j], abf) * up * rc
        if flags & HAS_W:
            val = val * (like(w[j], oc) + oc)
        if flags & HAS_B:
            val = val + like(b[j], oc)
        store(yi, j, val, (flags & BF_Y) != 0)


@_inline
def _fwd_norm_row_llama(i, a, abf, w, b, y, rstd, flags, k, eps, offset):
    """Hugging Face Llama's order: round xhat to x's dtype, g = w + offset to
    weight's dtype, the product to promote(x, weight), add bias, round to y's."""
    d = a.shape[1]
    has_w = (flags & HAS_W) != 0
    has_b = (flags & HAS_B) != 0
    ybf = (flags & BF_Y) != 0
    _, r64 = _stats(a, i, k, abf, eps, (flags & EPS_INSIDE) != 0)
    rstd[i] = r64
    rc = rstd[i]
    yi = y[i]
    xcode = (flags >> XCODE_SHIFT) & 3
    wcode = (flags >> WCODE_SHIFT) & 3
    pcode = (flags >> PCODE_SHIFT) & 3
    off = np.float64(offset)
    for j in range(d):
        xh = round_to(load(a[i, j], abf) * rc, xcode)
        val = xh
        if has_w:
            # w holds the weight's exact values (float32/float64 arrays)
            g = round_to(np.float64(w[j]) + off, wcode)
            val = like(round_to(np.float64(xh) * g, pcode), rc)
        if has_b:
            val = val + like(b[j], rc)
        store(yi, j, val, ybf)


@_inline
def _add_row(i, x, r, h, flags):
    """``h[i] = x[i] + r[i]``: summed in the compute type, rounded once to h's dtype."""
    xbf = (flags & BF_X) != 0
    rbf = (flags & BF_R) != 0
    hbf = (flags & BF_H) != 0
    hi = h[i]
    for j in range(x.shape[1]):
        store(hi, j, load(x[i, j], xbf) + load(r[i, j], rbf), hbf)


@_inline
def _fwd_row(i, x, r, w, b, y, h, rstd, flags, k, eps, offset):
    if flags & HAS_R:
        if i + 1 < x.shape[0] and _prefetches(x):
            prefetch_row(x, i + 1)
            prefetch_row(r, i + 1)
        _add_row(i, x, r, h, flags)
        _fwd_norm_row(i, h, (flags & BF_H) != 0, w, b, y, rstd, flags, k, eps, offset)
    else:
        _fwd_norm_row(i, x, (flags & BF_X) != 0, w, b, y, rstd, flags, k, eps, offset)


@_inline
def _fwd_row_llama(i, x, r, w, b, y, h, rstd, flags, k, eps, offset):
    if flags & HAS_R:
        _add_row(i, x, r, h, flags)
        _fwd_norm_row_llama(i, h, (flags & BF_H) != 0, w, b, y, rstd, flags, k, eps, offset)
    else:
        _fwd_norm_row_llama(i, x, (flags & BF_X) != 0, w, b, y, rstd, flags, k, eps, offset)


# Forward drivers.  x, r, y, h: (n, d) (uint16 bits for 16-bit floats); w, b:
# (d,) in the compute type (float64 for llama weights wider than it); absent
# arrays are stand-ins of the same types (see polynorm.backends.numba).
# ``*_rows`` does rows [lo, hi) on one thread and is the serial path; the
# parallel driver only splits the rows and calls it, so the row code is
# compiled once (the parallel driver compiles in a fraction of the time) and
# the two paths give the same bits by construction.

_ROW_CHUNK = 4  # rows per prange task: enough to amortize the call


@_jit()
def forward_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset):
    for i in range(lo, hi):
        _fwd_row(i, x, r, w, b, y, h, rstd, flags, k, eps, offset)


@_jit()
def forward_llama_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset):
    for i in range(lo, hi):
        _fwd_row_llama(i, x, r, w, b, y, h, rstd, flags, k, eps, offset)


@_jit(parallel=True)
def forward_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset):
    n = x.shape[0]
    for c in prange((n + _ROW_CHUNK - 1) // _ROW_CHUNK):
        lo = c * _ROW_CHUNK
        forward_rows(lo, min(n, lo + _ROW_CHUNK), x, r, w, b, y, h, rstd, flags, k, eps, offset)


@_jit(parallel=True)
def forward_llama_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset):
    n = x.shape[0]
    for c in prange((n + _ROW_CHUNK - 1) // _ROW_CHUNK):
        lo = c * _ROW_CHUNK
        forward_llama_rows(lo, min(n, lo + _ROW_CHUNK), x, r, w, b, y, h, rstd, flags, k, eps,
                           offset)
