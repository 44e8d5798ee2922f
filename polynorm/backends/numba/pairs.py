"""bfloat16 rows read and written as 32-bit pairs: the backward's passes in explicit vectors.

A bfloat16 value is the top half of a float32, so 16 of them loaded as eight
32-bit words give two float32 vectors at one operation each: the words
shifted up 16 bits hold the even elements, the words with their low half
cleared the odd ones (the forward's sums of squares read rows this way too,
``numba.codec._bf16_block_squares_pairs``).  The way back is as short: the
rounded even results shifted down, the odd ones blended in as high halves.
LLVM's vectorization of the scalar loop widens and narrows each element
instead, with a shuffle each way (``python bench/asm.py`` counts both).

:func:`dx_pairs` computes every element with the float32 operations of the
scalar loop (``numba.backward_kernels._dx_val``), in the same order, so dx has the
same bits.  What differs is where a column's row-tree term (``dy * xhat``)
goes in a pool row: the 16 columns of a block ``b`` (``16*b .. 16*b+15``,
whole blocks only) sit with the even ones first (:func:`pair_position`).
The tree adds column by column, so the order does not change its sums; the
kernel puts the columns back in order where a node leaves it.  The weight
is read in the same order (:func:`pair_weight`, with the offset added).

:func:`dot_pairs`, the row's ``c`` before that pass, reads the row the same
way and sums in an order it states (LLVM's vectorization of the scalar dot
chose its own).  ``python bench/asm.py`` counts the instructions of both
passes and of LLVM's loops beside them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from polynorm.backends.numba.codec import _row_at, fma_ir, splat
from polynorm.backends.numba.kernels import DOT_BLOCK, _inline

#: Columns per block of the pair layout.
PAIR_BLOCK = 16

_LANES = PAIR_BLOCK // 2
_I1, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_VI = ir.VectorType(_I32, _LANES)
_VF = ir.VectorType(_F32, _LANES)
_VH = ir.VectorType(_I16, PAIR_BLOCK)
#: i16 lane l of a stored block: the even result's (shifted) low half for even
#: l, the odd result's high half for odd l (one vpblendw)
_BLEND = ir.Constant(ir.VectorType(_I32, PAIR_BLOCK),
                     [lane if lane % 2 == 0 else PAIR_BLOCK + lane for lane in range(PAIR_BLOCK)])


def _vsplat(builder, ty, v):
    """A vector of type ``ty`` with ``v`` (an LLVM value) in every lane."""
    first = builder.insert_element(ir.Constant(ty, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, first, ir.Constant(ir.VectorType(_I32, ty.count),
                                                            [0] * ty.count))


def _decode(builder, words):
    """The even and odd elements of 16 bfloat16 values (eight i32 words) as float32."""
    even = builder.shl(words, splat(_VI, 16))
    odd = builder.and_(words, splat(_VI, -65536))
    return builder.bitcast(even, _VF), builder.bitcast(odd, _VF)


def _round(builder, v):
    """float32 lanes rounded to bfloat16 in the top halves of their i32 words.

    Round to nearest even as :func:`.numba.codec.round_bf16_ir` does (bias
    0x7FFF, 0x8000 when the kept part is odd).  A NaN lane gets no bias, so
    its top half is its own: ``v`` here is always the result of a float
    multiply or add, and those return quiet NaNs (LLVM's semantics, and what
    x86 and Arm do), so that is the quiet NaN with the top of its payload
    that the codec's guard makes.
    """
    u = builder.bitcast(v, _VI)
    odd = builder.and_(builder.lshr(u, splat(_VI, 16)), splat(_VI, 1))
    bias = builder.add(odd, splat(_VI, 0x7FFF))
    nan = builder.fcmp_unordered("uno", v, v)
    return builder.add(u, builder.select(nan, splat(_VI, 0), bias))


def _pack(builder, even, odd):
    """The 16 bfloat16 values (i16 lanes, in order) of rounded even and odd words."""
    lo = builder.bitcast(builder.lshr(even, splat(_VI, 16)), _VH)
    return builder.shuffle_vector(lo, builder.bitcast(odd, _VH), _BLEND)


def _ptr(builder, base, byte_offset, ty):
    return builder.inttoptr(builder.add(base, byte_offset), ty.as_pointer())


@intrinsic
def dx_pairs(typingctx, x, dy, dx, g2, pc, pad, i, j0, j1, k, rc, coef, ro, e0, e1, e2, fold):
    """``dx[i, j0:j1]`` of a bfloat16 row, and its row-tree terms into pool ``pc``.

    The pass of ``numba.backward_kernels._dx_pass`` (weight, no grad_residual) for
    columns ``j0 .. j1`` (multiples of :data:`PAIR_BLOCK`; rows with unit
    column stride): ``dx = rc * (dy * g - xhat * c)`` with ``c = coef`` for
    columns below ``k`` and 0 from ``k`` on, ``g`` from ``g2``
    (:func:`pair_weight`); ``dy * xhat`` to pool row ``ro`` (its columns
    from element ``pad`` on) in the pair layout, joined with the waiting
    siblings ``e2 + (e1 + (e0 + term))`` if ``fold``.  Arrays of other dtypes
    compile to nothing (the callers' branch on :func:`pairs_kernel` removes
    the call).
    """
    if not all(isinstance(a, types.Array) for a in (x, dy, dx, g2, pc)):
        return None
    sig = types.void(x, dy, dx, g2, pc, pad, i, j0, j1, k, rc, coef, ro, e0, e1, e2, fold)
    if x.dtype != types.uint16 or rc != types.float32:
        return sig, lambda context, builder, sig, args: context.get_dummy_value()

    def codegen(context, builder, sig, args):
        xv, dyv, dxv, g2v, pcv = args[:5]
        at = sig.args

        def intp(n):
            return context.cast(builder, args[n], at[n], types.intp)

        pad, iv, lo, hi, kv = intp(5), intp(6), intp(7), intp(8), intp(9)
        xb = _row_at(context, builder, at[0], xv, iv, ir.Constant(_I64, 0))[0]
        dyb = _row_at(context, builder, at[1], dyv, iv, ir.Constant(_I64, 0))[0]
        dxb = _row_at(context, builder, at[2], dxv, iv, ir.Constant(_I64, 0))[0]
        gb = builder.ptrtoint(context.make_array(at[3])(context, builder, g2v).data, _I64)
        rows = [_row_at(context, builder, at[4], pcv, intp(n), pad)[0] for n in (12, 13, 14, 15)]
        rcv = _vsplat(builder, _VF, args[10])
        cv = _vsplat(builder, _VF, args[11])
        zero = splat(_VF, 0.0)
        fold_on = context.cast(builder, args[16], at[16], types.boolean)

        def block(j, ce, co, fold):
            b2 = builder.mul(j, ir.Constant(_I64, 2))
            b4 = builder.mul(j, ir.Constant(_I64, 4))
            b4o = builder.add(b4, ir.Constant(_I64, 4 * _LANES))
            xe, xo = _decode(builder, builder.load(_ptr(builder, xb, b2, _VI), align=1))
            ye, yo = _decode(builder, builder.load(_ptr(builder, dyb, b2, _VI), align=1))
            ge = builder.load(_ptr(builder, gb, b4, _VF), align=4)
            go = builder.load(_ptr(builder, gb, b4o, _VF), align=4)
            out = []
            for xs, ys, gs, cs, off in ((xe, ye, ge, ce, b4), (xo, yo, go, co, b4o)):
                # operands in the order of the scalar loop's machine code: where
                # two NaNs meet, x86 returns the first operand's
                xh = builder.fmul(xs, rcv)
                v = builder.fmul(builder.fsub(builder.fmul(gs, ys), builder.fmul(xh, cs)), rcv)
                out.append(_round(builder, v))
                p = builder.fmul(xh, ys)
                if fold:
                    for e in rows[1:]:
                        p = builder.fadd(p, builder.load(_ptr(builder, e, off, _VF), align=4))
                builder.store(p, _ptr(builder, rows[0], off, _VF), align=4)
            builder.store(_pack(builder, *out), _ptr(builder, dxb, b2, _VH), align=1)

        def span(start, stop, ce, co, fold):
            with cgutils.for_range_slice(builder, start, stop, ir.Constant(_I64, PAIR_BLOCK),
                                         intp=_I64) as (j, _):
                block(j, ce, co, fold)

        def clamp(v):
            return builder.select(builder.icmp_signed("<", v, lo), lo,
                                  builder.select(builder.icmp_signed(">", v, hi), hi, v))

        # columns below k take coef, the others 0: whole blocks each side of
        # k, and the block that spans it with a coefficient per lane
        kb = builder.and_(kv, ir.Constant(_I64, -PAIR_BLOCK))
        spans = builder.icmp_signed("!=", kb, kv)
        a_end = clamp(kb)
        c_start = clamp(builder.add(kb, builder.select(spans, ir.Constant(_I64, PAIR_BLOCK),
                                                       ir.Constant(_I64, 0))))
        mid = builder.and_(spans, builder.and_(builder.icmp_signed(">=", kb, lo),
                                               builder.icmp_signed("<", kb, hi)))
        ksplat = _vsplat(builder, ir.VectorType(_I64, _LANES), kv)
        kbsplat = _vsplat(builder, ir.VectorType(_I64, _LANES), kb)
        cols_e = builder.add(kbsplat, ir.Constant(ir.VectorType(_I64, _LANES),
                                                  list(range(0, PAIR_BLOCK, 2))))
        cols_o = builder.add(kbsplat, ir.Constant(ir.VectorType(_I64, _LANES),
                                                  list(range(1, PAIR_BLOCK, 2))))
        ke = builder.select(builder.icmp_signed("<", cols_e, ksplat), cv, zero)
        ko = builder.select(builder.icmp_signed("<", cols_o, ksplat), cv, zero)
        for fold in (True, False):
            with builder.if_then(fold_on if fold else builder.not_(fold_on)):
                span(lo, a_end, cv, cv, fold)
                with builder.if_then(mid):
                    block(kb, ke, ko, fold)
                span(c_start, hi, zero, zero, fold)
        return context.get_dummy_value()

    return sig, codegen


def pairs_kernel(x, w, gr):  # pragma: no cover - replaced by the overload
    """Whether a backward on rows ``x`` with weight ``w`` and ``gr`` takes :func:`dx_pairs`
    (bfloat16 with a weight, no grad_residual): a compile-time constant."""
    raise NotImplementedError


@overload(pairs_kernel, inline="always")
def _ov_pairs_kernel(x, w, gr):
    flag = (isinstance(x, types.Array) and x.dtype == types.uint16
            and not isinstance(w, (types.NoneType, types.Omitted))
            and isinstance(gr, (types.NoneType, types.Omitted)))
    return lambda x, w, gr: flag


@_inline
def pair_weight(w, offset, n):
    """``w + offset`` in float32, its first ``n`` columns (whole blocks) in the pair layout."""
    g2 = np.empty(n, np.float32)
    if w is not None:
        oc = np.float32(offset)
        for b in range(0, n, PAIR_BLOCK):
            for t in range(_LANES):
                g2[b + t] = np.float32(w[b + 2 * t]) + oc
                g2[b + _LANES + t] = np.float32(w[b + 2 * t + 1]) + oc
    return g2


@_inline
def pair_position(j, n):
    """Where column ``j`` sits in a pool row whose first ``n`` columns are in pairs."""
    if j >= n:
        return j
    r = j % PAIR_BLOCK
    return j - r + (r >> 1) + _LANES * (r & 1)


def _decode1(builder, bits16):
    """One bfloat16 (i16) as float32."""
    return builder.bitcast(builder.shl(builder.zext(bits16, _I32), ir.Constant(_I32, 16)), _F32)


@intrinsic
def dot_pairs(typingctx, x, dy, g2, w, i, rc, oc):
    """The backward's ``c = sum_j g_j * dy[i, j] * xhat[i, j]`` of a bfloat16 row, in float64.

    Per :data:`DOT_BLOCK` columns a float32 partial, added to ``c`` in
    float64.  In a block, the whole 16-column blocks of the pair layout (the
    first ``len(g2)`` columns) go to 32 float32 lanes -- lane ``t`` of
    16-column block ``m`` (even columns first) is lane ``t + 16 * (m % 2)``
    -- each one fused multiply-add per column, ``g * (dy * xhat)``; the
    lanes are then added in a fixed tree (the two blocks' lanes, the even
    and odd halves, then halves of 8, 4, 2), and the columns past the pair
    layout (the row's last < 16) are added to that one at a time, in order.
    ``g`` is ``g2`` (:func:`pair_weight`) in the pair layout, ``w + oc``
    past it.  The order is this code's, not the optimizer's: the same row
    has the same ``c`` in every kernel that calls this.  Other dtypes, or no
    weight, compile to 0 (the callers' branch on :func:`pairs_kernel` removes
    the call).
    """
    if not all(isinstance(a, types.Array) for a in (x, dy, g2)):
        return None
    sig = types.float64(x, dy, g2, w, i, rc, oc)
    if not isinstance(w, types.Array) or x.dtype != types.uint16 or rc != types.float32:
        return sig, lambda context, builder, sig, args: context.get_constant(types.float64, 0.0)

    def codegen(context, builder, sig, args):
        xv, dyv, g2v, wv = args[:4]
        at = sig.args
        iv = context.cast(builder, args[4], at[4], types.intp)
        rcs, ocs = args[5], context.cast(builder, args[6], at[6], types.float32)
        rcv = _vsplat(builder, _VF, rcs)
        xa = context.make_array(at[0])(context, builder, xv)
        d = cgutils.unpack_tuple(builder, xa.shape)[1]
        xb = _row_at(context, builder, at[0], xv, iv, ir.Constant(_I64, 0))[0]
        dyb = _row_at(context, builder, at[1], dyv, iv, ir.Constant(_I64, 0))[0]
        ga = context.make_array(at[2])(context, builder, g2v)
        gb = builder.ptrtoint(ga.data, _I64)
        npair = cgutils.unpack_tuple(builder, ga.shape)[0]
        wb = builder.ptrtoint(context.make_array(at[3])(context, builder, wv).data, _I64)
        zero = splat(_VF, 0.0)
        c = cgutils.alloca_once_value(builder, ir.Constant(ir.DoubleType(), 0.0))
        accs = [cgutils.alloca_once(builder, _VF) for _ in range(4)]  # block 0 e/o, block 1 e/o
        s = cgutils.alloca_once(builder, _F32)

        def add_block(j, pair):
            """Lanes of accumulator pair ``pair`` plus 16-column block ``j``."""
            b2 = builder.mul(j, ir.Constant(_I64, 2))
            b4 = builder.mul(j, ir.Constant(_I64, 4))
            xe, xo = _decode(builder, builder.load(_ptr(builder, xb, b2, _VI), align=1))
            ye, yo = _decode(builder, builder.load(_ptr(builder, dyb, b2, _VI), align=1))
            for xs, ys, half in ((xe, ye, 0), (xo, yo, 1)):
                g = builder.load(_ptr(builder, gb, builder.add(b4, ir.Constant(
                    _I64, 4 * _LANES * half)), _VF), align=4)
                p = builder.fmul(ys, builder.fmul(xs, rcv))
                acc = accs[2 * pair + half]
                builder.store(fma_ir(builder, g, p, builder.load(acc)), acc)

        step = ir.Constant(_I64, DOT_BLOCK)
        with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), d, step, intp=_I64) as (b, _):
            e = builder.add(b, step)
            e = builder.select(builder.icmp_signed("<", e, d), e, d)
            pe = builder.select(builder.icmp_signed("<", e, npair), e, npair)
            pe = builder.select(builder.icmp_signed("<", pe, b), b, pe)
            for acc in accs:
                builder.store(zero, acc)
            # pairs of 16-column blocks, then a last single one
            n2 = builder.sub(pe, b)
            two = builder.add(b, builder.and_(n2, ir.Constant(_I64, -2 * PAIR_BLOCK)))
            with cgutils.for_range_slice(builder, b, two, ir.Constant(_I64, 2 * PAIR_BLOCK),
                                         intp=_I64) as (j, _):
                add_block(j, 0)
                add_block(builder.add(j, ir.Constant(_I64, PAIR_BLOCK)), 1)
            with builder.if_then(builder.icmp_signed("<", two, pe)):
                add_block(two, 0)
            v = [builder.load(acc) for acc in accs]
            v = builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))
            m = _LANES
            while m > 1:
                h = m // 2
                lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h),
                                                              list(range(h))))
                hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h),
                                                              list(range(h, m))))
                v = builder.fadd(lo, hi)
                m = h
            builder.store(builder.extract_element(v, ir.Constant(_I32, 0)), s)
            # the row's last columns, past the pair layout, one at a time
            with cgutils.for_range_slice(builder, pe, e, ir.Constant(_I64, 1), intp=_I64) as (j, _):
                b2 = builder.mul(j, ir.Constant(_I64, 2))
                xs = _decode1(builder, builder.load(_ptr(builder, xb, b2, _I16), align=1))
                ys = _decode1(builder, builder.load(_ptr(builder, dyb, b2, _I16), align=1))
                g = builder.fadd(builder.load(_ptr(builder, wb, builder.mul(
                    j, ir.Constant(_I64, 4)), _F32), align=4), ocs)
                p = builder.fmul(ys, builder.fmul(xs, rcs))
                builder.store(fma_ir(builder, g, p, builder.load(s)), s)
            builder.store(builder.fadd(builder.load(c), builder.fpext(builder.load(s),
                                                                       ir.DoubleType())), c)
        return builder.load(c)

    return sig, codegen
