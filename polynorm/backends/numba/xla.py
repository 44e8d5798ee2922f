"""The plain forward as a compiled XLA FFI handler: a Numba ``cfunc``, no Python per call.

:mod:`polynorm.jax.ffi`'s handler is Python (ctypes): each call takes the GIL,
wraps XLA's buffers as numpy arrays and runs the front end, ~15-60 us before
the kernel starts, several times a (1, 4096) forward.  The handler here is
machine code that reads the call frame (``xla/ffi/api/c_api.h``, API 0.1
fields only, the layout :mod:`polynorm.jax.ffi` declares with ctypes) and runs
the same serial or parallel driver as :func:`polynorm.backends.numba.forward`
(the size rule :func:`~polynorm.backends.numba._parallel`) on XLA's own
buffers: the eager call's bits, at the cost of the custom call itself.

It takes the plain forward only (no residual, not llama, not
``casting="none"``, no ``group_size``), ``x`` as 2-D rows, ``weight`` and
``bias`` as ``(d,)`` vectors already in the compute dtype (absent: ones / none),
results ``y`` (``(n, d)``, any float dtype the kernels store) and ``rstd``
(``(n,)``, the compute dtype); ``flags``, ``k``, ``eps`` and ``offset`` are the
call's attributes, in this order (XLA sorts them by name: ``a_flags``,
``b_k``, ``c_eps``, ``d_offset``).  One handler per (x, y, compute dtype,
bias or not), compiled on first use (cached on disk with the kernels).

The handlers run the serial driver unless :func:`allow_threads` (see there
why); the same bits either way.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from polynorm.backends import numba as _nb

_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata

#: byte offsets in XLA_FFI_CallFrame (64-bit)
_EXT, _STAGE = 8, 32
_ARGS_PTRS, _RETS_PTRS, _ATTRS_PTRS = 72, 112, 160
#: in XLA_FFI_Buffer
_DATA, _RANK, _DIMS = 24, 32, 40

#: [parallel driver allowed, forked after an OpenMP launch]: read by the handlers on every call
_STATE = np.zeros(2, np.int64)


@intrinsic
def _word(typingctx, addr):
    """The int64 at address ``addr``."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load(p)

    return types.int64(types.int64), codegen


@intrinsic
def _int32(typingctx, addr):
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        return builder.sext(builder.load(p), ir.IntType(64))

    return types.int64(types.int64), codegen


@intrinsic
def _double(typingctx, addr):
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.DoubleType().as_pointer())
        return builder.load(p)

    return types.float64(types.int64), codegen


@intrinsic
def _put_int32(typingctx, addr, v):
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        builder.store(builder.trunc(args[1], ir.IntType(32)), p)
        return context.get_dummy_value()

    return types.none(types.int64, types.int64), codegen


@intrinsic
def _address(typingctx, p):
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return types.int64(types.voidptr), codegen


@intrinsic
def _pointer(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@njit(nogil=True)
def _rows(buf):
    """The product of an XLA_FFI_Buffer's dimensions but the last (1 for a vector)."""
    dims = _word(buf + _DIMS)
    r = 1
    for i in range(_word(buf + _RANK) - 1):
        r *= _word(dims + 8 * i)
    return r


@njit(nogil=True)
def _last_dim(buf):
    return _word(_word(buf + _DIMS) + 8 * (_word(buf + _RANK) - 1))


def _bits_type(dt: np.dtype):
    """The element type the kernels take for ``dt`` (16-bit floats as their bits)."""
    view = _nb._bits_view(dt)
    return np.dtype(view if view is not None else dt)


def allow_threads(allow: bool = True) -> bool:
    """Let the handlers run the parallel driver for calls of at least
    ``SERIAL_MAX_ELEMENTS`` (the backend's size rule); returns whether they will.

    Off by default: inside a jax computation XLA's own thread pool holds the
    cores, and an OpenMP team launched beside it waited on descheduled threads:
    medians of 4-40 ms for (64..256, 4096) float32 calls that take 0.06-0.6 ms
    serially (2 shared cores, ``bench/jax_jit.py``).  Only on a threading layer
    that takes concurrent launches (``omp``, ``tbb``; the handlers have no
    launch lock); the serial and parallel drivers give the same bits.
    """
    import numba

    if allow:
        k = _nb._k()
        x = np.zeros((2, 8), np.float32)
        _nb._launch_parallel(k.forward_parallel, x, None, np.ones(8, np.float32), None,
                             np.empty_like(x), None, np.empty(2, np.float32), 0, 8, 1e-6,
                             0.0, None)
        allow = numba.threading_layer() in ("omp", "tbb")
    _STATE[0] = int(allow)
    return allow


def sync_fork_state() -> None:
    """Copy the backend's fork flag where the handlers read it (a child forked after an
    OpenMP launch runs the serial driver, as the backend does)."""
    _STATE[1] = int(_nb._forked_after_omp)


if hasattr(os, "register_at_fork"):
    # after the backend's own hook, registered when it was imported (above)
    os.register_at_fork(after_in_child=sync_fork_state)


@functools.cache
def handler(x_dtype: str, y_dtype: str, compute_dtype: str, has_bias: bool) -> int:
    """The address of the compiled handler for these dtypes (see the module)."""
    from polynorm.core.dtypes import numpy_dtype

    sync_fork_state()
    k = _nb._k()
    xt = _bits_type(numpy_dtype(x_dtype))
    yt = _bits_type(numpy_dtype(y_dtype))
    ct = numpy_dtype(compute_dtype)
    bits = xt.itemsize == 2
    rows = k.forward_bits_rows if bits else k.forward_rows
    par = k.forward_bits_parallel if bits else k.forward_parallel
    serial_max = _nb.SERIAL_MAX_ELEMENTS
    xsize, ysize, csize = xt.itemsize, yt.itemsize, ct.itemsize
    state_addr = _STATE.ctypes.data

    def run(frame):
        f = _address(frame)
        ext = _word(f + _EXT)
        if ext != 0 and _int32(ext + 8) == _METADATA:
            md = _word(ext + 24)  # XLA_FFI_Metadata*: api_version {size, ext, major, minor}
            _put_int32(md + 24, 0)
            _put_int32(md + 28, 1)
            _put_int32(md + 32, 0)  # traits
            return _pointer(0)
        if _int32(f + _STAGE) != _EXECUTE:
            return _pointer(0)
        args = _word(f + _ARGS_PTRS)
        rets = _word(f + _RETS_PTRS)
        attrs = _word(f + _ATTRS_PTRS)
        xb, wb, yb = _word(args), _word(args + 8), _word(rets)
        d = _last_dim(xb)
        rx, bw, ry = _rows(xb), _rows(wb), _rows(yb)
        if ry == 0:
            return _pointer(0)
        bb = _rows(_word(args + 16)) if has_bias else 1
        # attributes (XLA_FFI_Scalar {dtype, value*}), by name
        flags = _word(_word(_word(attrs) + 8))
        kk = _word(_word(_word(attrs + 8) + 8))
        eps = _double(_word(_word(attrs + 16) + 8))
        offset = _double(_word(_word(attrs + 24) + 8))
        state = carray(_pointer(state_addr), (2,), np.int64)
        threads_ok = state[0] != 0 and state[1] == 0
        # under vmap ("expand_dims") every batched operand leads with the batch axis:
        # batch element i is rows [i*c, (i+1)*c) of y, of x where x is batched (else
        # all of x), and row i of a batched weight or bias
        nb = max(bw, bb, ry // rx)
        c = ry // nb
        xd, wd, yd = _word(xb + _DATA), _word(wb + _DATA), _word(yb + _DATA)
        rd = _word(_word(rets + 8) + _DATA)
        bd = _word(_word(args + 16) + _DATA) if has_bias else 0
        for i in range(nb):
            x = carray(_pointer(xd + (i * c * d * xsize if rx == ry else 0)), (c, d), xt)
            w = carray(_pointer(wd + (i * d * csize if bw > 1 else 0)), (d,), ct)
            y = carray(_pointer(yd + i * c * d * ysize), (c, d), yt)
            rstd = carray(_pointer(rd + i * c * csize), (c,), ct)
            parallel = threads_ok and c >= 2 and c * d >= serial_max
            if has_bias:
                b = carray(_pointer(bd + (i * d * csize if bb > 1 else 0)), (d,), ct)
                if parallel:
                    par(x, None, w, b, y, None, rstd, flags, kk, eps, offset, None)
                else:
                    rows(0, c, x, None, w, b, y, None, rstd, flags, kk, eps, offset, None)
            elif parallel:
                par(x, None, w, None, y, None, rstd, flags, kk, eps, offset, None)
            else:
                rows(0, c, x, None, w, None, y, None, rstd, flags, kk, eps, offset, None)
        return _pointer(0)

    fn = cfunc(types.voidptr(types.voidptr), nogil=True, error_model="numpy")(run)
    _keep.append(fn)
    return fn.address


_keep: list = []  # the compiled handlers stay alive with the process
