"""Numba kernel of RMSNorm with quantized output (:class:`polynorm._options.QuantPlan`).

One pass over a token: its statistic (the plain forward's own row
functions, :func:`._numba_kernels._row_sumsq` and ``_rstd_from``), ``y`` in
float32 into a row buffer of the task (the operations of ``_out_span`` /
``_fwd_row_wide``, in their order: the bits of ``rms_norm(...,
out_dtype="float32")``), then the scales and the encoding from that buffer,
which is still in L1/L2.  float8 e4m3fn has no Numba type: it is encoded
by bit manipulation into ``uint8`` (round to nearest even, as
``ml_dtypes``), as :mod:`._numba_codec` does for bfloat16; int8 is written
into the same ``uint8`` array as its two's complement.

Rows run in ranges under ``prange``; a token's bits depend only on its own
values (batch invariance), whatever the thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._numba_codec import _f32_as_u32, _u32_as_f32, is_bf16, load
from ._numba_kernels import (
    EPS_INSIDE,
    HAS_B,
    HAS_R,
    HAS_W,
    _add_row,
    _inline_ir,
    _jit,
    _range_rows,
    _row_sumsq,
    _rstd_from,
    like,
)
from ._numba_refs import borrow

_ABS = np.uint32(0x7FFFFFFF)
_F32_MIN_NORMAL = np.float32(2.0**-126)
# float32 bits of 2**-6 (e4m3fn's smallest normal) and the exponent re-bias (127 - 7) << 3
_E4M3_NORMAL = np.uint32(0x3C800000)
_REBIAS = np.uint32(120 << 3)
_HALF_LSB = np.uint32(0x7FFFF)
_ONE = np.uint32(1)
_SUB_MAGIC = np.float32(2.0**23)  # a + 2**23 rounds a in [0, 2**22) to an integer (RNE)
_SUB_MAGIC_BITS = np.uint32(0x4B000000)
_I8_MAGIC = np.float32(1.5 * 2.0**23)  # the same for a in [-2**22, 2**22)
_I8_MAGIC_BITS = np.int64(0x4B400000)
_E4M3_MAX = np.float32(448.0)
_I8_LO = np.float32(-128.0)
_I8_HI = np.float32(127.0)


@_inline_ir
def e4m3fn(v):
    """float32 ``v`` -> float8_e4m3fn bits: saturated to +-448, nearest even, NaN kept."""
    u = _f32_as_u32(v)
    sign = (u >> np.uint32(24)) & np.uint32(0x80)
    au = u & _ABS
    a = _u32_as_f32(au)
    a = a if a < _E4M3_MAX else _E4M3_MAX  # NaN is told apart below
    au = _f32_as_u32(a)
    nrm = ((au + _HALF_LSB + ((au >> np.uint32(20)) & _ONE)) >> np.uint32(20)) - _REBIAS
    sub = _f32_as_u32(a * np.float32(512.0) + _SUB_MAGIC) - _SUB_MAGIC_BITS
    code = sub if au < _E4M3_NORMAL else nrm
    code = code if v == v else np.uint32(0x7F)
    return np.uint8(code | sign)


@_inline_ir
def int8_bits(v):
    """float32 ``v`` -> int8 (as uint8 bits): NaN -> 0, saturated to [-128, 127], nearest even."""
    c = v if v == v else np.float32(0.0)
    c = c if c > _I8_LO else _I8_LO
    c = c if c < _I8_HI else _I8_HI
    t = np.int64(_f32_as_u32(c + _I8_MAGIC)) - _I8_MAGIC_BITS
    return np.uint8(t & 0xFF)


@_inline_ir
def _encode_span(buf, q, i, j0, j1, s, fp8):
    # unsigned columns: no negative-index wraparound test, so the loops vectorize
    lo = np.uint64(j0)
    hi = np.uint64(j1)
    if fp8:
        for j in range(lo, hi):
            q[i, j] = e4m3fn(buf[j] / s)
    else:
        for j in range(lo, hi):
            q[i, j] = int8_bits(buf[j] / s)


@_inline_ir
def _amax(buf, j0, j1):
    """``max |buf[j0:j1]|`` by the bits of the magnitudes: a NaN (above inf's bits) wins."""
    m = np.uint32(0)
    for j in range(np.uint64(j0), np.uint64(j1)):
        b = _f32_as_u32(buf[j]) & _ABS
        m = b if b > m else m
    return _u32_as_f32(m)


@_inline_ir
def quantize_row(buf, q, sc, i, static_scale, gs, qmax, fp8, static):
    """Row ``i`` of ``q`` (and of ``sc`` for dynamic scales) from its float32 ``y`` in ``buf``."""
    d = buf.shape[0]
    if static:
        _encode_span(buf, q, i, 0, d, static_scale, fp8)
        return
    for g in range(d // gs):
        lo = g * gs
        s = _amax(buf, lo, lo + gs) / qmax
        s = np.float32(1.0) if s < _F32_MIN_NORMAL else s
        sc[i, g] = s
        _encode_span(buf, q, i, lo, lo + gs, s, fp8)


@_inline_ir
def _y_row(i, a, abf, w, b, buf, rs, flags, k, eps, offset):
    """``buf = y[i]`` in float32: ``_fwd_norm_row``'s operations (its rstd, its
    two cases: ``_out_span`` and the wide ``_fwd_row_wide``)."""
    r64 = _rstd_from(a, i, k, abf, eps, (flags & EPS_INSIDE) != 0, _row_sumsq(a, i, k, abf))
    rs[0] = r64
    rc = rs[0]  # rstd in the compute type
    oc = like(offset, rc)
    has_w = (flags & HAS_W) != 0
    has_b = (flags & HAS_B) != 0
    d = a.shape[1]
    if r64 < math.inf and not rc < math.inf:
        rw = like(r64 * 2.0**-64, oc)
        up = like(2.0**64, oc)
        for j in range(d):
            val = load(a[i, j], abf) * up * rw
            if has_w:
                val = val * (like(w[j], oc) + oc)
            if has_b:
                val = val + like(b[j], oc)
            buf[j] = np.float32(val)
        return
    lo = np.uint64(0)
    hi = np.uint64(d)
    if has_w and not has_b:
        for j in range(lo, hi):
            buf[j] = np.float32(load(a[i, j], abf) * rc * (like(w[j], rc) + oc))
    elif not has_w and not has_b:
        for j in range(lo, hi):
            buf[j] = np.float32(load(a[i, j], abf) * rc)
    elif has_w:
        for j in range(lo, hi):
            val = load(a[i, j], abf) * rc * (like(w[j], rc) + oc)
            buf[j] = np.float32(val + like(b[j], rc))
    else:
        for j in range(lo, hi):
            buf[j] = np.float32(load(a[i, j], abf) * rc + like(b[j], rc))


@_jit()
def quant_rows(lo, hi, x, r, w, b, h, q, sc, buf, rs, flags, k, eps, offset,
               static_scale, gs, qmax, fp8, static):
    """Rows ``[lo, hi)``: (``h = x + r``,) ``y`` into ``buf``, then ``q`` and ``sc``.

    ``x``, ``r``, ``h``: (n, d) (16-bit floats as integer bits; ``r``/``h``
    stand-ins without HAS_R); ``w``, ``b``: (d,) in the compute type;
    ``q``: (n, d) uint8; ``sc``: (n, groups) float32; ``buf``: (d,) float32;
    ``rs``: (1,) of the compute type (rounds rstd).
    """
    x, r, w, b, h, q, sc, buf, rs = (borrow(x), borrow(r), borrow(w), borrow(b), borrow(h),
                                     borrow(q), borrow(sc), borrow(buf), borrow(rs))
    if flags & HAS_R:
        hbf = is_bf16(h)
        for i in range(lo, hi):
            _add_row(i, x, r, h, flags)
            _y_row(i, h, hbf, w, b, buf, rs, flags, k, eps, offset)
            quantize_row(buf, q, sc, i, static_scale, gs, qmax, fp8, static)
    else:
        xbf = is_bf16(x)
        for i in range(lo, hi):
            _y_row(i, x, xbf, w, b, buf, rs, flags, k, eps, offset)
            quantize_row(buf, q, sc, i, static_scale, gs, qmax, fp8, static)


@_jit(parallel=True)
def quant_parallel(x, r, w, b, h, q, sc, buf, rs, flags, k, eps, offset,
                   static_scale, gs, qmax, fp8, static):
    n = x.shape[0]
    per = _range_rows(n)
    parts = (n + per - 1) // per
    for c in prange(parts):
        lo = c * per
        quant_rows(lo, min(n, lo + per), x, r, w, b, h, q, sc, np.empty_like(buf),
                   np.empty_like(rs), flags, k, eps, offset, static_scale, gs, qmax, fp8, static)


@_jit()
def quantize_y_rows(lo, hi, y, q, sc, static_scale, gs, qmax, fp8, static):
    """Rows ``[lo, hi)`` of ``q``/``sc`` from float32 rows ``y`` (the llama path)."""
    for i in range(lo, hi):
        quantize_row(y[i], q, sc, i, static_scale, gs, qmax, fp8, static)
