"""float16 / bfloat16 bit codecs for the Numba kernels.

Numba cannot take float16 arrays on the CPU, and numpy has no bfloat16, so
the kernels see ``uint16`` views and convert each element here, in
registers: no float32 copy of the data is ever made.  All conversions are
exact where the value is representable and round to nearest even otherwise;
subnormals, infinities and NaN are handled.  A NaN stays a NaN of the same
sign, made quiet, with the top bits of its payload that fit (what the
hardware conversions do: F16C's ``vcvtps2ph``/``vcvtph2ps``; the software
float16 codec, used where the CPU has no F16C, gives the same bits).

The functions are branch-light (selects, not jumps) so that LLVM can
vectorize the loops that call them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

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


# numpy error model: see numba.kernels.ERROR_MODEL (no exception can leave a kernel)
_jit = njit(nogil=True, error_model="numpy")

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
    # a NaN comes out quiet, as from vcvtph2ps
    o_inf = o_inf | (np.uint32(0x400000) if (h & np.uint32(0x3FF)) != np.uint32(0) else np.uint32(0))
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
    # overflow (and Inf) -> Inf, NaN -> quiet NaN with the payload's top bits (as vcvtps2ph)
    qnan = np.uint32(0x7E00) | ((u >> np.uint32(13)) & np.uint32(0x3FF))
    big = qnan if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
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


def round_bf16_ir(builder, f, nan_guard=True):
    """float32 ``f`` (a scalar or a vector) rounded to bfloat16 in the top half of
    its ``i32`` bits (the low half is garbage): :func:`_f32_to_bf16_sw`'s bits in
    fewer vector operations.  The rounding bias (0x7FFF, or 0x8000 when the kept
    part is odd) is a select on a bit test; the NaN guard an unordered float
    compare, NaN and number merged before the caller's shift.  ``nan_guard=False``
    leaves the guard out, for values known to hold no NaN (an Inf rounds right
    without it): 4 vector operations per 8 lanes on AVX2 instead of 7."""
    i32 = like(f, _I32)

    def c(v):
        return splat(i32, v)

    u = builder.bitcast(f, i32)
    odd = builder.icmp_unsigned("!=", builder.and_(u, c(0x10000)), c(0))
    r = builder.add(u, builder.select(odd, c(0x8000), c(0x7FFF)))
    if nan_guard:
        nan = builder.fcmp_unordered("uno", f, f)
        q = builder.or_(u, c(0x400000))  # quiet, top of the payload kept: (u >> 16) | 0x40
        r = builder.select(nan, q, r)
    return r


def encode_bf16_ir(builder, f, nan_guard=True):
    """bfloat16 bits (``i16``, or a vector of them) of float32 ``f``: :func:`round_bf16_ir`
    and the shift."""
    r = round_bf16_ir(builder, f, nan_guard)
    return builder.trunc(builder.lshr(r, splat(r.type, 16)), like(f, _I16))


@intrinsic
def _f32_to_bf16_ir(typingctx, f):
    if f != types.float32:
        return None

    # Per 16 lanes LLVM emits vptestnmd, vpblendmd, vpaddd, vcmpunordps,
    # masked vpord, vpsrld, vpmovdw on AVX-512, 9 per 8 lanes on AVX2
    # (bench/asm.py counts them).
    def codegen(context, builder, sig, args):
        return encode_bf16_ir(builder, args[0])

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


# --------------------------------------------------------------------------- the bits' format
# The kernels take 16-bit floats as integer views whose TYPE says the format:
# ``uint16`` bits are bfloat16, ``int16`` bits float16.  The format is then a
# compile-time constant of each kernel (one specialisation per dtype, as for
# float32/float64): a runtime flag made LLVM keep a branch per array per
# vector in the inner loops and not unroll them (16384x4096 bfloat16
# backward: 2x the instructions).


def bits_dtype(dt) -> bool:
    """Whether Numba dtype ``dt`` is 16-bit float bits (typing-time helper)."""
    return dt in (types.uint16, types.int16)


# --------------------------------------------------------------------------- generic helpers
# Kernels are written once for every element type; these overloads pick the
# conversion from the Numba type of the argument at compile time.  The two
# 16-bit formats travel as bits of distinct types: bfloat16 as uint16,
# float16 as int16, so the format too is a compile-time constant.


def load(v):  # pragma: no cover - replaced by the overload
    """Stored element -> compute value (float32, or float64 for float64).

    16-bit bits decode by their type (``uint16``: bfloat16, ``int16``:
    float16), so the format is a compile-time constant.
    """
    raise NotImplementedError


@overload(load)
def _ov_load(v):
    if v == types.uint16:
        return lambda v: bf16_to_f32(v)
    if v == types.int16:
        return lambda v: f16_to_f32(v)
    if v == types.float32:
        return lambda v: v
    if v == types.float64:
        return lambda v: v
    return None


def store(a, i, v):  # pragma: no cover - replaced by the overload
    """``a[i] = v`` rounded once (to nearest even) to ``a``'s element type
    (for 16-bit bits, the format of :func:`load`: by the array's type)."""
    raise NotImplementedError


@overload(store)
def _ov_store(a, i, v):
    dt = a.dtype
    if bits_dtype(dt):
        bf = dt == types.uint16
        if v == types.float64:
            def impl(a, i, v):
                a[i] = f64_to_bf16(v) if bf else f64_to_f16(v)
        else:
            def impl(a, i, v):
                a[i] = f32_to_bf16(v) if bf else f32_to_f16(v)
        return impl
    if dt == types.float32:
        def impl(a, i, v):
            a[i] = np.float32(v)
        return impl
    if dt == types.float64:
        def impl(a, i, v):
            a[i] = np.float64(v)
        return impl
    return None


#: Runtime format codes of :func:`round_to` (llama casting), by dtype name; the
#: kernels' flag words carry them (``polynorm.backends.numba._llama_codes``).
FORMAT_CODE = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
_F16, _BF16, _F32 = FORMAT_CODE["float16"], FORMAT_CODE["bfloat16"], FORMAT_CODE["float32"]


def round_to(v, code):  # pragma: no cover - replaced by the overload
    """``v`` rounded to the format ``code`` and returned in ``v``'s own type."""
    raise NotImplementedError


@overload(round_to)
def _ov_round_to(v, code):
    if v == types.float32:
        def impl(v, code):
            if code == _F16:
                return f16_to_f32(f32_to_f16(v))
            if code == _BF16:
                return bf16_to_f32(f32_to_bf16(v))
            return v
        return impl
    if v == types.float64:
        def impl(v, code):
            if code == _F16:
                return np.float64(f16_to_f32(f64_to_f16(v)))
            if code == _BF16:
                return np.float64(bf16_to_f32(f64_to_bf16(v)))
            if code == _F32:
                return np.float64(np.float32(v))
            return v
        return impl
    return None


# --------------------------------------------------------------------------- array helpers (tests, tools)


@njit(nogil=True, error_model="numpy")
def _decode(bits):
    out = np.empty(bits.shape[0], np.float32)
    for i in range(bits.shape[0]):
        out[i] = load(bits[i])
    return out


@njit(nogil=True, error_model="numpy")
def _encode(values, out):
    for i in range(values.shape[0]):
        store(out, i, values[i])


def decode_array(bits, bfloat):
    """Decode a 1-D array of 16-bit float bits to float32 (``bfloat``: bfloat16, else float16).

    >>> import numpy as np
    >>> decode_array(np.array([0x3C00, 0x0001], np.uint16), False)
    array([1.0000000e+00, 5.9604645e-08], dtype=float32)
    """
    return _decode(bits.view(np.uint16 if bfloat else np.int16))


def encode_array(values, bfloat):
    """Encode a 1-D float32 or float64 array to uint16 bits, rounding to nearest even.

    >>> import numpy as np
    >>> encode_array(np.array([1.0, 65520.0], np.float32), False)
    array([15360, 31744], dtype=uint16)
    """
    out = np.empty(values.shape[0], np.uint16)
    _encode(values, out.view(np.uint16 if bfloat else np.int16))
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



# --------------------------------------------------------------------------- sums of squares in lanes
# A row's sum of squares in an order fixed by this code, not by the optimizer:
# element j goes to lane ``j % SUM_LANES``; each block of SUM_BLOCK elements is
# summed per lane in float32 (SUM_GROUPS vectors; exact squares for 16-bit
# input, one rounding each for float32), the block's lanes are added to float64
# lanes, and the float64 lanes are added in a fixed tree at the end.  No
# fast-math flag touches these operations, so every loop that calls these
# intrinsics in the same sequence (a row on its own, or a row pipelined under
# the previous row's output pass) gets the same bits.  float64 input is summed
# in float64 lanes directly.  A float32 partial that overflows or loses bits
# is caught by the caller (an Inf/NaN total, or one below 2**-100, sends the
# row to the scaled float64 path; see ``numba.kernels``).

SUM_LANES = 16
SUM_GROUPS = 8
SUM_BLOCK = SUM_LANES * SUM_GROUPS

_F32T, _F64T, _I64 = ir.FloatType(), ir.DoubleType(), ir.IntType(64)
_VD = ir.VectorType(_F64T, SUM_LANES)
_VF = ir.VectorType(_F32T, SUM_LANES)
_VI1 = ir.VectorType(ir.IntType(1), SUM_LANES)


def host_has(feature: str) -> bool:
    """Whether the host CPU has LLVM feature ``feature`` (e.g. ``"avx512f"``)."""
    from llvmlite import binding

    try:
        return bool(binding.get_host_cpu_features().get(feature, False))
    except Exception:  # pragma: no cover - feature query unsupported
        return False


#: llvm.fma where the CPU has it; elsewhere an fmul + fadd (a libm call would be slow)
_HAS_FMA = host_has("fma")


def splat(ty, value):
    """The LLVM constant ``value`` of type ``ty``: a scalar, or every lane of a vector."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)
    return ir.Constant(ty, value)


def like(v, elt):
    """``v``'s shape (scalar, or a vector of as many lanes) with element type ``elt``."""
    return ir.VectorType(elt, v.type.count) if isinstance(v.type, ir.VectorType) else elt


def item_pointer(context, builder, aty, aval, indices):
    """Pointer to ``a[indices]`` (intp values; no wraparound, no bounds check)."""
    ary = context.make_array(aty)(context, builder, aval)
    return cgutils.get_item_pointer2(context, builder, ary.data,
                                     cgutils.unpack_tuple(builder, ary.shape),
                                     cgutils.unpack_tuple(builder, ary.strides),
                                     aty.layout, indices)


def decode_lanes(builder, bits, dt):
    """Float32 lanes of a vector loaded from an array of Numba dtype ``dt``: float32
    as is, 16-bit float bits decoded as :func:`load` decodes them one at a time
    (``uint16`` bfloat16; ``int16`` float16, only where :data:`HW_HALF`)."""
    n = bits.type.count
    if dt == types.float32:
        return bits
    if dt == types.uint16:
        i32v = ir.VectorType(_I32, n)
        return builder.bitcast(builder.shl(builder.zext(bits, i32v), splat(i32v, 16)),
                               ir.VectorType(ir.FloatType(), n))
    assert dt == types.int16 and HW_HALF
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n)),
                         ir.VectorType(ir.FloatType(), n))


def fma_ir(builder, a, b, d):
    """``a * b + d`` rounded once (``llvm.fma``) on float32 scalars or vectors; where the
    CPU has no FMA an fmul and an fadd (the same bits only where ``a * b`` is exact)."""
    if not _HAS_FMA:
        return builder.fadd(builder.fmul(a, b), d)
    ty = a.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3), name)
    return builder.call(fn, [a, b, d])


class SumLanes(types.Type):
    """Numba type of the float64 lanes: an LLVM ``<SUM_LANES x double>`` value."""

    def __init__(self):
        super().__init__(name=f"SumLanes{SUM_LANES}")


sum_lanes = SumLanes()


@register_model(SumLanes)
class _SumLanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VD)


@intrinsic
def lanes_zero(typingctx):
    """float64 lanes, all zero."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VD, [0.0] * SUM_LANES)

    return sum_lanes(), codegen


def _row_at(context, builder, aty, aval, i, j):
    """``(address of a[i, j] as i64, byte stride between a row's elements)``."""
    ary = context.make_array(aty)(context, builder, aval)
    shape = cgutils.unpack_tuple(builder, ary.shape)
    strides = cgutils.unpack_tuple(builder, ary.strides)
    ptr = cgutils.get_item_pointer2(context, builder, ary.data, shape, strides, aty.layout, [i, j])
    return builder.ptrtoint(ptr, _I64), strides[1]


def _vname(elt) -> str:
    return f"i{elt.width}" if isinstance(elt, ir.IntType) else ("f32" if elt == _F32T else "f64")


def _vec_load(builder, elt, size, base, stride, first, count, contiguous):
    """Elements ``first .. first + SUM_LANES - 1`` after ``base`` as one vector; with
    ``count``, lanes at or past it are 0 (and not read)."""
    vty = ir.VectorType(elt, SUM_LANES)
    zero_e = ir.Constant(elt, 0 if isinstance(elt, ir.IntType) else 0.0)
    zero = ir.Constant(vty, [zero_e.constant] * SUM_LANES)
    if contiguous:
        p = builder.inttoptr(builder.add(base, ir.Constant(_I64, first * size)), vty.as_pointer())
        if count is None:
            return builder.load(p, align=size)
        lanes = ir.Constant(ir.VectorType(_I64, SUM_LANES), list(range(first, first + SUM_LANES)))
        cnt = builder.insert_element(ir.Constant(ir.VectorType(_I64, SUM_LANES), ir.Undefined),
                                     count, ir.Constant(_I32, 0))
        cnt = builder.shuffle_vector(cnt, cnt, ir.Constant(ir.VectorType(_I32, SUM_LANES),
                                                           [0] * SUM_LANES))
        mask = builder.icmp_signed("<", lanes, cnt)
        fnty = ir.FunctionType(vty, [vty.as_pointer(), _I32, _VI1, vty])
        fn = cgutils.get_or_insert_function(
            builder.module, fnty, f"llvm.masked.load.v{SUM_LANES}{_vname(elt)}.p0")
        return builder.call(fn, [p, ir.Constant(_I32, size), mask, zero])
    # strided row elements (rare): one scalar load per lane, none past ``count``
    v = zero
    for lane in range(SUM_LANES):
        off = builder.mul(stride, ir.Constant(_I64, first + lane))
        p = builder.inttoptr(builder.add(base, off), elt.as_pointer())
        if count is None:
            e = builder.load(p)
        else:
            inb = builder.icmp_signed("<", ir.Constant(_I64, first + lane), count)
            with builder.if_else(inb) as (then, other):
                with then:
                    e1 = builder.load(p)
                    b1 = builder.block
                with other:
                    b2 = builder.block
            e = builder.phi(elt)
            e.add_incoming(e1, b1)
            e.add_incoming(zero_e, b2)
        v = builder.insert_element(v, e, ir.Constant(_I32, lane))
    return v


def _vec_bf16(builder, v):
    i32v = ir.VectorType(_I32, SUM_LANES)
    return builder.bitcast(builder.shl(builder.zext(v, i32v), ir.Constant(i32v, [16] * SUM_LANES)),
                           _VF)


def _vec_f16(context, builder, v):
    if HW_HALF:
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), SUM_LANES)), _VF)
    out = ir.Constant(_VF, ir.Undefined)
    for lane in range(SUM_LANES):
        e = builder.extract_element(v, ir.Constant(_I32, lane))
        f = context.compile_internal(builder, lambda b: _f16_to_f32_sw(b),
                                     types.float32(types.uint16), [e])
        out = builder.insert_element(out, f, ir.Constant(_I32, lane))
    return out


def _block_squares(builder, acc, dt, load, decode):
    """``acc`` plus one block's squares, in the documented order."""
    if dt == types.float64:
        for t in range(SUM_GROUPS):
            x = load(t)
            acc = builder.fadd(acc, builder.fmul(x, x))
        return acc
    p = ir.Constant(_VF, [0.0] * SUM_LANES)
    fma = None
    if _HAS_FMA:
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3),
                                             f"llvm.fma.v{SUM_LANES}f32")
    for t in range(SUM_GROUPS):
        x = decode(load(t))
        p = builder.call(fma, [x, x, p]) if fma else builder.fadd(builder.fmul(x, x), p)
    return builder.fadd(acc, builder.fpext(p, _VD))


def _bf16_block_squares_pairs(builder, acc, base):
    """:func:`_block_squares` of a whole contiguous bfloat16 block, read as pairs:
    each group's 16 values are one 8-lane i32 load whose low halves (shifted up)
    are the even lanes and whose high halves (masked) the odd ones.  Each lane's
    chain of fused multiply-adds is the one :func:`_block_squares` runs, so the
    float32 partial has the same bits; it is put back in lane order (one
    interleave per block) before the float64 add."""
    half = SUM_LANES // 2
    i32v, f32v = ir.VectorType(_I32, half), ir.VectorType(_F32T, half)
    pe = po = ir.Constant(f32v, [0.0] * half)
    fma = None
    if _HAS_FMA:
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32v, [f32v] * 3),
                                             f"llvm.fma.v{half}f32")
    for t in range(SUM_GROUPS):
        p = builder.inttoptr(builder.add(base, ir.Constant(_I64, t * SUM_LANES * 2)),
                             i32v.as_pointer())
        pairs = builder.load(p, align=2)
        e = builder.bitcast(builder.shl(pairs, splat(i32v, 16)), f32v)
        o = builder.bitcast(builder.and_(pairs, splat(i32v, -65536)), f32v)
        if fma:
            pe, po = builder.call(fma, [e, e, pe]), builder.call(fma, [o, o, po])
        else:
            pe = builder.fadd(builder.fmul(e, e), pe)
            po = builder.fadd(builder.fmul(o, o), po)
    order = [(lane // 2) + half * (lane % 2) for lane in range(SUM_LANES)]
    part = builder.shuffle_vector(pe, po, ir.Constant(ir.VectorType(_I32, SUM_LANES), order))
    return builder.fadd(acc, builder.fpext(part, _VD))


def _lanes_codegen(context, builder, sig, args, count):
    accv, av, iv, jv = args[:4]
    aty = sig.args[1]
    dt = aty.dtype
    elt = context.get_data_type(dt)
    size = context.get_abi_sizeof(elt)
    base, stride = _row_at(context, builder, aty, av, iv, jv)

    def with_layout(contiguous):
        def load(t):
            return _vec_load(builder, elt, size, base, stride, t * SUM_LANES, count, contiguous)

        if not isinstance(dt, types.Integer):
            return _block_squares(builder, accv, dt, load, lambda v: v)
        # 16-bit bits: the format is the type's (uint16 bfloat16, int16 float16)
        if dt == types.uint16:
            if contiguous and count is None:
                return _bf16_block_squares_pairs(builder, accv, base)
            return _block_squares(builder, accv, dt, load, lambda v: _vec_bf16(builder, v))
        return _block_squares(builder, accv, dt, load, lambda v: _vec_f16(context, builder, v))

    if aty.layout == "C":
        return with_layout(True)
    contig = builder.icmp_signed("==", stride, ir.Constant(_I64, size))
    with builder.if_else(contig, likely=True) as (then, other):
        with then:
            r1 = with_layout(True)
            b1 = builder.block
        with other:
            r2 = with_layout(False)
            b2 = builder.block
    r = builder.phi(_VD)
    r.add_incoming(r1, b1)
    r.add_incoming(r2, b2)
    return r


def _sum_array(a) -> bool:
    return (isinstance(a, types.Array) and a.ndim == 2
            and a.dtype in (types.float32, types.float64, types.uint16, types.int16))


@intrinsic
def lanes_add_block(typingctx, acc, a, i, j):
    """``acc`` plus the squares of ``a[i, j : j + SUM_BLOCK]`` (float, or 16-bit bits
    of the format of their type, as :func:`load` decodes them)."""
    if acc != sum_lanes or not _sum_array(a):
        return None

    def codegen(context, builder, sig, args):
        return _lanes_codegen(context, builder, sig, args, None)

    return sum_lanes(acc, a, types.intp, types.intp), codegen


@intrinsic
def lanes_add_part(typingctx, acc, a, i, j, count):
    """Like :func:`lanes_add_block` for the first ``count < SUM_BLOCK`` elements only
    (the end of a row); the missing lanes add exact zeros."""
    if acc != sum_lanes or not _sum_array(a):
        return None

    def codegen(context, builder, sig, args):
        return _lanes_codegen(context, builder, sig, args, args[4])

    return sum_lanes(acc, a, types.intp, types.intp, types.intp), codegen


@intrinsic
def lanes_total(typingctx, acc):
    """The float64 sum of the lanes: halves added lane-wise until one lane is left."""
    if acc != sum_lanes:
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        m = SUM_LANES
        while m > 1:
            h = m // 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h),
                                                          list(range(h, m))))
            v = builder.fadd(lo, hi)
            m = h
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float64(acc), codegen


@intrinsic
def prefetch_span(typingctx, a, i, j, count):
    """Ask for the lines of ``a[i, j : j + count]`` to be brought into cache (a hint).

    The pipelined forward reads the row after next this way, a chunk at a
    time, so that its DRAM traffic is spread over the current row's pass.
    """
    if not isinstance(a, types.Array) or a.ndim != 2:
        return None

    def codegen(context, builder, sig, args):
        av, iv, jv, cv = args
        base, stride = _row_at(context, builder, sig.args[0], av, iv, jv)
        nbytes = builder.mul(cv, stride)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), nbytes, ir.Constant(_I64, 64),
                                     intp=_I64) as (off, _):
            addr = builder.inttoptr(builder.add(base, off), i8p)
            builder.call(fn, [addr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(a, types.intp, types.intp, types.intp), codegen
