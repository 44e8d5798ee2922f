"""Numba kernels of gated RMSNorm (:class:`polynorm.core.options.GatedPlan`).

The forward takes x, z and y as :mod:`.numba.kernels` takes them (16-bit
floats as integer bits, decoded in registers by :mod:`.numba.codec`),
C-contiguous; weight and bias in the compute type, ``None`` where absent
(the loops then compile without their terms).  Each group's statistic
is the plain forward's (``_row_sumsq`` / ``_rstd_from`` on the group as a
``(1, group_size)`` row): for ``norm_before_gate=True`` it is taken on x
itself, so a group's rstd has the bits ``rms_norm`` gives that group as a
row; for ``False`` on ``u = x * silu(z)``, computed in the compute type
into a per-task row buffer and summed from there.  ``silu`` runs in the
compute type with an exp LLVM can vectorize (:func:`silu`); the forward's
float32 silu passes take whole blocks of :data:`SILU_BLOCK` elements as
vector IR (:func:`_silu_block`: the same operations lane by lane, so the
same bits, with the exp's constants loaded once per block).  Every row is
computed by the same compiled row code whatever the thread count or the
other rows (batch invariance); the parallel driver splits the rows into
ranges as the plain forward does.

The backward takes its arrays the same way and recomputes a group's
statistic as the forward does (the same rstd bits); ``dweight``/``dbias``
leave the kernel as per-row leaves and are summed over the row tree of
:mod:`.rowtree` by :func:`tree_sum`.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload

from polynorm.backends.numba.codec import (
    HW_HALF,
    decode_lanes,
    fma_ir,
    item_pointer,
    like,
    load,
    prefetch_span,
    splat,
    store,
)
from polynorm.backends.numba.kernels import (
    DOT_BLOCK,
    EPS_INSIDE,
    HAS_B,
    HAS_RSTD,
    _borrow_opt,
    _inline,
    _inline_ir,
    _jit,
    _range_bounds,
    _range_count,
    _reduce,
    _row_sumsq,
    _rstd_from,
    _stats,
    as_type_of,
    scale_shift,
)
from polynorm.backends.numba.refs import borrow, row_span
from polynorm.backends.rowtree import TREE_G

#: flags: norm_before_gate=True; the forward prefetches the next row's x and
#: z a chunk at a time during a row's silu pass (the other bits are
#: numba.kernels')
NBG = 1 << 8
PREFETCH = 1 << 9
#: columns of the forward's silu pass (the output pass with norm_before_gate,
#: else the gate pass) per prefetched chunk
_CHUNK = 256

# --------------------------------------------------------------------------- silu

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: adding it rounds to an integer, kept in the low bits
_LN2_HI = 0.693359375  # Cody-Waite split of ln 2: n * _LN2_HI is exact for |n| < 2**15
_LN2_LO = -2.12194440e-4
# Cephes' expf polynomial (relative error ~1 ulp on [-ln2/2, ln2/2])
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
          1.6666665459e-1, 5.0000001201e-1)
_EXP_HI = 88.72283935546875  # above: exp overflows float32
#: below: exp is taken as 0.  exp(-86) ~ 2**-124 is far below 2**-24, where
#: ``1 + exp(-z)`` already rounds to 1, so silu and sigmoid lose nothing.
_EXP_LO = -86.0


def _expf_ir(builder, x):
    """float32 ``exp(x)`` (a scalar or a vector) as straight-line IR (no libm call, so
    LLVM vectorizes the loops that use it): ``2**n * p(r)`` with ``n = rint(x / ln 2)``.
    +inf above :data:`_EXP_HI`, 0 below :data:`_EXP_LO`, NaN for NaN (the
    rounding trick keeps every step defined for any input: no poison)."""
    f32, i32 = like(x, _F32), like(x, _I32)

    def c(val):
        return splat(f32, val)

    t = fma_ir(builder, x, c(_LOG2E), c(_ROUND))
    nf = builder.fsub(t, c(_ROUND))
    r = fma_ir(builder, nf, c(-_LN2_HI), x)
    r = fma_ir(builder, nf, c(-_LN2_LO), r)
    p = c(_EXP_P[0])
    for q in _EXP_P[1:]:
        p = fma_ir(builder, p, r, c(q))
    e = builder.fadd(fma_ir(builder, p, builder.fmul(r, r), r), c(1.0))
    # 2**(n - 1) from n in t's low bits (n in [-124, 128] on the range kept), times 2
    n = builder.sub(builder.bitcast(t, i32), builder.bitcast(c(_ROUND), i32))
    scale = builder.bitcast(builder.shl(builder.add(n, splat(i32, 126)), splat(i32, 23)), f32)
    e = builder.fmul(builder.fmul(e, scale), c(2.0))
    e = builder.select(builder.fcmp_ordered(">", x, c(_EXP_HI)), c(math.inf), e)
    return builder.select(builder.fcmp_ordered("<", x, c(_EXP_LO)), c(0.0), e)


@intrinsic
def _expf(typingctx, v):
    """float32 ``exp(v)`` (:func:`_expf_ir`)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _expf_ir(builder, args[0])

    return types.float32(v), codegen


def exp_c(v):  # pragma: no cover - replaced by the overload
    """``exp(v)`` in ``v``'s type: :func:`_expf` for float32, libm for float64."""
    raise NotImplementedError


@overload(exp_c, inline="always")
def _ov_exp_c(v):
    if v == types.float32:
        return lambda v: _expf(v)
    if v == types.float64:
        return lambda v: math.exp(v)
    return None


@_inline_ir
def silu(v):
    """``v / (1 + exp(-v))`` in ``v``'s type (inf for +inf, NaN for -inf and NaN, as numpy)."""
    return v / (as_type_of(1.0, v) + exp_c(-v))


#: elements one :func:`_silu_block` call computes: four 8-lane float32 vectors,
#: so the exp's constants are loaded once per block (LLVM's own vectorization
#: of the scalar loop holds too few of them in AVX2's 16 registers and reloads
#: them every 8 elements)
SILU_BLOCK = 32


def _block_ok(x, z, u):  # pragma: no cover - replaced by the overload
    """Whether :func:`_silu_block` takes these arrays (a compile-time constant)."""
    raise NotImplementedError


def _lanes_dtype_ok(dt):
    return dt == types.float32 or dt == types.uint16 or (dt == types.int16 and HW_HALF)


@overload(_block_ok, inline="always")
def _ov_block_ok(x, z, u):
    ok = (u.dtype == types.float32 and _lanes_dtype_ok(x.dtype) and _lanes_dtype_ok(z.dtype))
    return lambda x, z, u: ok


@intrinsic
def _silu_block(typingctx, x, z, u, i, j, mul_x):
    """``u[0, j : j + SILU_BLOCK] = [x[i, j:...] *] silu(z[i, j:...])`` as float32 vector
    IR (``x`` with ``mul_x``, a literal bool), the operations of :func:`silu` (and
    the product) lane by lane: the same bits as the scalar loop.  Rows of unit
    column stride (the kernels' arrays); arrays :func:`_block_ok` refuses
    compile to nothing (the callers do not call it then)."""
    if not (isinstance(x, types.Array) and isinstance(z, types.Array)
            and isinstance(u, types.Array) and isinstance(mul_x, types.BooleanLiteral)):
        return None
    ok = u.dtype == types.float32 and _lanes_dtype_ok(x.dtype) and _lanes_dtype_ok(z.dtype)
    with_x = mul_x.literal_value

    def codegen(context, builder, sig, args):
        if not ok:
            return context.get_dummy_value()
        xv, zv, uv, iv, jv, _ = args
        iv = context.cast(builder, iv, sig.args[3], types.intp)
        jv = context.cast(builder, jv, sig.args[4], types.intp)
        zero = context.get_constant(types.intp, 0)

        def lanes(aty, av):
            elt = context.get_data_type(aty.dtype)
            vty = ir.VectorType(elt, SILU_BLOCK)
            p = item_pointer(context, builder, aty, av, [iv, jv])
            v = builder.load(builder.bitcast(p, vty.as_pointer()),
                             align=context.get_abi_sizeof(elt))
            return decode_lanes(builder, v, aty.dtype)

        zf = lanes(sig.args[1], zv)
        f32v = zf.type
        den = builder.fadd(splat(f32v, 1.0), _expf_ir(builder, builder.fsub(splat(f32v, -0.0),
                                                                             zf)))
        out = builder.fdiv(zf, den)
        if with_x:
            out = builder.fmul(lanes(sig.args[0], xv), out)
        dst = item_pointer(context, builder, sig.args[2], uv, [zero, jv])
        builder.store(out, builder.bitcast(dst, f32v.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(x, z, u, i, j, mul_x), codegen


@intrinsic
def _dsilu_block(typingctx, z, buf, i, j):
    """``buf[0, j:j + SILU_BLOCK] = silu(z[i, j:...])`` and ``buf[1, j:...] = silu'(z)``
    as float32 vector IR: the backward's scalar operations (``den = 1 + exp(-z)``,
    ``z / den``, ``sig = 1 / den``, ``sig * (1 + z * (1 - sig))``) lane by lane, so
    the same bits; compiles to nothing where :func:`_block_ok` refuses."""
    if not (isinstance(z, types.Array) and isinstance(buf, types.Array)):
        return None
    ok = buf.dtype == types.float32 and _lanes_dtype_ok(z.dtype)

    def codegen(context, builder, sig, args):
        if not ok:
            return context.get_dummy_value()
        zv, bv, iv, jv = args
        iv = context.cast(builder, iv, sig.args[2], types.intp)
        jv = context.cast(builder, jv, sig.args[3], types.intp)
        elt = context.get_data_type(sig.args[0].dtype)
        p = item_pointer(context, builder, sig.args[0], zv, [iv, jv])
        zf = decode_lanes(builder, builder.load(
            builder.bitcast(p, ir.VectorType(elt, SILU_BLOCK).as_pointer()),
            align=context.get_abi_sizeof(elt)), sig.args[0].dtype)
        f32v = zf.type
        one = splat(f32v, 1.0)
        den = builder.fadd(one, _expf_ir(builder, builder.fsub(splat(f32v, -0.0), zf)))
        sg = builder.fdiv(one, den)
        ds = builder.fmul(sg, builder.fadd(one, builder.fmul(zf, builder.fsub(one, sg))))
        for row, val in ((0, builder.fdiv(zf, den)), (1, ds)):
            dst = item_pointer(context, builder, sig.args[1], bv,
                               [context.get_constant(types.intp, row), jv])
            builder.store(val, builder.bitcast(dst, f32v.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(z, buf, i, j), codegen


# --------------------------------------------------------------------------- forward


@_inline_ir
def _group_rstd(a, ai, lo, gs, k, eps, flags, rstd, i, g):
    """rstd of ``a[ai, lo : lo + gs]`` (over its first ``k``), the plain forward's
    statistic of that span as a row: stored to ``rstd[i, g]``; ``(r64, rc)``."""
    s = row_span(a, ai, lo, gs)
    inside = (flags & EPS_INSIDE) != 0
    r64 = _rstd_from(s, 0, k, eps, inside, _row_sumsq(s, 0, k))
    rstd[i, g] = r64
    return r64, rstd[i, g]


@_inline_ir
def _out_gate(i, lo, hi, x, z, w, b, y, rc, oc, u):
    """``y[i, lo:hi] = (x * rstd * (w + offset) + b) * silu(z)`` (norm_before_gate);
    where :func:`_block_ok`, silu(z) goes through ``u`` a block at a time first."""
    j0 = np.uint64(lo)
    if _block_ok(x, z, u):
        step = np.uint64(SILU_BLOCK)
        jb = j0 + (np.uint64(hi) - j0) // step * step
        for j in range(j0, jb, step):
            _silu_block(x, z, u, i, j, False)
        for j in range(j0, jb):
            t = scale_shift(as_type_of(load(x[i, j]), rc) * rc, w, b, j, oc)
            store(y, (i, j), t * u[0, j])
        j0 = jb
    for j in range(j0, np.uint64(hi)):
        t = scale_shift(as_type_of(load(x[i, j]), rc) * rc, w, b, j, oc)
        store(y, (i, j), t * silu(as_type_of(load(z[i, j]), rc)))


@_inline_ir
def _gate_in(i, lo, hi, x, z, u):
    """``u[0, lo:hi] = x[i] * silu(z[i])`` in the compute type (u's): whole
    :data:`SILU_BLOCK` blocks as vectors where :func:`_block_ok`, the rest here."""
    ref = u[0, 0]
    j0 = np.uint64(lo)
    if _block_ok(x, z, u):
        step = np.uint64(SILU_BLOCK)
        jb = j0 + (np.uint64(hi) - j0) // step * step
        for j in range(j0, jb, step):
            _silu_block(x, z, u, i, j, True)
        j0 = jb
    for j in range(j0, np.uint64(hi)):
        u[0, j] = as_type_of(load(x[i, j]), ref) * silu(as_type_of(load(z[i, j]), ref))


@_inline_ir
def _out_u(i, lo, hi, u, w, b, y, rc, oc):
    """``y[i, lo:hi] = u * rstd * (w + offset) + b`` (u: the gated row buffer)."""
    for j in range(np.uint64(lo), np.uint64(hi)):
        store(y, (i, j), scale_shift(u[0, j] * rc, w, b, j, oc))


@_inline_ir
def _wide_group(i, lo, hi, x, z, u, w, b, y, r64, oc, flags):
    """A group whose rstd overflows the compute type (float32 values of rms
    < ~3e-39 with a tiny eps): ``v * 2**64 * (rstd * 2**-64)``, both in range;
    v is x (norm_before_gate, then gated) or the buffer's u."""
    nbg = (flags & NBG) != 0
    rc = as_type_of(r64 * 2.0**-64, oc)
    up = as_type_of(2.0**64, oc)
    for j in range(lo, hi):
        v = as_type_of(load(x[i, j]), oc) if nbg else u[0, j]
        t = scale_shift(v * up * rc, w, b, j, oc)
        if nbg:
            t = t * silu(as_type_of(load(z[i, j]), oc))
        store(y, (i, j), t)



@_jit()
def forward_rows(lo, hi, x, z, w, b, y, rstd, u, flags, gs, k, eps, offset):
    """Rows ``[lo, hi)`` on one thread (the serial path).  ``u``: a ``(1, d)``
    buffer of the compute type (the gated row of norm_before_gate=False)."""
    x, z, y, rstd, u = borrow(x), borrow(z), borrow(y), borrow(rstd), borrow(u)
    w, b = _borrow_opt(w), _borrow_opt(b)
    n, d = x.shape
    groups = d // gs
    oc = as_type_of(offset, u[0, 0])
    pf = (flags & PREFETCH) != 0
    if flags & NBG:
        for i in range(lo, hi):
            for g in range(groups):
                g0 = g * gs
                r64, rc = _group_rstd(x, i, g0, gs, k, eps, flags, rstd, i, g)
                if r64 < math.inf and not rc < math.inf:
                    _wide_group(i, g0, g0 + gs, x, z, u, w, b, y, r64, oc, flags)
                    continue
                for jc in range(g0, g0 + gs, _CHUNK):
                    je = min(jc + _CHUNK, g0 + gs)
                    if pf and i + 1 < n:
                        prefetch_span(x, i + 1, jc, je - jc)
                        prefetch_span(z, i + 1, jc, je - jc)
                    _out_gate(i, jc, je, x, z, w, b, y, rc, oc, u)
    else:
        for i in range(lo, hi):
            # the gate pass is the compute-heavy one: it prefetches the next row
            for jc in range(0, d, _CHUNK):
                je = min(jc + _CHUNK, d)
                if pf and i + 1 < n:
                    prefetch_span(x, i + 1, jc, je - jc)
                    prefetch_span(z, i + 1, jc, je - jc)
                _gate_in(i, jc, je, x, z, u)
            for g in range(groups):
                g0 = g * gs
                r64, rc = _group_rstd(u, 0, g0, gs, k, eps, flags, rstd, i, g)
                if r64 < math.inf and not rc < math.inf:
                    _wide_group(i, g0, g0 + gs, x, z, u, w, b, y, r64, oc, flags)
                    continue
                _out_u(i, g0, g0 + gs, u, w, b, y, rc, oc)


@_jit(parallel=True)
def forward_parallel(x, z, w, b, y, rstd, u, flags, gs, k, eps, offset):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        own = np.empty_like(u)  # one row buffer per task
        forward_rows(lo, hi, x, z, w, b, y, rstd, own, flags, gs, k, eps, offset)


# --------------------------------------------------------------------------- backward
# Per row: one elementwise pass fills the task's buffer (rows: silu, silu',
# the normalized value v = x or u, the gradient reaching the norm dn); per
# group the statistic (the forward's, so a recomputed rstd has its bits), the
# dot c = sum g * dn * vhat (float32 partials over DOT_BLOCK elements, added
# in float64, as the plain backward's), then one elementwise pass writing dx,
# dz and the dweight leaves.

_S, _DS, _V, _DN = 0, 1, 2, 3  # rows of the backward's buffer


@_reduce
def _dot_group(dn, v, w, lo, n, rc, oc):
    """``sum_j (w[lo + j] + oc) * dn[0, j] * (v[0, j] * rc)`` over ``j < n``, the
    spans' (1, n) rows; float64 of float32 partials (float64 for float64)."""
    c = 0.0
    for b0 in range(np.uint64(0), np.uint64(n), np.uint64(DOT_BLOCK)):
        e = min(b0 + np.uint64(DOT_BLOCK), np.uint64(n))
        s = as_type_of(0.0, rc)
        for j in range(b0, e):
            s += (w[np.uint64(lo) + j] + oc) * (dn[0, j] * (v[0, j] * rc))
        c += np.float64(s)
    return c


@_inline_ir
def _bwd_fill(i, dy, x, z, buf, nbg):
    """The buffer's rows for row ``i``: silu(z), silu'(z) (whole :data:`SILU_BLOCK`
    blocks as vectors where :func:`_block_ok`), then v and dn."""
    ref = buf[0, 0]
    one = as_type_of(1.0, ref)
    d = np.uint64(x.shape[1])
    j0 = np.uint64(0)
    if _block_ok(x, z, buf):
        step = np.uint64(SILU_BLOCK)
        j0 = d // step * step
        for j in range(np.uint64(0), j0, step):
            _dsilu_block(z, buf, i, j)
    for j in range(j0, d):
        zj = as_type_of(load(z[i, j]), ref)
        den = one + exp_c(-zj)
        buf[_S, j] = zj / den  # the forward's silu (same bits)
        sig = one / den
        buf[_DS, j] = sig * (one + zj * (one - sig))
    if nbg:
        for j in range(d):
            buf[_V, j] = as_type_of(load(x[i, j]), ref)
            buf[_DN, j] = as_type_of(load(dy[i, j]), ref) * buf[_S, j]
    else:
        for j in range(d):
            buf[_V, j] = as_type_of(load(x[i, j]), ref) * buf[_S, j]  # the forward's u
            buf[_DN, j] = as_type_of(load(dy[i, j]), ref)


@_inline  # a call: it is called twice per group, which Numba's IR inliner mishandled
def _bwd_out(i, lo, hi, dy, x, w, b, dx, dz, lw, buf, rc, oc, m, nbg):
    """dx, dz and the dweight leaves of ``[lo, hi)`` of row ``i`` (``m``: the
    group's coef, or 0 beyond k)."""
    j0 = np.uint64(lo)
    j1 = np.uint64(hi)
    if nbg:
        for j in range(j0, j1):
            g = w[j] + oc
            xh = buf[_V, j] * rc
            dn = buf[_DN, j]
            store(dx, (i, j), rc * (dn * g - xh * m))
            pre = xh * g + b[j]
            store(dz, (i, j), as_type_of(load(dy[i, j]), rc) * pre * buf[_DS, j])
            lw[i, j] = dn * xh
    else:
        for j in range(j0, j1):
            xh = buf[_V, j] * rc
            dn = buf[_DN, j]
            dv = rc * (dn * (w[j] + oc) - xh * m)
            store(dx, (i, j), dv * buf[_S, j])
            store(dz, (i, j), dv * as_type_of(load(x[i, j]), rc) * buf[_DS, j])
            lw[i, j] = dn * xh


@_jit()
def backward_rows(lo, hi, dy, x, z, w, b, rstd, dx, dz, lw, lb, buf, flags, gs, k, eps, offset):
    """Rows ``[lo, hi)`` on one thread.  ``w``/``b``: ``(d,)`` in the compute type
    (ones / zeros when absent, which change no value); ``buf``: ``(4, d)`` of it."""
    dy, x, z, w, b, rstd, dx, dz, lw, lb, buf = (
        borrow(dy), borrow(x), borrow(z), borrow(w), borrow(b), borrow(rstd), borrow(dx),
        borrow(dz), borrow(lw), borrow(lb), borrow(buf))
    d = x.shape[1]
    groups = d // gs
    nbg = (flags & NBG) != 0
    inside = (flags & EPS_INSIDE) != 0
    has_rstd = (flags & HAS_RSTD) != 0
    oc = as_type_of(offset, w[0])
    zero = as_type_of(0.0, oc)
    for i in range(lo, hi):
        _bwd_fill(i, dy, x, z, buf, nbg)
        for g in range(groups):
            g0 = g * gs
            # the forward's statistic: of x for norm_before_gate, else of u
            rms = 0.0
            r64 = 0.0
            if not has_rstd or not inside:
                if nbg:
                    rms, r64 = _stats(row_span(x, i, g0, gs), 0, k, eps, inside)
                else:
                    rms, r64 = _stats(row_span(buf, _V, g0, gs), 0, k, eps, inside)
            if has_rstd:
                r64 = np.float64(rstd[i, g])
            rc = as_type_of(r64, oc)
            # over the whole group (Plan's backward: only the statistic stops at k)
            c = _dot_group(row_span(buf, _DN, g0, gs), row_span(buf, _V, g0, gs), w, g0, gs,
                           rc, oc)
            coef64 = c / k
            if not inside:
                coef64 = 0.0 if rms == 0.0 else coef64 * ((rms + eps) / rms)
            coef = as_type_of(coef64, oc)
            _bwd_out(i, g0, g0 + k, dy, x, w, b, dx, dz, lw, buf, rc, oc, coef, nbg)
            if k < gs:
                # beyond k the term is xhat * 0 (NaN for a non-finite token, as the reference)
                _bwd_out(i, g0 + k, g0 + gs, dy, x, w, b, dx, dz, lw, buf, rc, oc, zero, nbg)
        if flags & HAS_B:
            for j in range(np.uint64(d)):
                lb[i, j] = buf[_DN, j]


@_jit(parallel=True)
def backward_parallel(dy, x, z, w, b, rstd, dx, dz, lw, lb, buf, flags, gs, k, eps, offset):
    n = x.shape[0]
    for c in prange(_range_count(n)):
        lo, hi = _range_bounds(c, n)
        own = np.empty_like(buf)
        backward_rows(lo, hi, dy, x, z, w, b, rstd, dx, dz, lw, lb, own, flags,
                      gs, k, eps, offset)


def tree_sum(leaves: np.ndarray) -> np.ndarray:
    """Sum of ``leaves`` (rows, d) over rows in :mod:`.rowtree`'s order: pairs
    of adjacent nodes level by level, a lone last node carried up; adds below
    level ``TREE_G`` in the leaves' dtype, from it up in float64."""
    cur = leaves
    level = 1
    while cur.shape[0] > 1:
        m = cur.shape[0]
        if level == TREE_G:
            cur = cur.astype(np.float64)
        pairs = cur[0:m - 1:2] + cur[1:m:2]
        cur = np.concatenate([pairs, cur[m - 1:]]) if m % 2 else pairs
        level += 1
    return cur[0].astype(np.float64)
