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
