"""Borrowed arrays: the kernels' array arguments without reference counting.

Numba reference-counts every array variable: each copy of an array into a
new variable (an argument of an inlined function, a call's argument) is an
``NRT_incref`` / ``NRT_decref`` pair, an atomic operation on a counter that
every thread working on the same array shares.  In a loop over the chunks
of a row this cost more than the arithmetic: float32 rows of 4096 elements
took 241 ps per element in cache, twice the 122 of 2048-element rows, which
are not chunked.

:func:`borrow` returns the same array (data, shape, strides, type) with no
memory-info pointer: Numba's reference-count calls then return at once.  A
kernel borrows its arguments on entry; the caller holds the arrays for the
whole call, and a borrowed array never leaves the kernel.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def borrow(typingctx, a):
    """``a`` without its memory-info pointer (not reference counted); see the module."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        out = context.make_array(sig.return_type)(context, builder)
        out.meminfo = cgutils.get_null_value(src.meminfo.type)
        out.parent = cgutils.get_null_value(src.parent.type)
        out.nitems = src.nitems
        out.itemsize = src.itemsize
        out.data = src.data
        out.shape = src.shape
        out.strides = src.strides
        return out._getvalue()

    return a(a), codegen


def _span(context, builder, aty, aval, row, col, cnt):
    """``a[row, col : col + cnt]`` of 2-D ``a`` (unit column stride) as a borrowed
    ``(1, cnt)`` C array; ``row``, ``col``, ``cnt``: intp values."""
    src = context.make_array(aty)(context, builder, aval)
    out = context.make_array(aty.copy(layout="C"))(context, builder)
    intp = context.get_value_type(types.intp)
    s0 = builder.extract_value(src.strides, 0)
    base = builder.bitcast(src.data, cgutils.voidptr_t)
    off = builder.add(builder.mul(row, s0), builder.mul(col, src.itemsize))
    out.meminfo = cgutils.get_null_value(src.meminfo.type)
    out.parent = cgutils.get_null_value(src.parent.type)
    out.nitems = cnt
    out.itemsize = src.itemsize
    out.data = builder.bitcast(builder.gep(base, [off]), src.data.type)
    out.shape = cgutils.pack_array(builder, [intp(1), cnt])
    out.strides = cgutils.pack_array(builder, [builder.mul(cnt, src.itemsize), src.itemsize])
    return out._getvalue()


@intrinsic
def row_of(typingctx, a, i):
    """Row ``i`` of 2-D ``a`` as a borrowed ``(1, d)`` C-contiguous array.

    ``a``'s elements must be adjacent (unit column stride; the backend copies
    other rows first); any row stride, negative or zero, is fine.  The row
    reductions (``_sumsq``, ``_dot_row``) take rows this way, so that they
    are compiled once for every layout of the caller's array: LLVM
    vectorizes a reduction over a C row and one over an ``A``-layout row in
    different orders, which gave a padded or negatively strided row other
    bits than the same row in a contiguous array.
    """
    if not isinstance(a, types.Array) or a.ndim != 2 or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        row = context.cast(builder, args[1], sig.args[1], types.intp)
        src = context.make_array(sig.args[0])(context, builder, args[0])
        d = builder.extract_value(src.shape, 1)
        zero = context.get_constant(types.intp, 0)
        return _span(context, builder, sig.args[0], args[0], row, zero, d)

    return a.copy(layout="C")(a, i), codegen


@intrinsic
def row_span(typingctx, a, i, j, n):
    """``a[i, j : j + n]`` as a borrowed ``(1, n)`` C-contiguous array (unit
    column stride): a group handed to the plain forward's row reductions,
    which then reduce it as they reduce a row of ``n`` elements."""
    if not isinstance(a, types.Array) or a.ndim != 2:
        return None

    def codegen(context, builder, sig, args):
        row, col, cnt = (context.cast(builder, v, t, types.intp)
                         for v, t in zip(args[1:], sig.args[1:], strict=True))
        return _span(context, builder, sig.args[0], args[0], row, col, cnt)

    return a.copy(layout="C")(a, types.intp, types.intp, types.intp), codegen
