"""float16 / bfloat16 bit codecs for the Numba kernels.

Numba cannot take float16 arrays on the CPU, and numpy has no bfloat16, so
the kernels see ``uint16`` views and convert each element here, in
registers: no float32 copy of the data is ever made.  All conversions are
exact where the value is representable and round to nearest even otherwise;
subnormals, infinities and NaN are handled (a NaN stays a NaN of the same
sign; its payload is not kept).

The functions are branch-light (selects, not jumps) so that LLVM can
vectorize the loops that call them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# --------------------------------------------------------------------------- bit casts


@intrinsic
def _u32_as_f32(typingctx, v):
    # Numba widens integer arithmetic to 64 bits: take the low 32 bits.
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        a = args[0]
        if v.bitwidth > 32:
            a = builder.trunc(a, ir.IntType(32))
        return builder.bitcast(a, ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def _f32_as_u32(typingctx, v):
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(v), codegen


@intrinsic
def _f64_as_u64(typingctx, v):
    if v != types.float64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.uint64(v), codegen


@intrinsic
def _u64_as_f64(typingctx, v):
    if not isinstance(v, types.Integer) or v.bitwidth != 64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(v), codegen


_jit = njit(nogil=True)

# --------------------------------------------------------------------------- decode


@_jit
def _bf16_to_f32_sw(b):
    """bfloat16 bits -> float32 (exact: bfloat16 is float32's top half)."""
    return _u32_as_f32(np.uint32(b) << np.uint32(16))


@_jit
def _f16_to_f32_sw(b):
    """float16 bits -> float32, exact for every pattern (F. Giesen's method)."""
    h = np.uint32(b)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    o = (h & np.uint32(0x7FFF)) << np.uint32(13)
    exp = o & np.uint32(0x0F800000)
    o = o + np.uint32((127 - 15) << 23)
    # Inf/NaN: move the exponent to float32's all-ones
    o_inf = o + np.uint32((128 - 16) << 23)
    # subnormal: renormalize through one exact float subtraction
    o_sub = _f32_as_u32(
        _u32_as_f32(o + np.uint32(1 << 23)) - _u32_as_f32(np.uint32(113 << 23))
    )
    o = o_inf if exp == np.uint32(0x0F800000) else (o_sub if exp == np.uint32(0) else o)
    return _u32_as_f32(o | sign)


# --------------------------------------------------------------------------- encode


@_jit
def _f32_to_bf16_sw(f):
    """float32 -> bfloat16 bits, round to nearest even."""
    u = _f32_as_u32(f)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    q = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.uint16(q if nan else r)


@_jit
def _f32_to_f16_sw(f):
    """float32 -> float16 bits, round to nearest even (F. Giesen's method)."""
    u = _f32_as_u32(f)
    sign = u & np.uint32(0x80000000)
    u = u ^ sign
    # overflow (and Inf) -> Inf, NaN -> quiet NaN
    big = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    # subnormal result: let the FPU round by adding a magic number
    magic = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)
    sub = _f32_as_u32(_u32_as_f32(u) + _u32_as_f32(magic)) - magic
    # normal: rebias the exponent and round the 13 dropped bits to even
    odd = (u >> np.uint32(13)) & np.uint32(1)
    nrm = (u + np.uint32(((15 - 127) << 23) + 0xFFF) + odd) >> np.uint32(13)
    o = big if u >= np.uint32((127 + 16) << 23) else (sub if u < np.uint32(113 << 23) else nrm)
    return np.uint16(o | (sign >> np.uint32(16)))


# --------------------------------------------------------------------------- fast versions
# The same conversions written as LLVM IR on 32-bit integers (Numba widens
# integer arithmetic to 64 bits, which keeps LLVM from vectorizing the
# software versions above), and float16 through LLVM's own ``half`` type,
# which becomes the F16C instructions (vcvtph2ps / vcvtps2ph, round to
# nearest even) on x86 and native conversions on aarch64.  Where neither is
# known to exist the software versions are used: an LLVM ``half`` conversion
# could otherwise turn into a runtime-library call the JIT cannot resolve.


def _hw_half() -> bool:
    import platform

    from llvmlite import binding

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine in ("x86_64", "amd64"):
        try:
            return bool(binding.get_host_cpu_features().get("f16c", False))
        except Exception:  # pragma: no cover - feature query unsupported
            return False
    return False  # pragma: no cover


HW_HALF = _hw_half()
_I16, _I32 = ir.IntType(16), ir.IntType(32)


def _as_i16(builder, v, ty):
    return builder.trunc(v, _I16) if ty.bitwidth > 16 else v


@intrinsic
def _bf16_to_f32_ir(typingctx, b):
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        u = builder.zext(_as_i16(builder, args[0], b), _I32)
        return builder.bitcast(builder.shl(u, ir.Constant(_I32, 16)), ir.FloatType())

    return types.float32(b), codegen


@intrinsic
def _f32_to_bf16_ir(typingctx, f):
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        c = lambda v: ir.Constant(_I32, v)  # noqa: E731
        u = builder.bitcast(args[0], _I32)
        lsb = builder.and_(builder.lshr(u, c(16)), c(1))
        r = builder.lshr(builder.add(builder.add(u, c(0x7FFF)), lsb), c(16))
        nan = builder.icmp_unsigned(">", builder.and_(u, c(0x7FFFFFFF)), c(0x7F800000))
        q = builder.or_(builder.lshr(u, c(16)), c(0x40))
        return builder.trunc(builder.select(nan, q, r), _I16)

    return types.uint16(f), codegen


@intrinsic
def _f16_to_f32_hw(typingctx, b):
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        h = builder.bitcast(_as_i16(builder, args[0], b), ir.HalfType())
        return builder.fpext(h, ir.FloatType())

    return types.float32(b), codegen


@intrinsic
def _f32_to_f16_hw(typingctx, f):
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return types.uint16(f), codegen


bf16_to_f32 = _bf16_to_f32_ir
f32_to_bf16 = _f32_to_bf16_ir
f16_to_f32 = _f16_to_f32_hw if HW_HALF else _f16_to_f32_sw
f32_to_f16 = _f32_to_f16_hw if HW_HALF else _f32_to_f16_sw


@_jit
def f64_to_f32_odd(v):
    """float64 -> float32 rounded to odd.

    Rounding to odd first and then to nearest even in a format at least two
    bits narrower gives the correctly rounded result, which a plain double
    rounding through float32 does not.
    """
    r = np.float32(v)
    u = _f32_as_u32(r)
    if np.float64(r) != v and v == v:
        if abs(np.float64(r)) > abs(v):
            u = u - np.uint32(1)  # toward zero: the magnitude is in the low bits
        u = u | np.uint32(1)
    return _u32_as_f32(u)


@_jit
def f64_to_f16(v):
    """float64 -> float16 bits, correctly rounded."""
    return f32_to_f16(f64_to_f32_odd(v))


@_jit
def f64_to_bf16(v):
    """float64 -> bfloat16 bits, correctly rounded."""
    return f32_to_bf16(f64_to_f32_odd(v))


# --------------------------------------------------------------------------- generic helpers
# Kernels are written once for every element type; these overloads pick the
# conversion from the Numba type of the argument at compile time.  ``bfloat``
# is a runtime flag telling the two 16-bit formats apart (both are uint16).


def load(v, bfloat):  # pragma: no cover - replaced by the overload
    """Stored element -> compute value (float32, or float64 for float64)."""
    raise NotImplementedError


@overload(load)
def _ov_load(v, bfloat):
    if isinstance(v, types.Integer):
        return lambda v, bfloat: bf16_to_f32(v) if bfloat else f16_to_f32(v)
    if v == types.float32:
        return lambda v, bfloat: v
    if v == types.float64:
        return lambda v, bfloat: v
    return None


def store(a, i, v, bfloat):  # pragma: no cover - replaced by the overload
    """``a[i] = v`` rounded once (to nearest even) to ``a``'s element type."""
    raise NotImplementedError


@overload(store)
def _ov_store(a, i, v, bfloat):
    dt = a.dtype
    if isinstance(dt, types.Integer):
        if v == types.float64:
            def impl(a, i, v, bfloat):
                a[i] = f64_to_bf16(v) if bfloat else f64_to_f16(v)
        else:
            def impl(a, i, v, bfloat):
                a[i] = f32_to_bf16(v) if bfloat else f32_to_f16(v)
        return impl
    if dt == types.float32:
        def impl(a, i, v, bfloat):
            a[i] = np.float32(v)
        return impl
    if dt == types.float64:
        def impl(a, i, v, bfloat):
            a[i] = np.float64(v)
        return impl
    return None


#: Runtime format codes for :func:`round_to` (llama casting).
F16, BF16, F32, F64 = 0, 1, 2, 3


def round_to(v, code):  # pragma: no cover - replaced by the overload
    """``v`` rounded to the format ``code`` and returned in ``v``'s own type."""
    raise NotImplementedError


@overload(round_to)
def _ov_round_to(v, code):
    if v == types.float32:
        def impl(v, code):
            if code == 0:
                return f16_to_f32(f32_to_f16(v))
            if code == 1:
                return bf16_to_f32(f32_to_bf16(v))
            return v
        return impl
    if v == types.float64:
        def impl(v, code):
            if code == 0:
                return np.float64(f16_to_f32(f64_to_f16(v)))
            if code == 1:
                return np.float64(bf16_to_f32(f64_to_bf16(v)))
            if code == 2:
                return np.float64(np.float32(v))
            return v
        return impl
    return None


# --------------------------------------------------------------------------- array helpers (tests, tools)


@njit(nogil=True)
def decode_array(bits, bfloat):
    """Decode a 1-D uint16 array to float32.

    >>> import numpy as np
    >>> decode_array(np.array([0x3C00, 0x0001], np.uint16), False)
    array([1.0000000e+00, 5.9604645e-08], dtype=float32)
    """
    out = np.empty(bits.shape[0], np.float32)
    for i in range(bits.shape[0]):
        out[i] = load(bits[i], bfloat)
    return out


@njit(nogil=True)
def encode_array(values, bfloat):
    """Encode a 1-D float32 or float64 array to uint16 bits, rounding to nearest even.

    >>> import numpy as np
    >>> encode_array(np.array([1.0, 65520.0], np.float32), False)
    array([15360, 31744], dtype=uint16)
    """
    out = np.empty(values.shape[0], np.uint16)
    for i in range(values.shape[0]):
        store(out, i, values[i], bfloat)
    return out


# --------------------------------------------------------------------------- prefetch


@intrinsic
def prefetch_row(typingctx, a, i):
    """Ask for row ``a[i, :]`` to be brought into L2 (``llvm.prefetch``, a hint).

    Issued before a row's compute-bound pass so that the next row's memory
    traffic overlaps it instead of following it.
    """
    if not isinstance(a, types.Array) or a.ndim != 2:
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        shape = cgutils.unpack_tuple(builder, ary.shape)
        strides = cgutils.unpack_tuple(builder, ary.strides)
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        base = builder.ptrtoint(ary.data, i64)
        row = builder.add(base, builder.mul(args[1], strides[0]))
        step = builder.mul(strides[1], ir.Constant(i64, 1))
        nbytes = builder.mul(shape[1], step)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # one prefetch per 64-byte line (contiguous rows; a strided row is only hinted)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, 64),
                                     intp=i64) as (off, _):
            addr = builder.inttoptr(builder.add(row, off), ir.IntType(8).as_pointer())
            builder.call(fn, [addr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(a, i), codegen
