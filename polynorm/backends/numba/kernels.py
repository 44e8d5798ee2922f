"""The Numba kernels: forward (plain and fused add) on ``(n, d)`` rows, and the row
helpers that the backward (:mod:`.numba.backward_kernels`) shares.

Every option of the :class:`polynorm.core.options.Plan` arrives as a runtime
scalar or a bit of ``flags``, so a kernel is specialised only on the element
types and memory layouts of its arrays.  Weight and bias arrive in the
compute type (the caller converts those ``(d,)`` arrays).  In the forward an
absent residual, bias or stage is ``None`` (an absent weight is ones): each
path has its own drivers (:func:`forward_kernels`) and absent terms are
dropped at typing time (:func:`scale_shift`), so a call compiles only the
code it runs (a fresh process's first float32 call compiles one path, not
the fused add, the 16-bit pipeline and streaming besides).  The
backward takes an absent weight, rstd or grad_residual as ``None`` too (its
``is None`` branches are resolved when it is compiled); the gated backward
takes stand-ins with flag bits (one compiled kernel for every case of a
dtype).  float16 and bfloat16 arrays arrive as integer views whose type is
the format (``int16``: float16, ``uint16``: bfloat16;
``numba.codec.load``), so the format is a compile-time constant.

Numerics (see the module docstring of :mod:`polynorm.core.options`):

- float64 rows sum their squares in float64; a row whose sum overflows or
  underflows (or is zero) is recomputed scaled by its largest magnitude; on
  ordinary data this branch is never taken.
- float32 rows sum their squares in float32 partials over blocks of 512
  elements (vectorized), added in float64 (``_block_sum``): the float64
  conversions of every element cost more than the row's DRAM traffic when
  the row is in cache.  A partial that overflows (``|x| > 1.8e19``) or a sum
  below 2**-100 (float32 squares flushed to zero) takes the scaled float64
  path, so no finite row loses range.
- the forward sums 16-bit rows in lanes (float32 partials over blocks of
  128 elements -- exact squares, 8 additions each -- added into float64
  lanes, in an order fixed by the code: ``numba.codec``'s ``lanes_*``
  intrinsics); an Inf/NaN sum or one below 2**-100 takes the scaled float64
  path.  This is what lets a row's sum be accumulated during the previous
  row's output pass (the forward pipelines 16-bit rows).
- each row is reduced by one compiled function (vectorized, see ``_reduce``)
  whatever the driver or thread count, so the bits never depend on either.
- ``dweight``/``dbias`` (the backward) are summed over the row tree of
  :mod:`.rowtree`: an order fixed by the global row index, so that any split
  of the rows (threads, blocks, dask chunks) gives the same bits.

Each forward exists twice, ``*_rows`` (one thread: the serial path) and
``*_parallel`` (``prange`` over row ranges, each calling ``*_rows``), so both
paths run the same compiled row code.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from polynorm.backends.numba.codec import (
    SUM_BLOCK,
    bits_dtype,
    item_pointer,
    lanes_add_block,
    lanes_add_part,
    lanes_total,
    lanes_zero,
    load,
    prefetch_row,
    prefetch_span,
    round_bf16_ir,
    round_to,
    splat,
    store,
)
from polynorm.backends.numba.refs import borrow, row_of
from polynorm.backends.numba.stream import LINE, line_gap, stream_copy, stream_fence
from polynorm.core.cache import install_numba_locator

# --------------------------------------------------------------------------- flags

HAS_R = 1 << 0
HAS_W = 1 << 1
HAS_B = 1 << 2
EPS_INSIDE = 1 << 3
LLAMA = 1 << 4
HAS_RSTD = 1 << 5  # backward (plain and gated): rstd given
STREAM_DX = 1 << 6  # backward: dx leaves through a stage and streaming stores
HAS_GR = 1 << 7  # backward: grad_residual given (else its argument is a stand-in)
# llama rounding formats (codes of numba.codec.round_to), two bits each
XCODE_SHIFT = 16
WCODE_SHIFT = 18
PCODE_SHIFT = 20

_TINY = 2.0**-960  # a float64 sum of squares below this has lost bits


#: Every kernel and helper is compiled with numpy's error model: a float
#: division by zero gives inf/NaN as IEEE says (an all-zero row with eps=0 has
#: rstd = 1/0 = inf and a NaN output, as torch and the reference give) instead
#: of Python's ZeroDivisionError, which a kernel cannot raise cleanly (inside a
#: prange it left a SystemError and rows half written).  The checked division
#: is also a branch per division less; the quotients' bits are the same.
ERROR_MODEL = "numpy"


def _jit(**kw):
    """``njit`` with an on-disk cache (:mod:`polynorm.core.cache`) where one can be written."""
    install_numba_locator()

    def deco(fn):
        try:
            return njit(cache=True, nogil=True, error_model=ERROR_MODEL, **kw)(fn)
        except Exception:  # e.g. NUMBA_CACHE_DIR not writable: compile per process
            return njit(cache=False, nogil=True, error_model=ERROR_MODEL, **kw)(fn)

    return deco


# Row helpers: plain njit functions; LLVM inlines them into each driver.
_inline = njit(nogil=True, error_model=ERROR_MODEL)
# The fused add's row helpers are inlined by Numba itself: there LLVM's own
# inlining ran slower (bench/compare.py).  The others are plain calls: the
# kernels' arrays are borrowed (numba.refs), so a call's reference counting
# is a null test, while Numba's IR inlining types each call site anew, which
# multiplies the compile time of a first call.
_inline_ir = njit(nogil=True, inline="always", error_model=ERROR_MODEL)
# Row reductions: "reassoc" lets LLVM vectorize them (a scalar chain is
# latency-bound).  The summation order is then LLVM's (vector lanes, then a fixed
# tree), fixed in the compiled code: the same bits on every run and for every
# thread count, since each row is reduced by the same code whatever the
# driver or the number of threads.  No "nnan"/"ninf": NaN and Inf propagate.
_reduce = njit(nogil=True, fastmath={"reassoc", "contract"}, error_model=ERROR_MODEL)
# Options of an @overload compiled as a plain call (not inlined): the kernels'.
_PLAIN_CALL = {"nogil": True, "error_model": ERROR_MODEL}


def as_type_of(v, ref):  # pragma: no cover - replaced by the overload
    """``v`` converted to the type of ``ref`` (the compute type)."""
    raise NotImplementedError


@overload(as_type_of)
def _ov_like(v, ref):
    if ref == types.float32:
        return lambda v, ref: np.float32(v)
    if ref == types.float64:
        return lambda v, ref: np.float64(v)
    return None


def _absent(a) -> bool:
    return a is None or isinstance(a, types.NoneType)


def scale_shift(v, w, b, j, oc):  # pragma: no cover - replaced by the overload
    """``v * (w[j] + oc) + b[j]`` in the compute type of ``oc``; an absent
    (``None``) weight or bias drops its term (chosen at typing time).

    The drivers get ones for an absent weight
    (``polynorm.backends.numba._ones``: the same bits, and calls with and
    without a weight share a compiled variant); an absent bias is ``None``.
    """
    raise NotImplementedError


@overload(scale_shift, inline="always")
def _ov_scale_shift(v, w, b, j, oc):
    if _absent(w) and _absent(b):
        return lambda v, w, b, j, oc: v
    if _absent(b):
        return lambda v, w, b, j, oc: v * (as_type_of(w[j], oc) + oc)
    if _absent(w):
        return lambda v, w, b, j, oc: v + as_type_of(b[j], oc)
    return lambda v, w, b, j, oc: v * (as_type_of(w[j], oc) + oc) + as_type_of(b[j], oc)


#: Rows of at most this many bytes have the next row prefetched.  A longer
#: row's burst of prefetches (one per 64-byte line) stalls more than it
#: overlaps (``bench/compare.py`` measures a change of it against a commit).
_PREFETCH_MAX_BYTES = 8192
#: The backward prefetches rows of at most this many bytes before the row's
#: first pass instead of before its last: short rows gain the overlap, while
#: for longer rows the early burst evicts lines the row's own passes still need.
_PREFETCH_EARLY_BYTES = 4096


@_inline_ir
def _row_bytes(a):
    return a.shape[1] * a.itemsize


@_inline_ir
def _prefetches(a):
    return _row_bytes(a) <= _PREFETCH_MAX_BYTES


# --------------------------------------------------------------------------- row statistics


@_reduce
def _sumsq(a, i, k):
    """float64 sum of squares of ``a[i, :k]``."""
    s = 0.0
    for j in range(k):
        v = np.float64(load(a[i, j]))
        s += v * v
    return s


#: Elements per float32 partial of every row sum in blocks: the statistic and row sums
#: of :func:`_block_sum`, the backward's dot (``pairs.dot_pairs``,
#: ``backward_kernels._dot_row``) and the gated backward's; one order for all of them.
DOT_BLOCK = 512


@_reduce
def _block_sum(a, i, k, square):
    """Sum of ``a[i, :k]`` (of its squares where ``square``): partials in ``a``'s dtype
    over blocks of ``DOT_BLOCK`` elements (vectorized), added in float64.  The
    float32 forward's statistic (a partial that overflows, ``|x| > 1.8e19``, or a sum
    that has lost bits to underflow sends the row to the scaled path: :func:`_rms_rstd`),
    the backward's row dot's order, and the jitted reference's row sums
    (:func:`row_sum_rows`).  A pure reduction compiled once: a row's sum has the same
    bits wherever the row falls."""
    c = 0.0
    for b in range(np.uint64(0), np.uint64(k), np.uint64(DOT_BLOCK)):
        e = min(b + np.uint64(DOT_BLOCK), np.uint64(k))
        s = as_type_of(0.0, a[i, 0])
        if square:
            for j in range(b, e):
                s += a[i, j] * a[i, j]
        else:
            for j in range(b, e):
                s += a[i, j]
        c += np.float64(s)
    return c


@_inline
def _scaled_rms(a, i, k):
    """``sqrt(mean(a[i, :k]**2))`` scaled by the largest magnitude (no overflow).

    The non-finite rule of every Numba kernel (SPEC's formula, as torch): a NaN
    among the first ``k`` elements makes the rms NaN, else an Inf makes it Inf
    (mean of squares Inf), so rstd is 0 and ``y = x * 0``: NaN at the Inf, 0
    elsewhere.  Scaling by an Inf maximum would give ``Inf / Inf``, NaN.
    """
    m = 0.0
    for j in range(k):
        v = abs(np.float64(load(a[i, j])))
        if not v <= m:
            if v != v:
                return math.nan
            m = v
    if m == 0.0 or m == math.inf:
        return m
    s = 0.0
    for j in range(k):
        v = np.float64(load(a[i, j])) / m
        s += v * v
    return m * math.sqrt(s / k)


@_inline
def _rms_rstd(a, i, k, eps, inside, ss):
    """``(rms, rstd)`` of row ``i`` in float64 from its sum of squares ``ss``
    (the scaled, overflow-free path where ``ss`` is out of range): the one place
    eps is applied."""
    if ss < math.inf and ss >= _ss_floor(a):
        ms = ss / k
        rms = math.sqrt(ms)
        if inside:
            return rms, 1.0 / math.sqrt(ms + eps)
        return rms, 1.0 / (rms + eps)
    rms = _scaled_rms(a, i, k)
    if inside:
        return rms, 1.0 / math.hypot(rms, math.sqrt(eps))
    return rms, 1.0 / (rms + eps)


@_inline
def _stats(a, i, k, eps, inside):
    """``(rms, rstd)`` of row ``i`` from the forward's sum of squares
    (:func:`_row_sumsq`), so that a backward that recomputes rstd gets the
    forward's bits."""
    return _rms_rstd(a, i, k, eps, inside, _row_sumsq(a, i, k))


# The forward's row statistic.  16-bit rows (integer bits) are summed in lanes
# (fixed order, see the intrinsics in ``numba.codec``), so that a row summed
# on its own and a row summed under the previous row's output pass give the
# same bits, and the forward pipelines them.  float32 rows (``_block_sum``)
# and float64 rows (``_sumsq``) take two passes, which run them closer to the
# copy roof than the pipeline or the lanes do (the lanes pay for 16-bit input,
# whose decode dominates).

#: a float32-partial sum below this may have lost bits to underflow: the row
#: goes to the scaled float64 path (2**-100 keeps the error of up to 2**20
#: flushed squares, each < 2**-149, below 2**-29 of the sum)
_LANES_TINY = 2.0**-100


def _ss_floor(a):  # pragma: no cover - replaced by the overload
    """The smallest lanes sum of squares of ``a``'s rows that is taken as is."""
    raise NotImplementedError


def _sums_partials(dtype) -> bool:
    """Whether rows of the Numba ``dtype`` are summed in float32 partials (float32 rows:
    :func:`_block_sum`; 16-bit bits: the lanes), whose sums leave range below
    ``_LANES_TINY`` or by overflowing."""
    return bits_dtype(dtype) or dtype == types.float32


@overload(_ss_floor, inline="always")
def _ov_ss_floor(a):
    floor = _LANES_TINY if _sums_partials(a.dtype) else _TINY
    return lambda a: floor


@_inline  # a call: Numba's IR inliner mishandles its loop-carried lanes
def _lanes_rest(acc, a, i, k, j0):
    """Finish row ``i``'s lanes sum: the blocks from ``j0`` on, the partial block, the total."""
    kb = k - k % SUM_BLOCK
    s = acc
    for j in range(j0, kb, SUM_BLOCK):
        s = lanes_add_block(s, a, i, j)
    if kb < k:
        s = lanes_add_part(s, a, i, kb, k - kb)
    return lanes_total(s)


@_inline
def _sumsq_lanes(a, i, k):
    """Sum of squares of ``a[i, :k]`` in lanes (the forward's; fixed order)."""
    return _lanes_rest(lanes_zero(), a, i, k, np.intp(0))  # not a literal: one compile


def _row_sumsq(a, i, k):  # pragma: no cover - replaced by the overload
    """The forward's sum of squares of ``a[i, :k]``: lanes for 16-bit rows,
    ``_block_sum`` for float32 rows, else ``_sumsq``.

    Chosen at typing time, so float rows never compile the lanes code.
    """
    raise NotImplementedError


def _is_bits(a):  # pragma: no cover - replaced by the overload
    """Whether ``a`` holds 16-bit float bits (int16/uint16): a compile-time constant."""
    raise NotImplementedError


@overload(_is_bits, inline="always")
def _ov_is_bits(a):
    flag = bits_dtype(a.dtype)
    return lambda a: flag


def _partial_sums(a):  # pragma: no cover - replaced by the overload
    """:func:`_sums_partials` of ``a``'s rows: a compile-time constant."""
    raise NotImplementedError


@overload(_partial_sums, inline="always")
def _ov_partial_sums(a):
    flag = _sums_partials(a.dtype)
    return lambda a: flag


@overload(_row_sumsq, inline="always")
def _ov_row_sumsq(a, i, k):
    if bits_dtype(a.dtype):
        return lambda a, i, k: _sumsq_lanes(a, i, k)
    # the row as a (1, d) C array (row_of): one compiled reduction for every layout
    if a.dtype == types.float32:
        return lambda a, i, k: _block_sum(row_of(a, i), 0, k, True)
    return lambda a, i, k: _sumsq(row_of(a, i), 0, k)


@_inline
def _rstd_from(a, i, k, eps, inside, ss):
    """Row ``i``'s rstd in float64 from its sum ``ss`` (:func:`_rms_rstd`)."""
    return _rms_rstd(a, i, k, eps, inside, ss)[1]


# --------------------------------------------------------------------------- forward


#: Elements of the output pass between two steps of the next row's sum (a
#: multiple of SUM_BLOCK): each step reads the next row and writes this one,
#: so a row's DRAM traffic is one interleaved stream, as in a copy.  Shorter
#: chunks pay the step's overhead more often, longer ones interleave less.
_CHUNK = 512
#: The same for the next row's prefetches in a float32/float64 output pass.
_CHUNK_F = 256


@_inline
def _out_span(a, i, j0, j1, w, b, y, rc, oc):
    """``y[i, j0:j1] = a[i, j0:j1] * rstd * (w + offset) + b`` in the compute type, rounded once.

    No row views or slices (each costs Numba reference counting), and
    unsigned column indices: no negative-index wraparound in the loops, which
    keeps them vectorized.
    """
    for j in range(np.uint64(j0), np.uint64(j1)):
        store(y, (i, j), scale_shift(load(a[i, j]) * rc, w, b, j, oc))


#: columns one :func:`_bf16_out_block` call writes: one 32-byte load of bfloat16
#: x, two 8-lane float32 vectors, one 32-byte store
OUT_BLOCK = 16
assert _CHUNK % OUT_BLOCK == 0  # the pipelined pass's chunks start block-aligned
#: the row modes of :func:`_out_span_blocks`: element by element, whole blocks
#: with the NaN guard, whole blocks without it (the row can hold no NaN)
SPAN_SCALAR, SPAN_BLOCKS, SPAN_BLOCKS_NO_NAN = 0, 1, 2


def _blocks_ok(a, b, y):  # pragma: no cover - replaced by the overload
    """Whether :func:`_bf16_out_block` takes these arrays (a compile-time constant):
    bfloat16 x and y, no bias."""
    raise NotImplementedError


def _block_types_ok(a, b, y) -> bool:
    return (isinstance(a, types.Array) and isinstance(y, types.Array)
            and a.dtype == types.uint16 and y.dtype == types.uint16 and _absent(b))


@overload(_blocks_ok, inline="always")
def _ov_blocks_ok(a, b, y):
    ok = _block_types_ok(a, b, y)
    return lambda a, b, y: ok


@intrinsic
def _bf16_out_block(typingctx, a, i, j, wg, y, rc, nan_guard):
    """``y[i, j : j + OUT_BLOCK] = a[i, j:...] * rc * (w[j:...] + oc)`` rounded to
    bfloat16, as float32 vector IR: :func:`_out_span`'s operations lane by lane
    (the same bits), the rounding of :func:`.numba.codec.round_bf16_ir`
    (``nan_guard``, a literal bool: False only where no lane can be NaN).

    The block's 16 bfloat16 values are read as 8 pairs: the even columns are
    the pairs' low halves shifted up, the odd ones their high halves masked,
    and the results go back as the shifted even and the masked odd halves
    blended; ``wg`` holds ``w + oc`` in that order (:func:`_pair_weights`).
    Rows of unit column stride, ``j`` a multiple of :data:`OUT_BLOCK`; arrays
    :func:`_blocks_ok` refuses compile to nothing."""
    if not isinstance(nan_guard, types.BooleanLiteral):
        return None
    ok = (_block_types_ok(a, None, y) and isinstance(wg, types.Array)
          and wg.dtype == types.float32 and rc == types.float32)
    guard = nan_guard.literal_value

    def codegen(context, builder, sig, args):
        if not ok:
            return context.get_dummy_value()
        av, iv, jv, wv, yv, rcv, _ = args
        iv = context.cast(builder, iv, sig.args[1], types.intp)
        jv = context.cast(builder, jv, sig.args[2], types.intp)
        half = OUT_BLOCK // 2
        i32 = ir.IntType(32)
        f32v, i32v = ir.VectorType(ir.FloatType(), half), ir.VectorType(i32, half)

        def pointer(aty, aval, idx, vty):
            return builder.bitcast(item_pointer(context, builder, aty, aval, idx),
                                   vty.as_pointer())

        pairs = builder.load(pointer(sig.args[0], av, [iv, jv], i32v), align=2)
        even = builder.bitcast(builder.shl(pairs, splat(i32v, 16)), f32v)
        odd = builder.bitcast(builder.and_(pairs, splat(i32v, -65536)), f32v)
        r1 = builder.insert_element(ir.Constant(f32v, ir.Undefined), rcv, ir.Constant(i32, 0))
        r = builder.shuffle_vector(r1, r1, splat(i32v, 0))
        wp = pointer(sig.args[3], wv, [jv], f32v)
        ge = builder.load(wp, align=4)
        go = builder.load(builder.gep(wp, [ir.Constant(i32, 1)]), align=4)
        re = round_bf16_ir(builder, builder.fmul(builder.fmul(even, r), ge), guard)
        ro = round_bf16_ir(builder, builder.fmul(builder.fmul(odd, r), go), guard)
        i16v = ir.VectorType(ir.IntType(16), OUT_BLOCK)
        lo = builder.bitcast(builder.lshr(re, splat(i32v, 16)), i16v)
        hi = builder.bitcast(ro, i16v)
        blend = [t + OUT_BLOCK * (t % 2) for t in range(OUT_BLOCK)]  # even from lo, odd from hi
        out = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, OUT_BLOCK), blend))
        builder.store(out, pointer(sig.args[4], yv, [iv, jv], i16v), align=2)
        return context.get_dummy_value()

    return types.void(a, i, j, wg, y, rc, nan_guard), codegen


def _span_mode(a, b, y, wg, k, ss, rc):  # pragma: no cover - replaced by the overload
    """Row ``i``'s :func:`_out_span_blocks` mode: blocks where :func:`_blocks_ok` and
    the row range has block weights ``wg`` (:func:`_block_weights`); without the
    NaN guard where the statistic saw every element (``k == d``) and found them
    finite and rstd is finite: a product of finite numbers can overflow to Inf,
    never NaN.  Arrays :func:`_blocks_ok` refuses get SPAN_SCALAR at typing time
    (a float32 forward compiles nothing of it)."""
    raise NotImplementedError


@overload(_span_mode, inline="always")
def _ov_span_mode(a, b, y, wg, k, ss, rc):
    if not _block_types_ok(a, b, y):
        return lambda a, b, y, wg, k, ss, rc: SPAN_SCALAR

    def impl(a, b, y, wg, k, ss, rc):
        if wg.shape[0] == 0:
            return SPAN_SCALAR
        if k == a.shape[1] and ss < math.inf and rc < math.inf:
            return SPAN_BLOCKS_NO_NAN
        return SPAN_BLOCKS
    return impl


@_inline
def _out_span_blocks(a, i, j0, j1, w, b, y, rc, oc, wg, mode):
    """:func:`_out_span` with the whole :data:`OUT_BLOCK` blocks of ``[j0, j1)``
    (block-aligned ``j0``) as vectors (:func:`_bf16_out_block`) in the modes of
    :func:`_span_mode`."""
    jb = np.uint64(j0)
    if _blocks_ok(a, b, y) and mode != SPAN_SCALAR:
        step = np.uint64(OUT_BLOCK)
        jb = jb + (np.uint64(j1) - jb) // step * step
        if mode == SPAN_BLOCKS_NO_NAN:
            for j in range(np.uint64(j0), jb, step):
                _bf16_out_block(a, i, j, wg, y, rc, False)
        else:
            for j in range(np.uint64(j0), jb, step):
                _bf16_out_block(a, i, j, wg, y, rc, True)
    _out_span(a, i, jb, j1, w, b, y, rc, oc)


def _block_weights(a, w, b, y, oc):  # pragma: no cover - replaced by the overload
    """A row range's ``wg`` for :func:`_bf16_out_block`, or an empty array where the
    rows take no blocks: arrays :func:`_blocks_ok` refuses (at typing time), column
    strides other than 1, a non-finite ``w + oc``."""
    raise NotImplementedError


@overload(_block_weights, inline="always")
def _ov_block_weights(a, w, b, y, oc):
    if not _block_types_ok(a, b, y) or w.dtype != types.float32:
        return lambda a, w, b, y, oc: np.empty(0, np.float32)
    return lambda a, w, b, y, oc: _pair_weights(a, w, y, np.float32(oc))


@_inline
def _pair_weights(a, w, y, oc):
    """``w + oc`` in float32 for the whole blocks of ``w``, in :func:`_bf16_out_block`'s
    order (per block its even columns, then its odd ones), or an empty array where a
    column stride is not 1 or a ``w + oc`` is not finite (one function: each
    separately compiled helper costs every bfloat16 driver's first compile)."""
    d = a.shape[1]
    if a.strides[1] != a.itemsize or y.strides[1] != y.itemsize:
        return np.empty(0, np.float32)
    finite = True
    for j in range(d):
        finite &= abs(w[j] + oc) < math.inf
    if not finite:
        return np.empty(0, np.float32)
    half = OUT_BLOCK // 2
    wg = np.empty(d - d % OUT_BLOCK, np.float32)
    for j0 in range(0, wg.shape[0], OUT_BLOCK):
        for t in range(half):
            wg[j0 + t] = w[j0 + 2 * t] + oc
            wg[j0 + half + t] = w[j0 + 2 * t + 1] + oc
    return wg


@_inline
def _fwd_norm_row(i, hi, a, w, b, y, rstd, flags, k, eps, offset, ss, wg):
    """Row ``i`` of y from its sum ``ss`` (:func:`_row_sumsq`).

    With ``i + 1 < hi`` (16-bit rows only) row ``i + 1``'s lanes sum is
    accumulated during this row's output pass and returned; else 0.  ``wg``:
    :func:`_block_weights` of the row range.
    """
    r64 = _rstd_from(a, i, k, eps, (flags & EPS_INSIDE) != 0, ss)
    rstd[i] = r64
    rc = rstd[i]  # rstd in the compute type
    oc = as_type_of(offset, rc)
    nxt = i + 1
    if r64 < math.inf and not rc < math.inf:
        _fwd_row_wide(i, a, w, b, y, r64, oc)
        return _row_sumsq(a, nxt, k) if nxt < hi else 0.0
    mode = _span_mode(a, b, y, wg, k, ss, rc)
    return _out_and_next(i, hi, a, w, b, y, rc, oc, k, wg, mode)


def _out_and_next(i, hi, a, w, b, y, rc, oc, k, wg, mode):  # pragma: no cover
    """Row ``i``'s output pass; for 16-bit rows with ``i + 1 < hi`` it also sums
    row ``i + 1`` (returned; else 0).  Chosen at typing time, like _row_sumsq."""
    raise NotImplementedError


@overload(_out_and_next, inline="always")
def _ov_out_and_next(i, hi, a, w, b, y, rc, oc, k, wg, mode):
    if not bits_dtype(a.dtype):
        def plain(i, hi, a, w, b, y, rc, oc, k, wg, mode):
            d = a.shape[1]
            if i + 1 < a.shape[0] and not _prefetches(a):
                # long rows: the next row asked for a chunk at a time, spread
                # over this pass (a whole row's burst of prefetches stalls)
                for jc in range(0, d, _CHUNK_F):
                    n = min(_CHUNK_F, d - jc)
                    prefetch_span(a, i + 1, jc, n)
                    _out_span(a, i, jc, jc + n, w, b, y, rc, oc)
            else:
                _out_span(a, i, np.intp(0), d, w, b, y, rc, oc)  # not a literal: one compile
            return 0.0
        return plain
    return lambda i, hi, a, w, b, y, rc, oc, k, wg, mode: _out_and_next_lanes(
        i, hi, a, w, b, y, rc, oc, k, wg, mode)


@_inline  # a call: Numba's IR inliner mishandles its loop-carried lanes
def _out_and_next_lanes(i, hi, a, w, b, y, rc, oc, k, wg, mode):
    # software pipeline: row i's output pass and row i+1's sum in one loop,
    # with the row after next prefetched a chunk at a time (without it the
    # pipeline is slower than two passes).  One output loop in the pipelined
    # part and one after it: each inlines every codec and case (compile time).
    # A y that streams out takes _streamed_rows instead: its whole lines
    # leave faster from a pass of their own than beside the next row's sum.
    nxt = i + 1
    pipe = nxt < hi
    kc = k - k % _CHUNK if pipe else 0
    acc = lanes_zero()
    ahead = i + 2 < a.shape[0]
    for jc in range(0, kc, _CHUNK):
        if ahead:
            prefetch_span(a, i + 2, jc, _CHUNK)
        _out_span_blocks(a, i, jc, jc + _CHUNK, w, b, y, rc, oc, wg, mode)
        for j in range(jc, jc + _CHUNK, SUM_BLOCK):
            acc = lanes_add_block(acc, a, nxt, j)
    _out_span_blocks(a, i, kc, a.shape[1], w, b, y, rc, oc, wg, mode)
    return _lanes_rest(acc, a, nxt, k, kc) if pipe else 0.0


@_inline
def _whole_lines(y, i):
    """``(h, e)``: row ``y[i]``'s whole 64-byte lines are its columns ``[h, e)``;
    the partial lines before and after them are stored as usual."""
    d = y.shape[1]
    per_line = LINE // y.itemsize
    h = min(d, line_gap(y, i))
    return h, h + (d - h) // per_line * per_line


@_inline
def _stream_out(a, i, j0, j1, w, b, y, rc, oc, stage):
    """``y[i, j0:j1]`` (whole 64-byte lines of y) as :func:`_out_span` computes
    it, through ``stage`` and streaming stores (:mod:`.numba.stream`), a stage
    at a time; returns ``j1``.  The arrays are borrowed (``numba.refs``), so
    passing them here costs no reference count per stage."""
    c = stage.shape[1]
    for j in range(j0, j1, c):
        n = min(c, j1 - j)
        j0u = np.uint64(j)
        for t in range(np.uint64(n)):
            v = scale_shift(load(a[i, j0u + t]) * rc, w, b, j0u + t, oc)
            store(stage, (0, t), v)
        stream_copy(y, i, j, stage, n)
    return j1


@_inline_ir
def _streamed_rows(lo, hi, x, w, b, y, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of a forward (any float type) whose ``y`` leaves through
    ``stage`` and streaming stores (:mod:`.numba.stream`): the lines of
    ``y[i]`` are written whole, without being read first.  The values are
    those of :func:`_fwd_norm_row`.

    A row goes in pieces: up to its first line boundary (stored as usual),
    whole lines a stage at a time, the rest of a line (stored as usual); the
    next row is prefetched a piece at a time, as in :func:`_out_and_next`.
    ``python bench/cpu.py --stream`` times it against the ordinary stores.
    """
    d = x.shape[1]
    c = stage.shape[1]
    inside = (flags & EPS_INSIDE) != 0
    for i in range(lo, hi):
        ss = _row_sumsq(x, i, k)
        r64 = _rstd_from(x, i, k, eps, inside, ss)
        rstd[i] = r64
        rc = rstd[i]
        oc = as_type_of(offset, rc)
        if r64 < math.inf and not rc < math.inf:
            _fwd_row_wide(i, x, w, b, y, r64, oc)
            continue
        ahead = i + 1 < x.shape[0]
        h, lines_end = _whole_lines(y, i)
        if ahead:
            prefetch_span(x, i + 1, 0, h)
        _out_span(x, i, np.intp(0), h, w, b, y, rc, oc)
        for j in range(h, lines_end, c):
            n = min(c, lines_end - j)  # whole lines
            if ahead:
                prefetch_span(x, i + 1, j, n)
            _stream_out(x, i, j, j + n, w, b, y, rc, oc, stage)
        if ahead:
            prefetch_span(x, i + 1, lines_end, d - lines_end)
        _out_span(x, i, lines_end, d, w, b, y, rc, oc)
    stream_fence()


@_inline
def _fwd_row_wide(i, a, w, b, y, r64, oc):
    """A row whose rstd overflows float32 (a float32 row of rms < ~3e-39 with a
    tiny eps): xhat = (v * 2**64) * (rstd * 2**-64), both factors in range."""
    rc = as_type_of(r64 * 2.0**-64, oc)
    up = as_type_of(2.0**64, oc)
    for j in range(a.shape[1]):
        store(y, (i, j), scale_shift(load(a[i, j]) * up * rc, w, b, j, oc))


def _llama_scale(xh, w, j, off, wcode, pcode, ref):  # pragma: no cover - the overload
    """Llama's product ``round(xh * round(w[j] + off, wcode), pcode)`` in ``ref``'s
    type; ``xh`` itself without a weight (``None``).  Chosen at typing time."""
    raise NotImplementedError


@overload(_llama_scale, inline="always")
def _ov_llama_scale(xh, w, j, off, wcode, pcode, ref):
    if _absent(w):
        return lambda xh, w, j, off, wcode, pcode, ref: xh

    def scaled(xh, w, j, off, wcode, pcode, ref):
        # w holds the weight's exact values (float32/float64 arrays)
        g = round_to(np.float64(w[j]) + off, wcode)
        return as_type_of(round_to(np.float64(xh) * g, pcode), ref)

    return scaled


@_inline
def _fwd_norm_row_llama(i, a, w, b, y, rstd, flags, k, eps, offset):
    """Hugging Face Llama's order: round xhat to x's dtype, g = w + offset to
    weight's dtype, the product to promote(x, weight), add bias, round to y's."""
    d = a.shape[1]
    r64 = _rstd_from(a, i, k, eps, (flags & EPS_INSIDE) != 0, _row_sumsq(a, i, k))
    rstd[i] = r64
    rc = rstd[i]
    yi = y[i]
    xcode = (flags >> XCODE_SHIFT) & 3
    wcode = (flags >> WCODE_SHIFT) & 3
    pcode = (flags >> PCODE_SHIFT) & 3
    off = np.float64(offset)
    for j in range(d):
        xh = round_to(load(a[i, j]) * rc, xcode)
        val = _llama_scale(xh, w, j, off, wcode, pcode, rc)
        store(yi, j, scale_shift(val, None, b, j, rc))


@_inline_ir
def _add_row(i, x, r, h):
    """``h[i] = x[i] + r[i]``: summed in the compute type, rounded once to h's dtype."""
    for j in range(np.uint64(x.shape[1])):
        store(h, (i, j), load(x[i, j]) + load(r[i, j]))


@_inline_ir
def _fwd_add_row(i, x, r, w, b, y, h, rstd, flags, k, eps, offset, wg):
    """Fused add: ``h[i] = x[i] + r[i]``, then row ``i`` of y from h (its own sum)."""
    if i + 1 < x.shape[0] and _prefetches(x):
        prefetch_row(x, i + 1)
        prefetch_row(r, i + 1)
    _add_row(i, x, r, h)
    _fwd_norm_row(i, i + 1, h, w, b, y, rstd, flags, k, eps, offset, _row_sumsq(h, i, k), wg)


# Row loops, one per path, each inlined by Numba into its serial driver (below):
# a separately compiled level costs LLVM a re-optimisation of all it links, and
# an inline="always" overload is compiled in full anyway (to resolve its
# signature) before it is typed again at its call site.


@_inline_ir
def _add_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset):
    wg = _block_weights(h, w, b, y, offset)
    for i in range(lo, hi):
        _fwd_add_row(i, x, r, w, b, y, h, rstd, flags, k, eps, offset, wg)


@_inline_ir
def _bits_rows(lo, hi, x, w, b, y, rstd, flags, k, eps, offset):
    # 16-bit rows: pipelined (see _out_and_next)
    ss = _row_sumsq(x, lo, k) if lo < hi else 0.0
    wg = _block_weights(x, w, b, y, offset)
    for i in range(lo, hi):
        ss = _fwd_norm_row(i, hi, x, w, b, y, rstd, flags, k, eps, offset, ss, wg)


#: the ``wg`` of rows that take no output blocks (:func:`_block_weights`)
_NO_BLOCKS = np.empty(0, np.float32)


@_inline_ir
def _plain_rows(lo, hi, x, w, b, y, rstd, flags, k, eps, offset):
    for i in range(lo, hi):
        ss = _row_sumsq(x, i, k)
        if i + 1 < x.shape[0] and _prefetches(x):
            # the next row's reads overlap this row's output pass
            prefetch_row(x, i + 1)
        _fwd_norm_row(i, i + 1, x, w, b, y, rstd, flags, k, eps, offset, ss, _NO_BLOCKS)


def _llama_path(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset):  # pragma: no cover
    """Rows ``[lo, hi)`` in llama casting, with the fused add where ``r`` is an array."""
    raise NotImplementedError


@overload(_llama_path, jit_options=_PLAIN_CALL)
def _ov_llama_path(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset):
    if _absent(r):
        def plain(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset):
            for i in range(lo, hi):
                _fwd_norm_row_llama(i, x, w, b, y, rstd, flags, k, eps, offset)
        return plain

    def added(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset):
        for i in range(lo, hi):
            _add_row(i, x, r, h)
            _fwd_norm_row_llama(i, h, w, b, y, rstd, flags, k, eps, offset)
    return added


def _none_or(fn, doc: str):
    """A jitted ``a -> fn(a)`` that maps ``None`` to ``None`` (chosen at typing time)."""

    def apply(a):  # pragma: no cover - replaced by the overload
        raise NotImplementedError

    apply.__doc__ = doc

    @overload(apply, inline="always")
    def _ov(a):
        if _absent(a):
            return lambda a: None
        return lambda a: fn(a)

    return apply


_own_stage = _none_or(np.empty_like, "A stage of the same shape for one parallel task.")


_borrow_opt = _none_or(borrow, ":func:`borrow` of an array.")


# Forward drivers.  x, r, y, h: (n, d) (integer bits for 16-bit floats); w, b:
# (d,) in the compute type (float64 for llama weights wider than it), w ones
# where absent (polynorm.backends.numba._ones); b, r, h: None where absent.
# ``*_rows`` does rows [lo, hi) on one thread and is the serial path; its
# parallel driver only splits the rows and calls it, so the row code is
# compiled once (the parallel driver compiles in a fraction of the time) and
# the two paths give the same bits by construction.

#: The parallel driver splits the rows into ranges of n/64 rows, at most
#: this many: a range is pipelined from its first row to its last, so ranges
#: are long, yet many enough to share among the threads.  (The split depends
#: on n only; the bits do not depend on it anyway.)
_MAX_RANGE_ROWS = 256


@_inline
def _range_rows(n):
    return max(1, min(_MAX_RANGE_ROWS, n // 64))


@_inline
def _range_count(n):
    """How many row ranges the parallel drivers split ``n`` rows into."""
    return (n + _range_rows(n) - 1) // _range_rows(n)


@_inline
def _range_bounds(c, n):
    """Rows ``[lo, hi)`` of range ``c`` of :func:`_range_count`'s split of ``n`` rows."""
    lo = c * _range_rows(n)
    return lo, min(n, lo + _range_rows(n))


@_inline_ir
def _borrowed(x, r, w, b, y, h, rstd, stage):
    """The drivers' arrays borrowed (:mod:`.numba.refs`): no reference counting below."""
    return (borrow(x), _borrow_opt(r), borrow(w), _borrow_opt(b), borrow(y), _borrow_opt(h),
            borrow(rstd), _borrow_opt(stage))


# The serial drivers, one per path, share one signature: r, h: the residual
# and the sum, or None; w: an array (ones where absent:
# polynorm.backends.numba._ones); b: an array or None; stage: the (1, c)
# buffer of y's type that streamed rows pass through (forward_streamed_rows), or None.


@_jit()
def forward_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of the plain forward: float32/float64 rows, no residual,
    y stored as usual (``r``, ``h``, ``stage``: None)."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    _plain_rows(lo, hi, x, w, b, y, rstd, flags, k, eps, offset)


@_jit()
def row_sum_rows(lo, hi, a, out, square):
    """``out[i] = sum(a[i])`` (``sum(a[i] * a[i])`` where ``square``) for rows ``[lo, hi)``
    of a float32/float64 ``a`` (at least one column), in :func:`_block_sum`'s order,
    rounded once to ``out``'s dtype: row sums that do not depend on the number of rows,
    for the jitted reference (:data:`polynorm.backends.reference.ROW_SUMS`)."""
    a, out = borrow(a), borrow(out)
    for i in range(lo, hi):
        out[i] = _block_sum(row_of(a, i), 0, a.shape[1], square)


def _stats_sum(a, i, row, square):  # pragma: no cover - replaced by the overload
    """:func:`row_stats_rows`'s sum of row ``i`` of ``a``: of its float32 values decoded
    into ``row`` for 16-bit bits, else of ``a``'s row in place."""
    raise NotImplementedError


@overload(_stats_sum, **_PLAIN_CALL)
def _ov_stats_sum(a, i, row, square):
    if bits_dtype(a.dtype):
        def decoded(a, i, row, square):
            for j in range(a.shape[1]):
                row[0, j] = load(a[i, j])
            return _block_sum(row_of(row, 0), 0, a.shape[1], square)

        return decoded
    return lambda a, i, row, square: _block_sum(row_of(a, i), 0, a.shape[1], square)


def _stats_scratch(a, ref):  # pragma: no cover - replaced by the overload
    """The scratch row of :func:`row_stats_rows` and :func:`reference_rstd_rows` for the rows of ``a`` (``ref``'s dtype): a
    row's length for 16-bit bits, decoded there, else empty until a row needs the scaled
    pass (no allocation for the ordinary rows of a small call)."""
    raise NotImplementedError


@overload(_stats_scratch, **_PLAIN_CALL)
def _ov_stats_scratch(a, ref):
    dt = np.float32 if ref == types.float32 else np.float64
    if bits_dtype(a.dtype):
        return lambda a, ref: np.empty((1, a.shape[1]), dt)
    return lambda a, ref: np.empty((1, 0), dt)


@_inline
def _needs_scaling(ss, floor) -> bool:
    """Whether a row of plain sum ``ss`` takes the scaled pass's parts in
    :func:`row_stats_rows` (not a finite number of at least ``2 * floor``)."""
    s = np.float64(ss)
    return not (s >= 2.0 * floor and s < math.inf)


@_inline
def _scaled_parts(a, i, row, zero):
    """``(m, ss2)`` of row ``i`` of ``a`` as :func:`row_stats_rows` gives them, ``row``
    (of ``a``'s row length) its scratch."""
    d = a.shape[1]
    for j in range(d):
        row[0, j] = load(a[i, j])
    mx = zero
    for j in range(d):
        v = abs(row[0, j])
        if v != v or mx != mx:
            mx = v if v != v else mx
        elif v > mx:
            mx = v
    div = mx if mx != zero else as_type_of(1.0, zero)
    for j in range(d):
        row[0, j] = row[0, j] / div
    return mx, as_type_of(_block_sum(row_of(row, 0), 0, d, d >= 0), zero)


@_jit()
def row_stats_rows(lo, hi, a, ss, m, ss2, floor):
    """The jitted reference's row statistics (its ``_rms``) for rows ``[lo, hi)`` of ``a``
    (float32/float64, or 16-bit bits summed as their float32 values, each row decoded
    into a float32 row first): ``ss[i]``, the sum of squares as
    :func:`row_sum_rows` sums it; where that is not a finite number of at least ``2 *
    floor`` (a superset of the rows whose plain sum the reference does not keep),
    ``m[i]`` (the largest magnitude, NaN where one is) and ``ss2[i]``, the sum of the
    squares of the row divided by ``m[i]`` (1 where 0), as the scaled pass has them;
    elsewhere 0.  Last row first, as :func:`rstd_rows` (the rows still in cache first)."""
    a, ss, m, ss2 = borrow(a), borrow(ss), borrow(m), borrow(ss2)
    d = a.shape[1]
    zero = as_type_of(0.0, ss[0])
    row = _stats_scratch(a, zero)
    for i in range(hi - 1, lo - 1, -1):
        # True, typed as row_sum_rows's flag (one _block_sum); rounded as stored
        ss[i] = _stats_sum(a, i, row, d >= 0)
        if _needs_scaling(ss[i], floor):
            if row.shape[1] < d:
                row = np.empty((1, d), ss.dtype)
            m[i], ss2[i] = _scaled_parts(a, i, row, zero)
        else:
            m[i], ss2[i] = zero, zero


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (LLVM's ``fma``), for floats of one type."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


@_jit()
def reference_rstd_rows(lo, hi, a, rstd, flags, k, eps, floor):
    """The jitted reference's ``rstd`` for rows ``[lo, hi)`` of ``a`` (``a`` as
    :func:`row_stats_rows` takes it, holding the first ``k`` columns), with the bits of
    its ``_rstd_from_rms(_rms(...))`` evaluated by XLA in ``rstd``'s dtype: the rms from
    :func:`row_stats_rows`'s parts as ``_rms`` selects them (the plain ``sqrt(ss / k)`` where ``ss`` is
    finite and at least ``floor``, else ``m * sqrt(ss2 / k)``, or ``m`` where ``m`` is
    Inf), then ``eps`` added inside by the hypot-style formula (``flags &
    EPS_INSIDE``) or to the rms.  Every constant is rounded to ``rstd``'s dtype first,
    as XLA rounds a Python scalar (``k`` from the integer); ``floor = k * floor_per_k`` in
    float64 before it.
    Last row first, as :func:`rstd_rows`.  One call where the statistics' parts and an
    elementwise program would be two, whose small program XLA splits over its pool."""
    a, rstd = borrow(a), borrow(rstd)
    d = a.shape[1]
    zero = as_type_of(0.0, rstd[0])
    row = _stats_scratch(a, zero)
    one = as_type_of(1.0, zero)
    floor_c = as_type_of(floor, zero)
    top = as_type_of(np.finfo(rstd.dtype).max, zero)
    # XLA compiles a division by the constant k as a product with its reciprocal
    inv_k = one / as_type_of(k, zero)
    ec = as_type_of(eps, zero)
    se = as_type_of(math.sqrt(eps), zero)
    inside = (flags & EPS_INSIDE) != 0
    for i in range(hi - 1, lo - 1, -1):
        ss = as_type_of(_stats_sum(a, i, row, d >= 0), zero)
        m, ss2 = zero, zero
        if _needs_scaling(ss, floor):
            if row.shape[1] < d:
                row = np.empty((1, d), rstd.dtype)
            m, ss2 = _scaled_parts(a, i, row, zero)
        if ss >= floor_c and ss <= top:
            rms = np.sqrt(ss * inv_k)
        elif m == math.inf:
            rms = m
        else:
            rms = m * np.sqrt(ss2 * inv_k)
        if inside:
            big = rms > se
            hi_ = rms if big else se
            lo_ = se if big else rms
            q = lo_ / (hi_ if hi_ != zero else one)
            rstd[i] = one / (hi_ * np.sqrt(_fma(q, q, one)))  # XLA contracts 1 + q * q
        else:
            rstd[i] = one / (rms + ec)


@_jit()
def row_dot_rows(lo, hi, dy, x, r, wo, out):
    """``out[i] = sum((dy[i] * wo) * (x[i] * r[i]))`` for rows ``[lo, hi)`` (``wo`` None:
    ``dy[i]`` alone), ``dy`` and ``x`` as their values in ``out``'s dtype, each product
    rounded there, summed as :func:`row_sum_rows` sums those products' array: the jitted
    reference backward's row dot (``g_dy * xhat``), with its bits, without that array."""
    dy, x, r, out = borrow(dy), borrow(x), borrow(r), borrow(out)
    d = x.shape[1]
    row = np.empty((1, d), out.dtype)
    square = d < 0  # False, typed as row_sum_rows's flag: one compiled _block_sum
    for i in range(lo, hi):
        ri = r[i]
        if wo is None:
            for j in range(d):
                row[0, j] = as_type_of(load(dy[i, j]), ri) * (as_type_of(load(x[i, j]), ri) * ri)
        else:
            for j in range(d):
                g = as_type_of(load(dy[i, j]), ri) * wo[j]
                row[0, j] = g * (as_type_of(load(x[i, j]), ri) * ri)
        out[i] = _block_sum(row_of(row, 0), 0, d, square)


@_jit()
def rstd_rows(lo, hi, x, rstd, flags, k, eps):
    """Rows ``[lo, hi)``'s ``rstd`` alone, with the forward's bits (:func:`_stats`): the
    statistic of a forward whose elementwise pass runs elsewhere (XLA's, under
    ``jax.jit``: :func:`polynorm.backends.numba.xla.rstd_handler`).

    Last row first: the loop fusion that wrote the rows (a residual stream's step
    before) and the elementwise pass that follows both go first row first, so reading
    backwards starts on the rows written last and ends on the rows read next: the ones
    still in cache when the rows outgrow it (``python bench/jax_stat_order.py``).  Each
    row's bits are its own."""
    x, rstd = borrow(x), borrow(rstd)
    inside = (flags & EPS_INSIDE) != 0
    for i in range(hi - 1, lo - 1, -1):
        rstd[i] = _stats(x, i, k, eps, inside)[1]


@_jit()
def scale_rows(lo, hi, x, r, g, y):
    """Rows ``[lo, hi)`` of ``y = (x * r[i]) * g`` (``g`` None: ``x * r[i]``), each product
    rounded to ``r``'s dtype, then once to ``y``'s: the jitted reference's elementwise pass
    (:func:`polynorm.backends.reference._affine` without a bias, ``g`` its ``weight +
    offset``) with XLA's bits (a NaN is a NaN: which one, XLA's operand order decides,
    and SPEC fixes none).  For 16-bit rows, whose conversions XLA's loop fusion runs
    several times slower (:func:`polynorm.jax.norm._reference_y`)."""
    # g as passed: Numba prunes the branch on an argument it never reassigns
    x, r, y = borrow(x), borrow(r), borrow(y)
    d = x.shape[1]
    for i in range(lo, hi):
        ri = r[i]
        for j in range(d):
            v = load(x[i, j]) * ri
            if g is not None:
                v = v * g[j]
            store(y, (i, j), v)


@_jit()
def forward_bits_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of a 16-bit forward without residual, y stored as
    usual (pipelined; ``r``, ``h``, ``stage``: None)."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    _bits_rows(lo, hi, x, w, b, y, rstd, flags, k, eps, offset)


@_jit()
def forward_streamed_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of a forward whose y streams out through ``stage``."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    _streamed_rows(lo, hi, x, w, b, y, rstd, flags, k, eps, offset, stage)


@_jit()
def forward_add_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of the fused add: ``h = x + r``, y from h (``stage``: None)."""
    x, r, w, b, y, h, rstd, stage = _borrowed(x, r, w, b, y, h, rstd, stage)
    _add_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset)


@_jit()
def forward_llama_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    x, y, rstd = borrow(x), borrow(y), borrow(rstd)
    r, h, w, b = _borrow_opt(r), _borrow_opt(h), _borrow_opt(w), _borrow_opt(b)
    _llama_path(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset)


@_jit(parallel=True)
def forward_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage)


@_jit(parallel=True)
def forward_bits_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_bits_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage)


@_jit(parallel=True)
def forward_streamed_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        own = _own_stage(stage)  # one stage per task
        forward_streamed_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, own)


@_jit(parallel=True)
def forward_add_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_add_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage)


def forward_kernels(residual: bool, bits: bool, stream: bool) -> tuple:
    """``(parallel, serial)`` drivers of a forward: the fused add with a
    ``residual``, streamed y, the 16-bit pipeline for ``bits`` rows, or the
    plain two passes."""
    if residual:
        return forward_add_parallel, forward_add_rows
    if stream:
        return forward_streamed_parallel, forward_streamed_rows
    if bits:
        return forward_bits_parallel, forward_bits_rows
    return forward_parallel, forward_rows


@_jit(parallel=True)
def forward_llama_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        forward_llama_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage)


@_jit()
def widen_bits(a, out):
    """``out[j] = a[j]`` for 16-bit bits ``a`` (:func:`load`): a weight or bias in
    the float32 compute dtype.  The widening is exact; numpy's own 16-bit
    casts take several times as long as a (1, 4096) forward."""
    for j in range(a.shape[0]):
        out[j] = load(a[j])


# A fused add with a non-default norm_input or residual_dtype (polynorm.ops.norm.add_apart):
# the sum kept in the compute type for the plain forward, h rounded once from it.


@_jit()
def add_split_rows(lo, hi, x, r, s, h):
    """Rows ``[lo, hi)``: ``s = x + r`` summed in ``s``'s type (the compute type),
    ``h = s`` rounded once to ``h``'s type."""
    for i in range(lo, hi):
        for j in range(x.shape[1]):
            s[i, j] = load(x[i, j])
            s[i, j] = s[i, j] + load(r[i, j])  # in s's type: float64 where s is float64
            store(h, (i, j), s[i, j])


@_jit(parallel=True)
def add_split_parallel(x, r, s, h):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        add_split_rows(lo, hi, x, r, s, h)


@_jit()
def forward_add_sum_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    """Rows ``[lo, hi)`` of the fused add with ``norm_input="sum"``: per row the sum
    ``x + r`` in ``stage``'s type (a ``(1, d)`` row of the compute type), ``h`` that
    sum rounded once, and y the plain forward of the unrounded sum (the bits of
    :func:`forward_rows` on it)."""
    d = x.shape[1]
    for i in range(lo, hi):
        for j in range(d):
            stage[0, j] = load(x[i, j])
            stage[0, j] = stage[0, j] + load(r[i, j])  # in stage's type
            store(h, (i, j), stage[0, j])
        ss = _row_sumsq(stage, 0, k)
        _fwd_norm_row(0, 1, stage, w, b, y[i:i + 1], rstd[i:i + 1], flags, k, eps, offset, ss,
                      _NO_BLOCKS)


@_jit(parallel=True)
def forward_add_sum_parallel(x, r, w, b, y, h, rstd, flags, k, eps, offset, stage):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        own = np.empty_like(stage)  # one row of scratch per task
        forward_add_sum_rows(lo, hi, x, r, w, b, y, h, rstd, flags, k, eps, offset, own)
