"""Non-temporal ("streaming") stores for the Numba forward's large outputs.

An ordinary store to a line that is not in cache first reads that line
(read for ownership), so writing ``y`` over an existing array moves its
bytes twice: read, then written back.  A copy (``memcpy``'s ``rep movsb``,
or any copy with streaming stores) does not pay that read, which is why the
forward with ``out=`` ran at 0.6-0.7 of the copy into the same array.  A
non-temporal store writes whole 64-byte lines without reading them first.

So the forward computes ``y`` a chunk at a time into a small buffer that
stays in L1 (``stage``), then streams the buffer out with 64-byte
non-temporal stores (:func:`stream_copy`), aligned to the row's lines
(:func:`line_gap`: the elements before the first line boundary are stored
as usual).  The values and their rounding are those of the ordinary path;
only the way the bytes reach memory differs.  The lines bypass the cache,
so this pays only for outputs larger than the cache (the caller decides;
see ``polynorm.backends.numba.STREAM_MIN_BYTES``).  The forward's own
outputs stream too: they come from the output pool (``polynorm.core.pool``),
memory already in use, which streams like an ``out=`` array.

Streaming stores are weakly ordered: a thread ends its rows with
:func:`stream_fence` before other threads may read them.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LINE = 64  # bytes per streamed store (a cache line)

_I32, _I64 = ir.IntType(32), ir.IntType(64)
_LINE_VEC = ir.VectorType(_I32, LINE // 4)


def _address(context, builder, aty, aval, i, j):
    ary = context.make_array(aty)(context, builder, aval)
    ptr = cgutils.get_item_pointer(context, builder, aty, ary, [i, j], wraparound=False)
    return builder.ptrtoint(ptr, _I64)


@intrinsic
def line_gap(typingctx, a, i):
    """Elements of row ``a[i, :]`` before its first 64-byte boundary.

    For a row with unit column stride whose address is a multiple of the
    element size (the caller checks both).
    """
    if not isinstance(a, types.Array) or a.ndim != 2:
        return None

    def codegen(context, builder, sig, args):
        addr = _address(context, builder, sig.args[0], args[0], args[1], ir.Constant(_I64, 0))
        to_line = builder.and_(builder.neg(addr), ir.Constant(_I64, LINE - 1))
        return builder.udiv(to_line, ir.Constant(_I64, context.get_abi_sizeof(
            context.get_data_type(sig.args[0].dtype))))

    return types.intp(a, types.intp), codegen


@intrinsic
def stream_copy(typingctx, dst, i, j, src, count):
    """``dst[i, j : j + count] = src[0, :count]`` with non-temporal 64-byte stores.

    ``&dst[i, j]`` must lie on a 64-byte boundary and ``count`` elements must
    fill whole lines (the caller's :func:`line_gap` arithmetic); ``src`` is
    the L1-resident stage of the same element type.
    """
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
            and dst.ndim == 2 and src.ndim == 2 and dst.dtype == src.dtype):
        return None

    def codegen(context, builder, sig, args):
        dv, iv, jv, sv, cv = args
        to = _address(context, builder, sig.args[0], dv, iv, jv)
        frm = _address(context, builder, sig.args[3], sv, ir.Constant(_I64, 0),
                       ir.Constant(_I64, 0))
        size = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
        nbytes = builder.mul(cv, ir.Constant(_I64, size))
        ptr = _LINE_VEC.as_pointer()
        marker = builder.module.add_metadata([ir.Constant(_I32, 1)])
        with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), nbytes,
                                     ir.Constant(_I64, LINE), intp=_I64) as (off, _):
            v = builder.load(builder.inttoptr(builder.add(frm, off), ptr), align=4)
            st = builder.store(v, builder.inttoptr(builder.add(to, off), ptr), align=LINE)
            st.set_metadata("nontemporal", marker)
        return context.get_dummy_value()

    return types.void(dst, types.intp, types.intp, src, types.intp), codegen


def _is_x86() -> bool:
    from llvmlite import binding

    return binding.get_process_triple().startswith(("x86_64", "i386", "i686"))


_X86 = _is_x86()


@intrinsic
def stream_fence(typingctx):
    """Order this thread's streaming stores before its later stores.

    On x86 an ``sfence``: LLVM lowers a ``seq_cst`` fence to a locked
    instruction there, which Linux (``mb()`` vs ``smp_mb()``) does not trust
    to order non-temporal stores.  Elsewhere a full fence.
    """

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen
