"""Numba kernel of RMSNorm with quantized output (:class:`polynorm.core.options.QuantPlan`).

One pass over a token: its statistic (the plain forward's own row
functions, :func:`.numba.kernels._row_sumsq` and ``_rstd_from``), ``y`` in
float32 into a row buffer of the task (the operations of ``_out_span`` /
``_fwd_row_wide``, in their order: the bits of ``rms_norm(...,
out_dtype="float32")``), then the scales and the encoding from that buffer,
which is still in L1/L2.  float8 (e4m3fn, e5m2) has no Numba type: it is
encoded by bit manipulation into ``uint8`` (round to nearest even, as
``ml_dtypes``), as :mod:`.numba.codec` does for bfloat16; int8 is written
into the same ``uint8`` array as its two's complement.  The format is an
integer code (:data:`FMT_INT8`, :data:`FMT_E4M3FN`, :data:`FMT_E5M2`); with
``recip`` the encoder multiplies by the float32 reciprocal of the scale
(``scale_mode="reciprocal"``) instead of dividing by it.

Rows run in ranges under ``prange``; a token's bits depend only on its own
values (batch invariance), whatever the thread count.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from polynorm.backends.numba.codec import like, load, prefetch_span, splat
from polynorm.backends.numba.kernels import (
    _CHUNK_F,
    EPS_INSIDE,
    HAS_R,
    _add_row,
    _borrow_opt,
    _inline_ir,
    _jit,
    _range_bounds,
    _range_count,
    _row_sumsq,
    _rstd_from,
    as_type_of,
    scale_shift,
)
from polynorm.backends.numba.refs import borrow

_F32_MIN_NORMAL = np.float32(2.0**-126)


#: float32 values one call of :func:`_encode_block` encodes: four 8-lane vectors,
#: so that the 32 codes pack into one 32-byte store and the constants are
#: loaded once per block (LLVM's own vectorization of the scalar loop takes
#: 8 lanes at a time and reloads them every iteration)
QBLOCK = 32


#: the formats' codes (the kernels' ``fmt`` argument)
FMT_INT8, FMT_E4M3FN, FMT_E5M2 = 0, 1, 2
FMT = {"int8": FMT_INT8, "float8_e4m3fn": FMT_E4M3FN, "float8_e5m2": FMT_E5M2}

#: per float8 format: (largest finite value, its smallest normal, mantissa bits,
#: float32 exponent bias minus the format's, NaN code); e4m3fn's NaN is its
#: only one (0x7f), e5m2's is ml_dtypes' (0x7e, a float16 quiet NaN's high byte)
_FP8 = {FMT_E4M3FN: (448.0, 2.0**-6, 3, 120, 0x7F), FMT_E5M2: (57344.0, 2.0**-14, 2, 112, 0x7E)}


def _e4m3fn_ir(builder, v, fmt=FMT_E4M3FN):
    """float32 ``v`` (a scalar or a vector) -> float8_e4m3fn codes in int32 lanes (low 8 bits).

    Saturated to +-448, nearest even, NaN kept (sign too); 32-bit IR (Numba
    would widen the integer steps to 64 bits, halving the vector width), in
    few operations and constants.  ``fmt=FMT_E5M2``: the same steps with
    e5m2's constants (+-57344, 2 mantissa bits, smallest normal 2**-14,
    NaN 0x7e; the codes 0x7c.. above the finite ones are inf and NaN):

    - ``a = min(448, |v|)``, a float compare that keeps a NaN;
    - ``a`` rounded to the format's spacing by the float add itself:
      ``r = (a + m) - m`` with ``m = max(2**e, 2**-6) * 2**20`` (``2**e`` the
      power of two at or below ``a``), whose ulp is the format's step there
      (``2**(e-3)``, ``2**-9`` among the subnormals): one rounding to nearest
      even, and the subtraction is exact;
    - the code is the bits of ``r * 2**-120`` shifted right by 20: the
      product moves e4m3's exponent range onto float32's bottom one, so a
      normal ``r`` gives exponent and 3-bit mantissa, a subnormal one (a
      float32 subnormal, exact) its multiple of ``2**-9``; a NaN's bits give a
      code above 0x7f, which the ``min(code, 0x7f)`` turns into NaN's 0x7f;
    - the sign is ``v``'s bit 31 moved to bit 7.

    Nothing here flushes subnormals (Numba sets no FTZ/DAZ).
    """
    top, min_normal, mbits, dbias, nan = _FP8[fmt]
    shift = 23 - mbits
    min_bits = int(np.float32(min_normal).view(np.int32))
    f32, i32 = like(v, ir.FloatType()), like(v, ir.IntType(32))

    def cf(c):
        return splat(f32, c)

    def ci(c):
        return splat(i32, c)

    u = builder.bitcast(v, i32)
    sign = builder.and_(builder.lshr(u, ci(24)), ci(0x80))
    mag = builder.bitcast(builder.and_(u, ci(0x7FFFFFFF)), f32)
    # top < mag is false for a NaN, which is then kept
    a = builder.select(builder.fcmp_ordered("<", cf(top), mag), cf(top), mag)
    e = builder.and_(builder.bitcast(a, i32), ci(0x7F800000))  # 2**e, as bits
    e = builder.select(builder.icmp_signed("<", e, ci(min_bits)), ci(min_bits), e)
    m = builder.bitcast(builder.add(e, ci(shift << 23)), f32)
    r = builder.fsub(builder.fadd(a, m), m)
    code = builder.lshr(builder.bitcast(builder.fmul(r, cf(2.0**-dbias)), i32), ci(shift))
    # the finite codes are those below the NaN (e4m3fn) or below inf, 0x7c (e5m2)
    limit = 0x7F if fmt == FMT_E4M3FN else 0x7C
    code = builder.select(builder.icmp_unsigned("<", code, ci(limit)), code, ci(nan))
    return builder.or_(code, sign)


def _int8_ir(builder, x):
    """float32 ``x`` (a scalar or a vector) -> int8 in int32 lanes (low 8 bits): NaN -> 0,
    saturated to [-128, 127], nearest even.

    The clamped value plus 1.5 * 2**23 (float32) is rounded to an integer
    by the addition itself; its low bits are the result (32-bit IR, as
    :func:`_e4m3fn_ir`).
    """
    f32, i32 = like(x, ir.FloatType()), like(x, ir.IntType(32))

    def cf(c):
        return splat(f32, c)

    def ci(c):
        return splat(i32, c)

    x = builder.select(builder.fcmp_unordered("uno", x, x), cf(0.0), x)
    x = builder.select(builder.fcmp_ordered(">", x, cf(-128.0)), x, cf(-128.0))
    x = builder.select(builder.fcmp_ordered("<", x, cf(127.0)), x, cf(127.0))
    t = builder.bitcast(builder.fadd(x, cf(1.5 * 2.0**23)), i32)
    return builder.sub(t, ci(0x4B400000))


@intrinsic
def e4m3fn(typingctx, v):
    """float32 ``v`` -> float8_e4m3fn bits (:func:`_e4m3fn_ir`)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.trunc(_e4m3fn_ir(builder, args[0]), ir.IntType(8))

    return types.uint8(v), codegen


@intrinsic
def e5m2(typingctx, v):
    """float32 ``v`` -> float8_e5m2 bits (:func:`_e4m3fn_ir` with e5m2's constants)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.trunc(_e4m3fn_ir(builder, args[0], FMT_E5M2), ir.IntType(8))

    return types.uint8(v), codegen


@intrinsic
def int8_bits(typingctx, v):
    """float32 ``v`` -> int8 as uint8 bits (:func:`_int8_ir`)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.trunc(_int8_ir(builder, args[0]), ir.IntType(8))

    return types.uint8(v), codegen


@intrinsic
def _encode_block(typingctx, buf, q, i, j, s, fmt, recip):
    """``q[i, j : j + QBLOCK] = encode(buf[j : j + QBLOCK] / s)`` (``* s`` with
    ``recip``, ``s`` then the reciprocal) as vector IR: the lanes of
    :func:`e4m3fn`, :func:`e5m2` or :func:`int8_bits` (``fmt``, ``recip``:
    compile-time constants), the same operations lane by lane, so the same
    bits.  ``buf`` and ``q``'s rows must have adjacent elements (the kernel
    allocates both)."""
    if not (isinstance(buf, types.Array) and buf.ndim == 1 and buf.dtype == types.float32
            and isinstance(q, types.Array) and q.ndim == 2 and q.dtype == types.uint8
            and s == types.float32 and isinstance(fmt, types.IntegerLiteral)
            and isinstance(recip, types.BooleanLiteral)):
        return None
    fmt_v, mul = fmt.literal_value, recip.literal_value

    def codegen(context, builder, sig, args):
        bv, qv, iv, jv, sv = args[:5]
        bty, qty = sig.args[0], sig.args[1]
        iv = context.cast(builder, iv, sig.args[2], types.intp)
        jv = context.cast(builder, jv, sig.args[3], types.intp)
        bary = context.make_array(bty)(context, builder, bv)
        src = cgutils.get_item_pointer2(context, builder, bary.data,
                                        cgutils.unpack_tuple(builder, bary.shape),
                                        cgutils.unpack_tuple(builder, bary.strides),
                                        bty.layout, [jv])
        qary = context.make_array(qty)(context, builder, qv)
        dst = cgutils.get_item_pointer2(context, builder, qary.data,
                                        cgutils.unpack_tuple(builder, qary.shape),
                                        cgutils.unpack_tuple(builder, qary.strides),
                                        qty.layout, [iv, jv])
        vf = ir.VectorType(ir.FloatType(), QBLOCK)
        x = builder.load(builder.bitcast(src, vf.as_pointer()), align=4)
        splat = builder.insert_element(ir.Constant(vf, ir.Undefined), sv,
                                       ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(splat, splat,
                                       ir.Constant(ir.VectorType(ir.IntType(32), QBLOCK),
                                                   [0] * QBLOCK))
        x = builder.fmul(x, splat) if mul else builder.fdiv(x, splat)
        code = _int8_ir(builder, x) if fmt_v == FMT_INT8 else _e4m3fn_ir(builder, x, fmt_v)
        vb = ir.VectorType(ir.IntType(8), QBLOCK)
        builder.store(builder.trunc(code, vb), builder.bitcast(dst, vb.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(buf, q, i, j, s, fmt, recip), codegen


@_inline_ir
def _encode_span(buf, q, i, j0, j1, s, fmt, recip, pa, pb, pf):
    """``q[i, j0:j1]`` from ``buf / s`` (``buf * s`` with ``recip``: ``s`` is then
    the scale's float32 reciprocal).  The encoder is a row's longest pass, so
    it is the one that prefetches the next row's inputs, the same columns a
    chunk at a time: ``pa[i + 1]`` where ``pf & 1``, ``pb[i + 1]`` where ``pf & 2``
    (a burst of a whole row's prefetches in a short pass stalls on the
    cache's miss buffers)."""
    for jc in range(j0, j1, _CHUNK_F):
        je = min(jc + _CHUNK_F, j1)
        if pf & 1:
            prefetch_span(pa, i + 1, jc, je - jc)
        if pf & 2:
            prefetch_span(pb, i + 1, jc, je - jc)
        # unsigned columns: no negative-index wraparound test, so the loops vectorize
        lo = np.uint64(jc)
        hi = np.uint64(je)
        hb = lo + (hi - lo) // np.uint64(QBLOCK) * np.uint64(QBLOCK)
        # one loop per (format, mode): the block's constants are compile-time
        step = np.uint64(QBLOCK)
        if recip:
            if fmt == 1:
                for j in range(lo, hb, step):
                    _encode_block(buf, q, i, j, s, 1, True)
                for j in range(hb, hi):
                    q[i, j] = e4m3fn(buf[j] * s)
            elif fmt == 2:
                for j in range(lo, hb, step):
                    _encode_block(buf, q, i, j, s, 2, True)
                for j in range(hb, hi):
                    q[i, j] = e5m2(buf[j] * s)
            else:
                for j in range(lo, hb, step):
                    _encode_block(buf, q, i, j, s, 0, True)
                for j in range(hb, hi):
                    q[i, j] = int8_bits(buf[j] * s)
        else:
            if fmt == 1:
                for j in range(lo, hb, step):
                    _encode_block(buf, q, i, j, s, 1, False)
                for j in range(hb, hi):
                    q[i, j] = e4m3fn(buf[j] / s)
            elif fmt == 2:
                for j in range(lo, hb, step):
                    _encode_block(buf, q, i, j, s, 2, False)
                for j in range(hb, hi):
                    q[i, j] = e5m2(buf[j] / s)
            else:
                for j in range(lo, hb, step):
                    _encode_block(buf, q, i, j, s, 0, False)
                for j in range(hb, hi):
                    q[i, j] = int8_bits(buf[j] / s)


@intrinsic
def _max_mag(typingctx, m, v):
    """``max(m, bits of |v|)`` for float32 ``v`` and the running maximum's bits
    ``m`` (int32): positive floats order as their bits, and a NaN's are above
    inf's, so a NaN wins.  32-bit IR: Numba would compare in 64 bits."""
    if m != types.int32 or v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        b = builder.and_(builder.bitcast(args[1], i32), ir.Constant(i32, 0x7FFFFFFF))
        return builder.select(builder.icmp_signed(">", b, args[0]), b, args[0])

    return types.int32(m, v), codegen


@intrinsic
def _bits_f32(typingctx, m):
    """The float32 whose bits are int32 ``m``."""
    if m != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(m), codegen


@_inline_ir
def _amax(buf, j0, j1):
    """``max |buf[j0:j1]|`` by the bits of the magnitudes: a NaN (above inf's bits) wins."""
    m = np.int32(0)
    for j in range(np.uint64(j0), np.uint64(j1)):
        m = _max_mag(m, buf[j])
    return _bits_f32(m)


@_inline_ir
def quantize_row(buf, q, sc, i, static_scale, gs, qmax, fmt, recip, static, amax, pa, pb, pf):
    """Row ``i`` of ``q`` (and of ``sc`` for dynamic scales) from its float32 ``y`` in ``buf``;
    ``amax``: ``max |y|`` of the row, already known (one group) or < 0 (recomputed here);
    ``pa``, ``pb``, ``pf``: the next row's prefetches (:func:`_encode_span`).
    ``static_scale`` is the scale itself; with ``recip`` the encoder takes its
    float32 reciprocal (a dynamic one's too)."""
    d = buf.shape[0]
    # one encoder call site for both scale kinds (a static scale is one group of
    # the whole row): each site inlines the six encoder loops (compile time)
    span = d if static else gs
    for g in range(1 if static else d // gs):
        lo = g * span
        if static:
            t = np.float32(1.0) / static_scale if recip else static_scale
        else:
            m = amax if gs == d and not amax < 0 else _amax(buf, lo, lo + gs)
            s = m / qmax
            s = np.float32(1.0) if s < _F32_MIN_NORMAL else s
            sc[i, g] = s
            t = np.float32(1.0) / s if recip else s
        _encode_span(buf, q, i, lo, lo + span, t, fmt, recip, pa, pb, pf)


@_inline_ir
def _y_span(i, a, w, b, buf, j0, j1, rc, oc, flags, m):
    """``buf[j0:j1] = y[i, j0:j1]`` (``_out_span``'s value, in float32), and the
    running ``max |y|`` bits ``m`` over them (NaN's bits are above inf's: NaN wins)."""
    for j in range(np.uint64(j0), np.uint64(j1)):
        v = np.float32(scale_shift(load(a[i, j]) * rc, w, b, j, oc))
        buf[j] = v
        m = _max_mag(m, v)
    return m


@_inline_ir
def _y_row(i, a, w, b, buf, rs, flags, k, eps, offset):
    """``buf = y[i]`` in float32 with ``_fwd_norm_row``'s operations (its rstd, its
    two cases: ``_out_span`` and the wide ``_fwd_row_wide``); returns ``max |y|``."""
    r64 = _rstd_from(a, i, k, eps, (flags & EPS_INSIDE) != 0, _row_sumsq(a, i, k))
    rs[0] = r64
    rc = rs[0]  # rstd in the compute type
    oc = as_type_of(offset, rc)
    d = a.shape[1]
    if r64 < math.inf and not rc < math.inf:
        rw = as_type_of(r64 * 2.0**-64, oc)
        up = as_type_of(2.0**64, oc)
        for j in range(d):
            buf[j] = np.float32(scale_shift(load(a[i, j]) * up * rw, w, b, j, oc))
        return _amax(buf, 0, d)
    return _bits_f32(_y_span(i, a, w, b, buf, 0, d, rc, oc, flags, np.int32(0)))


@_jit()
def quant_rows(lo, hi, x, r, w, b, h, q, sc, buf, rs, flags, k, eps, offset,
               static_scale, gs, qmax, fmt, recip, static):
    """Rows ``[lo, hi)``: (``h = x + r``,) ``y`` into ``buf``, then ``q`` and ``sc``.

    ``x``, ``r``, ``h``: (n, d) (16-bit floats as integer bits; ``r``/``h``
    stand-ins without HAS_R); ``w``, ``b``: (d,) in the compute type (``w``
    ones where absent, ``b`` None);
    ``q``: (n, d) uint8; ``sc``: (n, groups) float32; ``buf``: (d,) float32;
    ``rs``: (1,) of the compute type (rounds rstd).
    """
    x, r, h, q, sc, buf, rs = (borrow(x), borrow(r), borrow(h), borrow(q), borrow(sc),
                               borrow(buf), borrow(rs))
    w, b = _borrow_opt(w), _borrow_opt(b)
    n = x.shape[0]
    has_r = (flags & HAS_R) != 0
    for i in range(lo, hi):
        if has_r:
            _add_row(i, x, r, h)
            m = _y_row(i, h, w, b, buf, rs, flags, k, eps, offset)
        else:
            m = _y_row(i, x, w, b, buf, rs, flags, k, eps, offset)
        # one quantize_row call site (it inlines the encoders): without a residual
        # r is a stand-in and only x is prefetched
        pf = (3 if has_r else 1) if i + 1 < n else 0
        quantize_row(buf, q, sc, i, static_scale, gs, qmax, fmt, recip, static, m, x, r, pf)


@_jit(parallel=True)
def quant_parallel(x, r, w, b, h, q, sc, buf, rs, flags, k, eps, offset,
                   static_scale, gs, qmax, fmt, recip, static):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        quant_rows(lo, hi, x, r, w, b, h, q, sc, np.empty_like(buf),
                   np.empty_like(rs), flags, k, eps, offset, static_scale, gs, qmax, fmt, recip, static)


@_jit()
def quantize_y_rows(lo, hi, y, q, sc, static_scale, gs, qmax, fmt, recip, static):
    """Rows ``[lo, hi)`` of ``q``/``sc`` from float32 rows ``y`` (the llama path)."""
    for i in range(lo, hi):
        quantize_row(y[i], q, sc, i, static_scale, gs, qmax, fmt, recip, static, np.float32(-1.0),
                     y, y, 0)
