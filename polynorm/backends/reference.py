"""Pure array-API reference backend.

Runs on any namespace that ``array_api_compat.array_namespace`` knows (numpy,
torch, jax, dask, cupy, array-api-strict, ...), with standard operations
only.  It is the fallback of ``backend="auto"`` and the backend every other
one is checked against.

Overflow: the plain sum of squares serves the rows where it is a normal
number well above underflow; the other rows (``x = 1e25`` in float32, whose
square overflows, subnormal rows, Inf, NaN) take the sum scaled by the row's
largest magnitude, so they give the float64 answer; ``eps`` is combined with
the rms by a hypot-style formula for the same reason.  The scaled pass runs
only when some row needs it (eager libraries; jax, traced too, behind a
``lax.cond``), see ``_rms``.

The plain call on a contiguous numpy array or torch CPU tensor (``backend="array_api"``
through :mod:`polynorm.ops.fast_ref`) runs :func:`eager_forward`: :func:`forward`'s steps
and bits in fewer library calls and passes over memory (the measurement against the naive
formula: ``bench/reference_speed.py``).
"""

from __future__ import annotations

import math
from typing import Any

from polynorm.core.dtypes import namespace_dtype
from polynorm.core.options import Plan, compute_dtype, promote

name = "array_api"


def available() -> tuple[bool, str]:
    try:
        import array_api_compat  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a hard dependency
        return False, str(exc)
    return True, "ok"


def accepts(x: Any) -> bool:
    return True


def _xp(x: Any):
    from array_api_compat import array_namespace

    return array_namespace(x)


def _c_rows(a):
    """numpy/cupy/torch rows made C-contiguous: their row sums then follow one order, whatever the layout.

    numpy reduces a non-contiguous axis in memory order, so a Fortran-order batch would give
    another ``rstd`` (an ulp) than the same token alone (batch invariance, SPEC).
    """
    lib = type(a).__module__.split(".")[0]
    if lib in ("numpy", "cupy") and a.ndim == 2 and not a.flags.c_contiguous:
        import importlib

        return importlib.import_module(lib).ascontiguousarray(a)
    if lib == "torch" and a.ndim == 2 and not a.is_contiguous():
        return a.contiguous()  # torch too reduces a strided axis in another order
    return a


#: ``type(a) -> row_sum(a)``: fixed-order row sums for array types whose own ``sum`` takes
#: its order from the array's shape (arrays that ``jax.jit`` traces: XLA's CPU reductions
#: do), so that a token's bits do not depend on the batch; None where it does not take
#: the array.  ``polynorm.jax`` registers jax's tracers on import: this module imports no
#: framework.
ROW_SUMS: dict = {}
#: The row statistics of :func:`_rms` by array type: ``hook(vk, raw, floor)`` gives ``(ss,
#: m, ss2)``, the row sums of squares of ``vk`` as :data:`ROW_SUMS`'s hook sums them and,
#: for at least the rows whose ``ss`` is not a finite number of ``floor`` or more, the
#: scaled pass's largest magnitude and sum (:func:`_rms_scaled`), or None.  ``polynorm.jax``
#: registers jax's tracers: one call, no ``lax.cond`` and its predicate's reductions.
ROW_STATS: dict = {}
#: ``rstd`` of rows by array type: ``hook(vk, raw, floor, plan)`` gives
#: ``_rstd_from_rms(_rms(...))`` of the rows whose first ``k`` columns are ``vk``
#: (:data:`ROW_STATS`'s arguments), with the bits of those steps evaluated by the
#: library, or None.  ``polynorm.jax`` registers jax's tracers: one call, where the
#: statistics and the small program that makes ``rstd`` of them would be two, and XLA
#: splits such a program over its pool, which slows the program's next pass.
ROW_RSTD: dict = {}
#: Row dots of the backward by array type: ``hook(dy, x, r, wo)`` gives ``sum((dy * wo) *
#: (x * r[:, None]), axis=1)`` (``wo`` None: ``dy`` alone; ``dy``, ``x`` cast to ``r``'s
#: dtype), summed as :data:`ROW_SUMS`'s hook sums those products, or None.  ``polynorm.jax``
#: registers jax's jit tracers: the products' array is then not written out.
ROW_DOTS: dict = {}


def _row_sum(xp, a, square: bool = False):
    """``sum(a, axis=1)`` of 2-D ``a`` (of ``a * a`` where ``square``), in an order that does
    not depend on the number of rows (:data:`ROW_SUMS`, else the library's own)."""
    hook = ROW_SUMS.get(type(a)) if ROW_SUMS else None
    if hook is not None:
        s = hook(a, square)
        if s is not None:
            return s
    return xp.sum(a * a if square else a, axis=1)


def _rms(xp, v, plan: Plan, x=None):
    """``sqrt(mean(v[:, :k]**2))`` per row, without spurious overflow or underflow
    (``v``: ``x`` in the compute dtype, where ``x`` is given).

    One pass where it can: the plain sum of squares, kept for the rows where it
    is a normal number at least ``k * tiny / eps`` (there the squares that
    underflowed are worth under ``eps**2 / 2`` of it, and nothing overflowed).
    The other rows (Inf, NaN, overflow, subnormal or zero) take the scaled sum,
    by the row's largest magnitude.  The choice is per row, from that row's
    values only (batch invariance).  Eager libraries skip the scaled pass when
    no row needs it, jax (arrays and tracers) by a ``lax.cond``; dask computes
    both and selects.

    The one place of the non-finite rule (SPEC's formula, as torch): an Inf
    among the first ``k`` elements makes the mean of squares Inf, so the rms is
    Inf (and rstd 0), not the NaN of ``Inf / Inf`` that scaling by it gives; a
    NaN there makes it NaN (the max propagates NaN, so ``m`` is Inf only in a
    row without one).
    """
    if plan.k == 0:
        return _rms_scaled(xp, _c_rows(v[:, :0]), plan)
    vk, raw, floor = _stat_rows(xp, v, plan, x)
    fi = xp.finfo(vk.dtype)
    hook = ROW_STATS.get(type(vk)) if ROW_STATS else None
    parts = None if hook is None else hook(vk, raw, floor)
    if parts is not None:
        ss, m, ss2 = parts
        ok = (ss >= floor) & (ss <= float(fi.max))
        return xp.where(ok, xp.sqrt(ss / plan.k), _scaled_rms(xp, m, ss2, plan))
    ss = _row_sum(xp, vk, square=True)
    ok = (ss >= floor) & (ss <= float(fi.max))
    rms = xp.sqrt(ss / plan.k)
    if _eager(vk) and bool(xp.all(ok)):
        return rms
    if type(vk).__module__.startswith("jax"):
        return _jax_rms_cond(xp, vk, ok, rms, plan, raw)
    return xp.where(ok, rms, _rms_scaled(xp, vk, plan))


def _stat_rows(xp, v, plan: Plan, x=None):
    """``(vk, raw, floor)`` of :func:`_rms` (``k > 0``): the first ``k`` columns of ``v``,
    C-contiguous; their 16-bit source where ``x`` is one (else None); the least plain sum
    of squares that :func:`_rms` keeps."""
    vk = _c_rows(v if plan.k == plan.d else v[:, : plan.k])
    raw = None if x is None or x.dtype == v.dtype else x if plan.k == plan.d else x[:, : plan.k]
    fi = xp.finfo(vk.dtype)
    return vk, raw, plan.k * (float(fi.smallest_normal) / float(fi.eps))


def _rstd(xp, v, plan: Plan, x=None):
    """``rstd`` of rows ``v`` (compute dtype; ``x`` as :func:`_rms` takes it):
    :func:`_rstd_from_rms` of :func:`_rms`, in one call where :data:`ROW_RSTD` takes
    the array type."""
    hook = ROW_RSTD.get(type(v)) if ROW_RSTD and plan.k > 0 else None
    if hook is not None:
        r = hook(*_stat_rows(xp, v, plan, x), plan)
        if r is not None:
            return r
    return _rstd_from_rms(xp, _rms(xp, v, plan, x), plan)


def _jax_rms_cond(xp, vk, ok, rms, plan: Plan, raw=None):
    """jax arrays and tracers: the scaled pass behind ``lax.cond`` on "some row needs
    it", which XLA runs as a branch, so that a call of ordinary rows costs what
    the naive formula does (two passes, not four).  Each row's value is the
    ``where``'s of the other branch (the plain rms where ``ok``), so the bits do
    not depend on the branch taken nor on the other rows; under ``vmap`` the cond
    becomes a select of both, the same values.  The branch casts ``raw`` (``vk``'s
    16-bit source) itself: a cast outside it is an operand that XLA writes out on
    every call, taken or not."""
    from jax import lax

    def scaled():
        rows = vk if raw is None else xp.astype(raw, vk.dtype)
        return xp.where(ok, rms, _rms_scaled(xp, rows, plan))

    return lax.cond(xp.all(ok), lambda: rms, scaled)


def _eager(a) -> bool:
    """Whether ``bool()`` of an array of this library is cheap and allowed (not a tracer, not
    lazy, not a torch.func transform's wrapper)."""
    lib = type(a).__module__.split(".")[0]
    if lib == "torch":
        import torch

        from polynorm.core.interop import is_functorch_wrapped

        return not is_functorch_wrapped(torch, a)
    return lib in ("numpy", "cupy", "array_api_strict")


def _rms_scaled(xp, vk, plan: Plan):
    """The rms of each row of ``vk`` from its squares scaled by the row's largest magnitude."""
    m = xp.max(xp.abs(vk), axis=1) if plan.k > 0 else None
    m_safe = xp.where(m == 0, xp.ones_like(m), m)
    scaled = vk / m_safe[:, None]
    return _scaled_rms(xp, m, _row_sum(xp, scaled, square=True), plan)


def _scaled_rms(xp, m, ss, plan: Plan):
    """The rms from a row's largest magnitude ``m`` and the sum ``ss`` of its squares
    divided by ``m``."""
    return xp.where(m == math.inf, m, m * xp.sqrt(ss / plan.k))


def _rstd_from_rms(xp, rms, plan: Plan):
    if plan.eps_inside:
        # 1 / sqrt(rms**2 + eps) written as 1 / hypot(rms, sqrt(eps)):
        # rms**2 would overflow float32 for rows of 1e20.
        se = math.sqrt(plan.eps)
        a = xp.where(rms > se, rms, xp.full_like(rms, se))
        b = xp.where(rms > se, xp.full_like(rms, se), rms)
        a_safe = xp.where(a == 0, xp.ones_like(a), a)
        q = b / a_safe
        denom = a * xp.sqrt(1 + q * q)
    else:
        denom = rms + plan.eps
    return 1 / denom


def rstd(x2, plan: Plan):
    """Per-row ``rstd`` of 2-D ``x2`` in the compute dtype."""
    xp = _xp(x2)
    v = xp.astype(x2, namespace_dtype(xp, plan.compute_dtype, x2), copy=False)
    with _quiet():
        return _rstd(xp, v, plan)


def _quiet():
    """numpy's divide/invalid/overflow warnings off: rstd = 1/0 = inf for an all-zero
    token with eps=0 is a documented result (NaN output), as in torch; the
    plain sum of squares overflowing is how ``_rms`` finds the rows to scale."""
    import numpy as np

    return np.errstate(divide="ignore", invalid="ignore", over="ignore")


def _affine(xp, xhat, x, weight, bias, plan: Plan, cdt):
    """``xhat * (weight + offset) + bias`` in the compute dtype ``cdt``, in the
    plan's casting order (llama: ``xhat`` rounded to ``x``'s dtype, the product
    in ``promote(x, weight)``)."""
    if plan.llama:
        xhat = xp.astype(xhat, x.dtype)
        if weight is not None:
            pdt = namespace_dtype(xp, promote(plan.norm_dtype, _name(weight)), x)
            g = xp.astype(weight + plan.offset, weight.dtype)
            y = xp.astype(xp.astype(xhat, pdt) * xp.astype(g, pdt), cdt)
        else:
            y = xp.astype(xhat, cdt)
    else:
        y = xhat if weight is None else xhat * (xp.astype(weight, cdt) + plan.offset)
    if bias is not None:
        y = y + xp.astype(bias, cdt)
    return y


def forward(x, residual, weight, bias, plan: Plan, out=None):
    """Forward on 2-D rows.

    Parameters
    ----------
    x, residual : array, shape (n, d)
        ``residual`` is ``None`` for plain rms_norm; otherwise the normalized
        input is ``h = x + residual``, rounded to ``plan.norm_dtype``.
    weight, bias : array, shape (d,), or None
    plan : Plan
    out : array, shape (n, d), or None
        Ignored here: the front end copies into ``out`` for this backend.

    Returns
    -------
    y : array (n, d) of ``plan.out_dtype``
    h : array (n, d) of ``plan.norm_dtype``, or None
    rstd : array (n,) of ``plan.compute_dtype``
    """
    with _quiet():
        return _forward(x, residual, weight, bias, plan)


def _forward(x, residual, weight, bias, plan: Plan):
    # astype(copy=False) throughout: a same-dtype cast is the array itself (nothing here
    # writes into an array), not a copy, a full pass saved per cast
    xp = _xp(x)
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    h = None
    if residual is not None:
        h = xp.astype(
            xp.astype(x, cdt, copy=False) + xp.astype(residual, cdt, copy=False),
            namespace_dtype(xp, plan.norm_dtype, x),
            copy=False,
        )
        x = h
    if plan.cast_none:
        y, r = _none_forward(xp, x, weight, bias, plan)
        return xp.astype(y, namespace_dtype(xp, plan.out_dtype, x), copy=False), h, r
    v = xp.astype(x, cdt, copy=False)
    r = _rstd(xp, v, plan, x)
    xhat = v * r[:, None]
    y = _affine(xp, xhat, x, weight, bias, plan, cdt)
    y = xp.astype(y, namespace_dtype(xp, plan.out_dtype, x), copy=False)
    return y, h, r


def _name(a) -> str:
    from polynorm.core.dtypes import dtype_name

    return dtype_name(a.dtype)


def backward(dy, x, weight, bias, rstd, grad_residual, plan: Plan, out=None):
    """Hand-written backward on 2-D rows (formula in :mod:`polynorm.core.options`).

    Returns
    -------
    dx : array (n, d) of ``x``'s dtype
    dweight : array (d,) of ``weight``'s dtype, or None
    dbias : array (d,) of ``bias``'s dtype, or None

    ``out`` is not written here: the front end copies ``dx`` into it.
    """
    with _quiet():
        return _backward(dy, x, weight, bias, rstd, grad_residual, plan)


def _backward(dy, x, weight, bias, rstd, grad_residual, plan: Plan):
    xp = _xp(x)
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    v = xp.astype(x, cdt, copy=False)
    g_dy = xp.astype(dy, cdt, copy=False)
    dyc = g_dy
    need_rms = rstd is None or not plan.eps_inside
    rms = _rms(xp, v, plan, x) if need_rms else None
    if rstd is None and plan.cast_none:
        rstd = none_rstd(xp, x, plan)
    r = _rstd_from_rms(xp, rms, plan) if rstd is None else xp.astype(rstd, cdt)
    xhat = v * r[:, None]
    wo = None if weight is None else xp.astype(weight, cdt) + plan.offset
    if wo is not None:
        g_dy = g_dy * wo
    hook = ROW_DOTS.get(type(x)) if ROW_DOTS else None
    c = None if hook is None else hook(dy, x, r, wo)
    if c is None:
        c = _row_sum(xp, _c_rows(g_dy * xhat))
    coef = c / plan.k
    if not plan.eps_inside:
        # alpha = (s + eps) / s; the whole term is zero where s == 0 (x is zero there)
        s_safe = xp.where(rms == 0, xp.ones_like(rms), rms)
        coef = xp.where(rms == 0, xp.zeros_like(coef), coef * ((rms + plan.eps) / s_safe))
    rc = r[:, None]
    if plan.k == plan.d:
        dx = rc * (g_dy - xhat * coef[:, None])
    else:
        # beyond k the term is xhat * 0, not left out: a token whose rstd is
        # inf (all zero over k with eps=0) or whose x is non-finite gets NaN
        # there, as in the compiled kernels, not rstd * g * dy = +-inf
        k = plan.k
        head = rc * (g_dy[:, :k] - xhat[:, :k] * coef[:, None])
        tail = rc * (g_dy[:, k:] - xhat[:, k:] * xp.zeros_like(coef)[:, None])
        dx = xp.concat([head, tail], axis=1)
    if grad_residual is not None:
        dx = dx + xp.astype(grad_residual, cdt)
    dx = xp.astype(dx, x.dtype, copy=False)
    dweight = None if weight is None else xp.astype(xp.sum(dyc * xhat, axis=0), weight.dtype)
    dbias = None if bias is None else xp.astype(xp.sum(dyc, axis=0), bias.dtype)
    return dx, dweight, dbias


# --------------------------------------------------------------------------- casting="none"


def _to_t(xp, a, tdt, cdt):
    """``a`` rounded to the dtype ``tdt`` and held in ``cdt`` (exact)."""
    return xp.astype(xp.astype(a, tdt, copy=False), cdt, copy=False)


def _scalar_in(name: str, value: float) -> float:
    """A Python float rounded to the float dtype ``name`` (Liger's ``eps.to(X_row_dtype)``)."""
    import numpy as np

    from polynorm.core.dtypes import numpy_dtype

    return float(np.asarray(value, dtype=numpy_dtype(name)))


def none_rstd(xp, x, plan: Plan):
    """``rstd`` of ``casting="none"`` (:data:`polynorm.core.options.NONE_CASTING`) per row
    of ``x`` (dtype ``plan.norm_dtype``), a ``T`` value in the compute dtype."""
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    tdt = namespace_dtype(xp, plan.norm_dtype, x)
    v = xp.astype(x, cdt, copy=False)
    vk = _c_rows(v if plan.k == plan.d else v[:, : plan.k])
    with _quiet():
        sq = _to_t(xp, vk * vk, tdt, cdt)
        ms = _to_t(xp, _row_sum(xp, sq) / plan.k, tdt, cdt)
        eps = _scalar_in(plan.norm_dtype, plan.eps)
        if plan.eps_inside:
            denom = xp.sqrt(_to_t(xp, ms + eps, tdt, cdt))
        else:
            denom = _to_t(xp, _to_t(xp, xp.sqrt(ms), tdt, cdt) + eps, tdt, cdt)
        return _to_t(xp, 1 / denom, tdt, cdt)


def _none_forward(xp, x, weight, bias, plan: Plan):
    """``(y in its last dtype before the output rounding, rstd)`` of ``casting="none"``."""
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    tdt = namespace_dtype(xp, plan.norm_dtype, x)
    r = none_rstd(xp, x, plan)
    xhat = _to_t(xp, xp.astype(x, cdt, copy=False) * r[:, None], tdt, cdt)
    last = plan.norm_dtype
    y = xhat
    # each product and sum in the compute dtype of its result's dtype (float64 for a
    # float64 weight or bias), rounded once to that dtype
    if weight is not None:
        last = promote(plan.norm_dtype, _name(weight))
        wdt = namespace_dtype(xp, compute_dtype(last), x)
        off = _scalar_in(plan.norm_dtype, plan.offset)
        g = _to_t(xp, xp.astype(weight, wdt) + off, namespace_dtype(xp, last, x), wdt)
        y = _to_t(xp, xp.astype(y, wdt) * g, namespace_dtype(xp, last, x), wdt)
    if bias is not None:
        last = promote(last, _name(bias))
        bdt = namespace_dtype(xp, compute_dtype(last), x)
        y = _to_t(xp, xp.astype(y, bdt) + xp.astype(bias, bdt), namespace_dtype(xp, last, x),
                  bdt)
    return y, r


# --------------------------------------------------------------------------- gated RMSNorm
# The statistic of each group is the plain norm's on rows of ``group_size``:
# the (n, d) rows are viewed as (n * groups, group_size) for it, and the
# group plan is the plan of those rows (same eps, k of the group).


def _group_plan(gplan):
    from dataclasses import replace

    p = gplan.plan
    return p if gplan.groups == 1 else replace(p, d=gplan.group_size, k=gplan.group_size)


def _silu(xp, zc):
    """``z / (1 + exp(-z))`` and its derivative ``sig * (1 + z * (1 - sig))``."""
    sig = 1 / (1 + xp.exp(-zc))
    return zc / (1 + xp.exp(-zc)), sig * (1 + zc * (1 - sig))


def _by_group(xp, a, gplan):
    return xp.reshape(a, (a.shape[0] * gplan.groups, gplan.group_size))


def _gated_rstd(xp, v, gplan):
    gp = _group_plan(gplan)
    return _rstd(xp, _by_group(xp, v, gplan), gp), gp


def gated_forward(x, z, weight, bias, gplan, out=None):
    """Gated forward on 2-D rows (:class:`polynorm.core.options.GatedPlan`).

    Returns ``(y, rstd)``: ``y`` (n, d) of ``plan.out_dtype``, ``rstd``
    (n, groups) of the compute dtype.  ``out`` is ignored (the front end
    copies into it).
    """
    with _quiet():
        return _gated_forward(x, z, weight, bias, gplan)


def _gated_forward(x, z, weight, bias, gplan):
    xp = _xp(x)
    plan = gplan.plan
    n, d = x.shape
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    s, _ = _silu(xp, xp.astype(z, cdt))
    v = xp.astype(x, cdt, copy=False)
    if not gplan.norm_before_gate:
        v = v * s
    r, _ = _gated_rstd(xp, v, gplan)
    xhat = xp.reshape(_by_group(xp, v, gplan) * r[:, None], (n, d))
    y = _affine(xp, xhat, x, weight, bias, plan, cdt)
    if gplan.norm_before_gate:
        y = y * s
    y = xp.astype(y, namespace_dtype(xp, plan.out_dtype, x), copy=False)
    return y, xp.reshape(r, (n, gplan.groups))


def gated_backward(dy, x, z, weight, bias, rstd, gplan):
    """Hand-written gated backward on 2-D rows; ``rstd`` is (n, groups) or None.

    Returns ``(dx, dz, dweight, dbias)`` in the dtypes of x, z, weight, bias.
    """
    with _quiet():
        return _gated_backward(dy, x, z, weight, bias, rstd, gplan)


def _gated_backward(dy, x, z, weight, bias, rstd, gplan):
    xp = _xp(x)
    plan = gplan.plan
    n, d = x.shape
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    zc = xp.astype(z, cdt)
    s, ds = _silu(xp, zc)
    xc = xp.astype(x, cdt, copy=False)
    dyc = xp.astype(dy, cdt, copy=False)
    v = xc if gplan.norm_before_gate else xc * s
    gp = _group_plan(gplan)
    vg = _by_group(xp, v, gplan)
    need_rms = rstd is None or not plan.eps_inside
    rms = _rms(xp, vg, gp) if need_rms else None
    r = _rstd_from_rms(xp, rms, gp) if rstd is None else xp.reshape(xp.astype(rstd, cdt), (-1,))
    xhat = xp.reshape(vg * r[:, None], (n, d))
    gw = None if weight is None else xp.astype(weight, cdt) + plan.offset
    dn = dyc * s if gplan.norm_before_gate else dyc  # gradient reaching the norm's output
    g_dy = dn if gw is None else dn * gw
    c = _row_sum(xp, _c_rows(_by_group(xp, g_dy * xhat, gplan)))
    coef = c / gp.k
    if not plan.eps_inside:
        s_safe = xp.where(rms == 0, xp.ones_like(rms), rms)
        coef = xp.where(rms == 0, xp.zeros_like(coef), coef * ((rms + plan.eps) / s_safe))
    rc = r[:, None]
    gg, xg = _by_group(xp, g_dy, gplan), _by_group(xp, xhat, gplan)
    if gp.k == gp.d:
        dv = rc * (gg - xg * coef[:, None])
    else:
        k = gp.k
        head = rc * (gg[:, :k] - xg[:, :k] * coef[:, None])
        tail = rc * (gg[:, k:] - xg[:, k:] * xp.zeros_like(coef)[:, None])
        dv = xp.concat([head, tail], axis=1)
    dv = xp.reshape(dv, (n, d))
    if gplan.norm_before_gate:
        dx = dv
        pre = xhat if gw is None else xhat * gw
        if bias is not None:
            pre = pre + xp.astype(bias, cdt)
        dz = dyc * pre * ds
    else:
        dx = dv * s
        dz = dv * xc * ds
    dweight = None if weight is None else xp.astype(xp.sum(dn * xhat, axis=0), weight.dtype)
    dbias = None if bias is None else xp.astype(xp.sum(dn, axis=0), bias.dtype)
    return xp.astype(dx, x.dtype, copy=False), xp.astype(dz, z.dtype, copy=False), dweight, dbias


# --------------------------------------------------------------------------- quantized output


def quant_dtype(xp, name: str, like):
    """The namespace's dtype object for a quantized format (``TypeError`` where it has none)."""
    if name == "int8":
        return xp.int8
    dt = getattr(xp, name, None)
    if dt is not None:
        return dt
    module = type(like).__module__.split(".")[0]
    if module == "torch":
        import torch

        return getattr(torch, name)
    if module in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return getattr(jnp, name)
    if module in ("numpy", "dask"):
        import ml_dtypes

        return getattr(ml_dtypes, name)
    raise TypeError(f"dtype={name!r}: the array library {xp.__name__} has no {name} dtype")


def quantize(xp, y, qplan, scale=None):
    """``(q, scales)`` of float32 rows ``y`` (n, d) by :class:`polynorm.core.options.QuantPlan`.

    ``scale``: the static scale as an array (one element) when the plan has
    no float; ``scales`` is (n, groups) float32 for dynamic scales, else the
    static scale as a 0-d float32 array.
    """
    with _quiet():
        return _quantize(xp, y, qplan, scale)


def _quantize(xp, y, qplan, scale):
    n, d = y.shape
    f32 = y.dtype
    if qplan.static:
        if scale is None:
            s = xp.asarray(qplan.scale, dtype=f32, device=_device(y))
        else:
            s = xp.reshape(xp.astype(scale, f32), ())
        v = _apply_scale(xp, y, s, qplan)
        scales = s
    else:
        from polynorm.core.options import SCALE_FLOOR

        yg = xp.reshape(y, (n, qplan.groups, qplan.group_size))
        amax = xp.max(xp.abs(yg), axis=2)
        s = amax / qplan.qmax
        # "s < floor" is False for NaN: a NaN token keeps a NaN scale
        s = xp.where(s < SCALE_FLOOR, xp.ones_like(s), s)
        v = xp.reshape(_apply_scale(xp, yg, s[:, :, None], qplan), (n, d))
        scales = s
    v = xp.clip(v, qplan.lo, qplan.hi)
    if qplan.qdtype == "int8":
        v = xp.round(xp.where(xp.isnan(v), xp.zeros_like(v), v))
    return xp.astype(v, quant_dtype(xp, qplan.qdtype, y)), scales


def _apply_scale(xp, y, s, qplan):
    """``y / s`` ("divide") or ``y * (1 / s)`` with the reciprocal a float32
    ("reciprocal", vLLM's and FlashInfer's kernels): two roundings, so at a
    midpoint of the format the quotient may land one step apart."""
    if qplan.reciprocal:
        return y * (xp.ones_like(s) / s)
    return y / s


def _device(a):
    from array_api_compat import device

    return device(a)


def quant_forward(x, residual, weight, bias, qplan, scale=None):
    """Quantized forward on 2-D rows: ``(q, scales, h)``.

    ``y`` is :func:`forward`'s float32 result for ``qplan.plan``, then
    :func:`quantize`; ``h`` is ``None`` without a residual.
    """
    y, h, _ = forward(x, residual, weight, bias, qplan.plan)
    q, scales = quantize(_xp(x), y, qplan, scale)
    return q, scales, h


# --------------------------------------------------------------------------- split hidden axis
# One row's ``d`` elements lie in shards (tensor-parallel ranks, dask chunks); each shard
# sums its squares (``split_stats``), the caller adds the shards' sums (an all-reduce),
# and every shard normalizes its own elements with the total (``split_forward``).  The
# backward's per-row coefficient ``c = sum_j (g*dy*xhat)_j`` is summed the same way
# (``split_dot``, then ``split_backward``).  The sums are float64 (the stat dtype,
# :func:`stat_dtype`): float32 and 16-bit squares neither overflow nor underflow there.


def stat_dtype(xp, like) -> Any:
    """The dtype of a shard's sums: float64, or the compute dtype where the library runs
    without float64 (jax without ``jax_enable_x64``)."""
    if type(like).__module__.split(".")[0] in ("jax", "jaxlib"):
        import jax

        if not jax.config.jax_enable_x64:
            return namespace_dtype(xp, "float32", like)
    return namespace_dtype(xp, "float64", like)


def split_rstd(xp, sumsq, k_total: int, plan: Plan):
    """``rstd`` from the whole row's sum of squares, in the stat dtype (the formula of the
    Numba kernels' in-range branch, ``numba.kernels._rms_rstd``)."""
    ms = sumsq / k_total
    with _quiet():
        if plan.eps_inside:
            return 1 / xp.sqrt(ms + plan.eps)
        return 1 / (xp.sqrt(ms) + plan.eps)


def split_stats(x, plan: Plan):
    """Per-row sum of squares of 2-D ``x`` in the stat dtype (one shard's part)."""
    xp = _xp(x)
    v = _c_rows(xp.astype(x, stat_dtype(xp, x)))
    with _quiet():
        return _row_sum(xp, v, square=True)


def split_forward(x, weight, bias, sumsq, k_total: int, plan: Plan):
    """``(y, rstd)`` of one shard's 2-D rows from the whole rows' ``sumsq`` (n,)."""
    xp = _xp(x)
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    with _quiet():
        r = xp.astype(split_rstd(xp, sumsq, k_total, plan), cdt)
        xhat = xp.astype(x, cdt, copy=False) * r[:, None]
        y = _affine(xp, xhat, x, weight, bias, plan, cdt)
    return xp.astype(y, namespace_dtype(xp, plan.out_dtype, x), copy=False), r


def _split_terms(dy, x, weight, sumsq, k_total: int, plan: Plan):
    xp = _xp(x)
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    r = xp.astype(split_rstd(xp, sumsq, k_total, plan), cdt)
    dyc = xp.astype(dy, cdt, copy=False)
    g_dy = dyc if weight is None else dyc * (xp.astype(weight, cdt) + plan.offset)
    xhat = xp.astype(x, cdt, copy=False) * r[:, None]
    return xp, cdt, r, dyc, g_dy, xhat


def split_dot(dy, x, weight, sumsq, k_total: int, plan: Plan):
    """One shard's part of the backward's ``c = sum_j (g*dy*xhat)_j`` per row, in the
    stat dtype."""
    with _quiet():
        xp, _, _, _, g_dy, xhat = _split_terms(dy, x, weight, sumsq, k_total, plan)
        return _row_sum(xp, _c_rows(xp.astype(g_dy * xhat, stat_dtype(xp, x))))


def split_backward(dy, x, weight, bias, sumsq, dot, k_total: int, plan: Plan):
    """``(dx, dweight, dbias)`` of one shard from the whole rows' ``sumsq`` and ``dot``
    (the shards' :func:`split_dot` summed): the formula of :func:`backward` with ``c``
    and ``k`` of the whole row; dweight/dbias are this shard's columns."""
    with _quiet():
        xp, cdt, r, dyc, g_dy, xhat = _split_terms(dy, x, weight, sumsq, k_total, plan)
        coef = dot / k_total
        if not plan.eps_inside:
            rms = xp.sqrt(sumsq / k_total)
            s_safe = xp.where(rms == 0, xp.ones_like(rms), rms)
            coef = xp.where(rms == 0, xp.zeros_like(coef), coef * ((rms + plan.eps) / s_safe))
        dx = r[:, None] * (g_dy - xhat * xp.astype(coef, cdt)[:, None])
        dx = xp.astype(dx, x.dtype, copy=False)
        dweight = None if weight is None else xp.astype(xp.sum(dyc * xhat, axis=0), weight.dtype)
        dbias = None if bias is None else xp.astype(xp.sum(dyc, axis=0), bias.dtype)
    return dx, dweight, dbias


# --------------------------------------------------------------------------- QK-norm (+ RoPE)


def rope_rotate(xp, v, cs, neox: bool, inverse: bool = False):
    """RoPE of the first ``rot = cs.shape[1]`` columns of ``v`` (``(T, H, D)``, compute
    dtype); the other columns pass through.  ``cs``: ``(T, rot)`` rows ``[cos | sin]``
    of each token (vLLM's ``cos_sin_cache`` rows), in ``v``'s dtype.

    NeoX pairs column ``i`` with ``i + rot/2``, GPT-J ``2i`` with ``2i + 1``; each pair
    ``(a, b)`` becomes ``(a*cos - b*sin, b*cos + a*sin)``, each product and sum rounded
    in ``v``'s dtype.  ``inverse``: the transposed rotation (``sin`` negated, which
    is exact), the backward.
    """
    rot = cs.shape[1]
    half = rot // 2
    c = cs[:, None, :half]
    s = cs[:, None, half:]
    if inverse:
        s = -s
    if neox:
        a, b = v[:, :, :half], v[:, :, half:rot]
    else:
        a, b = v[:, :, 0:rot:2], v[:, :, 1:rot:2]
    o1 = a * c - b * s
    o2 = b * c + a * s
    if neox:
        r = xp.concat([o1, o2], axis=2)
    else:
        t, h = v.shape[0], v.shape[1]
        r = xp.reshape(xp.stack([o1, o2], axis=3), (t, h, rot))
    if rot == v.shape[2]:
        return r
    return xp.concat([r, v[:, :, rot:]], axis=2)


def qk_forward(x, weight, plan: Plan, rope, out=None):
    """QK-norm of the heads ``x`` (``(T, H, D)``): each ``(t, h)`` row is
    :func:`forward`'s row (the same bits as ``rms_norm``), then, with ``rope = (cs, neox)``
    (:func:`rope_rotate`), rotated in the compute dtype from those rounded values and
    rounded once more to the output dtype.  Returns the new heads; ``out`` is
    ignored (the front end writes into the caller's array)."""
    xp = _xp(x)
    t, h, d = x.shape
    y, _, _ = forward(xp.reshape(x, (t * h, d)), None, weight, None, plan)
    y = xp.reshape(y, (t, h, d))
    if rope is None:
        return y
    cs, neox = rope
    cdt = namespace_dtype(xp, plan.compute_dtype, x)
    v = rope_rotate(xp, xp.astype(y, cdt), cs, neox)
    return xp.astype(v, namespace_dtype(xp, plan.out_dtype, x), copy=False)


# --------------------------------------------------------------------------- eager numpy / torch
# :func:`forward` without a residual, for C-contiguous numpy arrays and torch CPU tensors, in
# fewer library calls and passes over memory, with its bits: every step is the same operation
# of the library on the same values (IEEE-rounded products, quotients, square roots, and the
# library's own row sums over the same contiguous rows), only grouped differently.  Large
# calls go in blocks of rows whose buffers stay in cache (x read from memory once, y written
# once).  The per-row ``rstd`` comes from the row sums by numpy calls on them (torch's
# ``ss / k``, ``sqrt``, ``*`` and ``/`` give the same IEEE-rounded float32 results), a lone
# token's by numpy scalar arithmetic (NEP 50: a numpy scalar computes as an array of its
# dtype does) rather than a dozen calls on arrays of one element.  A block with a row that
# needs the scaled sum (``_rms``'s ``ok``) runs ``_rms`` and ``_rstd_from_rms`` themselves.

#: elements per block of rows (its float32 buffers stay in a core's L2); a block has at least
#: two rows but for a lone token: torch splits a sum over one row of 32768 or more elements
#: across threads, and a token's bits would then depend on the blocking
EAGER_BLOCK = 1 << 18

#: numpy dtype -> (smallest_normal / eps, max) of its finfo, as floats
_FINFO: dict = {}


def eager_forward(x, weight, bias, plan: Plan, want_rstd: bool = True):
    """``(y, rstd)`` of :func:`forward` without a residual, or ``None`` for a call it does
    not take (the caller runs :func:`forward`).

    It takes a C-contiguous 2-D ``x`` of one or more tokens, a numpy array or a torch CPU
    tensor, ``weight``/``bias`` ``None`` or contiguous 1-D arrays of the same library and
    device, and a ``plan`` of the default or ``"fp32"`` casting; torch records no autograd
    history here only where the caller says so (``torch.no_grad``).  ``rstd`` is ``None``
    unless ``want_rstd``.

    >>> import numpy as np
    >>> from polynorm.core.options import Options, make_plan
    >>> x = np.array([[3.0, 4.0]], dtype=np.float32)
    >>> eager_forward(x, None, None, make_plan(2, "float32", Options(eps=0.0)))
    (array([[0.84852815, 1.1313709 ]], dtype=float32), array([0.28284273], dtype=float32))
    """
    if plan.llama or plan.cast_none or plan.k < 1 or x.ndim != 2 or x.shape[0] < 1:
        return None
    lib = type(x).__module__
    if lib == "numpy" and x.flags.c_contiguous:
        return eager_numpy(x, weight, bias, plan, want_rstd)
    if lib == "torch" and x.is_cpu and x.is_contiguous():
        return eager_torch(x, weight, bias, plan, want_rstd)
    return None


def _eager_numpy(x, weight, bias, plan: Plan, want_rstd: bool = True):
    """:func:`eager_forward` of a numpy ``x`` that meets its conditions (unchecked); its
    error state is :func:`_quiet`'s (:data:`eager_numpy`)."""
    if x.shape[0] != 1:
        return _eager_np(x, weight, bias, plan, want_rstd)
    # one token, the call a decoding loop makes: the steps of _eager_rstd1 spelled out (as
    # in eager_torch), the array of its sum of squares becoming its rstd
    import numpy as np

    (_, cdt, odt, offset, full, k, lo, hi, inside, eps, se, se_t, one) = _np_spec(plan)
    own = x.dtype != cdt  # v is a new array, which y may overwrite
    v = x if not own else (_widen_f16(np, x) if x.dtype == _F16[0] else x.astype(cdt))
    vk = v if full else v[:, :k]
    ss = np.add.reduce(vk * vk, axis=1)
    s = ss[0]  # a numpy scalar: its arithmetic is the arrays' (NEP 50), on one element
    if s >= lo and s <= hi:
        rms = np.sqrt(s / k)
        if inside:
            a, c = (rms, se_t) if rms > se else (se_t, rms)
            q = c / (one if a == 0 else a)
            ss[0] = 1 / (a * np.sqrt(1 + q * q))
        else:
            ss[0] = 1 / (rms + eps)
    else:
        ss = _eager_general(v, plan)
    if own:
        y = v
        y *= ss  # (1, d) times (1,): the token times its rstd
    else:
        y = v * ss
    if weight is not None:
        if weight.dtype != cdt:
            weight = weight.astype(cdt)
        y *= weight if offset is None else weight + offset
    if bias is not None:
        y += bias if bias.dtype == cdt else bias.astype(cdt)
    if odt is not None:
        y = y.astype(odt)
    return y, (ss if want_rstd else None)


def _widen_f16(np, x, out=None):
    """float16 ``x`` as float32, by a table of the 65536 float16 values cast by numpy: the
    values of ``x.astype(float32)`` (whose cast loop takes twice as long)."""
    if not _F16_TABLE:
        _F16_TABLE.extend([np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32),
                           np.dtype(np.uint16)])
    if out is None:
        return _F16_TABLE[0].take(x.view(_F16_TABLE[1]))
    # every uint16 is an index of the table: "clip" clips nothing, and writes out unbuffered
    return _F16_TABLE[0].take(x.view(_F16_TABLE[1]), None, out, "clip")


_F16_TABLE: list = []


def _quiet_np(f):
    """``f`` run in :func:`_quiet`'s error state, by ``np.errstate``'s decorator form (the
    same state, entered for half the context manager's cost)."""
    import numpy as np

    return np.errstate(divide="ignore", invalid="ignore", over="ignore")(f)


#: :func:`_eager_numpy` in :func:`_quiet`'s error state
eager_numpy = _quiet_np(_eager_numpy)


def _np_dtypes() -> tuple:
    import numpy as np

    return (np.dtype(np.float16),), (np.dtype(np.float32),)


_F16, _F32 = _np_dtypes()


def _np_spec(plan: Plan) -> tuple:
    """What :func:`_eager_numpy` reads of ``plan``, resolved once per plan (``odt``: None
    where y is made in its dtype)."""
    e = _SPECS_NP.get(id(plan))
    if e is not None and e[0] is plan:
        return e
    import numpy as np

    from polynorm.core.dtypes import numpy_dtype

    cdt = numpy_dtype(plan.compute_dtype)
    t = cdt.type
    lo, hi = _eager_bounds(np, t, plan.k)
    se = math.sqrt(plan.eps)
    zero_offset = plan.offset == 0.0 and math.copysign(1.0, plan.offset) < 0
    # the plan itself is held: its id is not reused while the entry lives
    odt = None if plan.out_dtype == plan.compute_dtype else numpy_dtype(plan.out_dtype)
    e = (plan, cdt, odt, None if zero_offset else plan.offset,
         plan.k == plan.d, plan.k, lo, hi, plan.eps_inside, plan.eps, se, t(se), t(1))
    if len(_SPECS_NP) >= 256:
        _SPECS_NP.clear()
    _SPECS_NP[id(plan)] = e
    return e


#: id(plan) -> the plan and what _eager_numpy reads of it
_SPECS_NP: dict = {}


def eager_torch(x, weight, bias, plan: Plan, want_rstd: bool = True):
    """:func:`eager_forward` of a torch ``x`` that meets its conditions (unchecked).  numpy
    sees only the sums of rows whose plain sum is kept: no floating-point warnings."""
    if x.shape[0] != 1:
        return _eager_torch(x, weight, bias, plan, want_rstd)
    # one token, the call a decoding loop makes: its sum of squares ``ss`` (one element)
    # becomes its rstd in place, torch's sqrt_ on it and numpy's scalar arithmetic (on
    # ss's memory) between; the steps of _eager_rstd1, spelled out for the calls saved
    sp = _SPECS.get(id(plan))
    if sp is None or sp[0] is not plan:
        sp = _torch_spec(plan)
    (_, cdt, odt, cast, cast_out, offset, full, k, lo, hi, inside, eps, se, se_t, one,
     vecdot) = sp
    v = x if x.dtype == cdt else cast(x)
    # linalg.vecdot is ``(v * v).sum(-1)`` in one call: the same products, the same sum
    ss = vecdot(v, v) if full else vecdot(v[:, :k], v[:, :k])
    b = ss.numpy()
    s = b[0]
    if s >= lo and s <= hi:
        b[0] = s / k
        ss.sqrt_()
        rms = b[0]
        if inside:
            a, c = (rms, se_t) if rms > se else (se_t, rms)
            q = c / (one if a == 0 else a)
            b[0] = 1 + q * q
            ss.sqrt_()
            b[0] = 1 / (a * b[0])
        else:
            b[0] = 1 / (rms + eps)
    else:
        ss = _eager_general(v, plan)
    if v is x:
        y = v * ss  # (1, d) times (1,): the token times its rstd
    else:
        y = v.mul_(ss)  # v is this call's own copy
    if weight is not None:
        if weight.dtype != cdt:
            weight = cast(weight)
        y *= weight if offset is None else weight + offset
    if bias is not None:
        y += bias if bias.dtype == cdt else cast(bias)
    if cast_out is not None:
        y = cast_out(y)  # .to()'s rounding, by the method (no argument parsing)
    return y, (ss if want_rstd else None)


def _torch_dtypes(torch) -> None:
    _TORCH_DT.update({name: getattr(torch, name)
                      for name in ("float16", "bfloat16", "float32", "float64")})
    _TORCH_CAST.update({"float16": torch.Tensor.half, "bfloat16": torch.Tensor.bfloat16,
                        "float32": torch.Tensor.float, "float64": torch.Tensor.double})


def _torch_spec(plan: Plan) -> tuple:
    """What :func:`eager_torch` reads of ``plan``, resolved once per plan."""
    e = _SPECS.get(id(plan))
    if e is not None and e[0] is plan:
        return e
    import numpy as np
    import torch

    if not _TORCH_DT:
        _torch_dtypes(torch)
    t = np.float64 if plan.compute_dtype == "float64" else np.float32
    lo, hi = _eager_bounds(np, t, plan.k)
    se = math.sqrt(plan.eps)
    zero_offset = plan.offset == 0.0 and math.copysign(1.0, plan.offset) < 0
    # the plan itself is held: its id is not reused while the entry lives
    e = (plan, _TORCH_DT[plan.compute_dtype], _TORCH_DT[plan.out_dtype],
         _TORCH_CAST[plan.compute_dtype],
         None if plan.out_dtype == plan.compute_dtype else _TORCH_CAST[plan.out_dtype],
         None if zero_offset else plan.offset, plan.k == plan.d, plan.k, lo, hi,
         plan.eps_inside, plan.eps, se, t(se), t(1), torch.linalg.vecdot)
    if len(_SPECS) >= 256:
        _SPECS.clear()
    _SPECS[id(plan)] = e
    return e


#: id(plan) -> the plan and what the eager paths read of it
_SPECS: dict = {}


def _eager_blocks(n: int, d: int) -> list:
    """``(start, stop)`` of each block of rows, each of at least two rows."""
    rows = max(2, EAGER_BLOCK // d)
    count = max(1, n // rows)
    return [(n * b // count, n * (b + 1) // count) for b in range(count)]


def _eager_gain(g, plan: Plan):
    """``weight + offset`` from ``g``, the weight in the compute dtype, as :func:`_affine`
    forms it (a ``-0.0`` offset changes no value, so it is not added)."""
    if g is None or (plan.offset == 0.0 and math.copysign(1.0, plan.offset) < 0):
        return g
    return g + plan.offset


def _eager_bounds(np, t, k: int) -> tuple[float, float]:
    """``_rms``'s bounds of a plain sum of squares of ``k`` elements of numpy type ``t``."""
    fi = _FINFO.get(t)
    if fi is None:
        f = np.finfo(t)
        fi = _FINFO[t] = (float(f.smallest_normal) / float(f.eps), float(f.max))
    return k * fi[0], fi[1]


def _eager_rstd1(np, s, plan: Plan, sqrt):
    """One row's ``rstd`` from its sum of squares ``s`` (a numpy scalar of the compute
    dtype) as :func:`_rms`'s plain branch and :func:`_rstd_from_rms` compute it, or None
    where the row needs the scaled sum; ``sqrt``: the library's square root of a scalar."""
    t = type(s)
    c = _CONST1.get(id(plan))
    if c is None or c[0] is not plan or c[1] is not t:
        lo, hi = _eager_bounds(np, t, plan.k)
        se = math.sqrt(plan.eps)
        if len(_CONST1) > 256:
            _CONST1.clear()
        # the plan itself is held: its id is not reused while the entry lives
        c = _CONST1[id(plan)] = (plan, t, lo, hi, se, t(se), t(1), plan.k, plan.eps_inside,
                                 plan.eps)
    if not (s >= c[2] and s <= c[3]):
        return None
    rms = sqrt(s / c[7])
    if not c[8]:
        return 1 / (rms + c[9])
    a, b = (rms, c[5]) if rms > c[4] else (c[5], rms)
    q = b / (c[6] if a == 0 else a)
    return 1 / (a * sqrt(1 + q * q))


#: id(plan) -> (plan, numpy type, bounds, sqrt(eps), it and 1 in the type, k, eps_inside, eps)
_CONST1: dict = {}


def _eager_rstd(np, ss, out, plan: Plan, sqrt_) -> bool:
    """Each row's ``rstd`` from its sums of squares ``ss`` (numpy, compute dtype) into
    ``out``, as :func:`_eager_rstd1` for each; False where some row needs the scaled sum
    (``out`` untouched).  ``sqrt_``: the library's square root, in place."""
    lo, hi = _eager_bounds(np, ss.dtype.type, plan.k)
    if not bool(((ss >= lo) & (ss <= hi)).all()):
        return False
    rms = sqrt_(ss / plan.k)
    if plan.eps_inside:
        t = ss.dtype.type
        se = math.sqrt(plan.eps)
        se_t = t(se)
        c = rms > se
        a = np.where(c, rms, se_t)
        q = np.where(c, se_t, rms)
        np.divide(q, a if se_t != 0 else np.where(a == 0, t(1), a), out=q)
        np.multiply(q, q, out=q)
        np.add(1, q, out=q)
        np.multiply(a, sqrt_(q), out=q)
    else:
        q = rms + plan.eps
    np.divide(1, q, out=out)
    return True


def _np_sqrt_(a):
    import numpy as np

    return np.sqrt(a, out=a)


def _torch_sqrt_(a):
    """torch's square root (not numpy's: torch's CPU float32 one is not always the
    correctly rounded one), in place on a numpy array."""
    import torch

    torch.from_numpy(a).sqrt_()
    return a


_NP_DT: dict = {}


def _eager_np(x, weight, bias, plan: Plan, want_rstd: bool):
    import numpy as np

    n, d = x.shape
    k = plan.k
    if not _NP_DT:
        from polynorm.core.dtypes import numpy_dtype

        _NP_DT.update({name: numpy_dtype(name) for name in ("float16", "float32", "float64")})
    cdt = _NP_DT[plan.compute_dtype]
    odt = _NP_DT.get(plan.out_dtype)
    if odt is None:
        from polynorm.core.dtypes import numpy_dtype

        odt = numpy_dtype(plan.out_dtype)
    g = _eager_gain(None if weight is None else weight.astype(cdt, copy=False), plan)
    bc = None if bias is None else bias.astype(cdt, copy=False)
    if n * d <= EAGER_BLOCK or n < 4:
        v = _widen_f16(np, x) if x.dtype == _F16[0] and cdt == _F32[0] else x.astype(
            cdt, copy=False)
        vk = v if k == d else v[:, :k]
        ss = np.add.reduce(vk * vk, axis=1)
        r = np.empty((n,), cdt)
        if n == 1:
            r1 = _eager_rstd1(np, ss[0], plan, np.sqrt)
            if r1 is None:
                r = _eager_general(v, plan)
            else:
                r[0] = r1
        elif not _eager_rstd(np, ss, r, plan, _np_sqrt_):
            r = _eager_general(v, plan)
        y = v * r[:, None]
        if g is not None:
            y *= g
        if bc is not None:
            y += bc
        if odt != cdt:
            y = y.astype(odt)
        return y, (r if want_rstd else None)
    y = np.empty((n, d), odt)
    r = np.empty((n,), cdt)
    blocks = _eager_blocks(n, d)
    top = max(j - i for i, j in blocks)
    sqbuf = np.empty((top, k), cdt)
    vbuf = None if x.dtype == cdt else np.empty((top, d), cdt)
    ybuf = None if odt == cdt else np.empty((top, d), cdt)
    for i, j in blocks:
        nb = j - i
        if vbuf is None:
            vb = x[i:j]
        else:
            vb = vbuf[:nb]
            if x.dtype == _F16[0] and cdt == _F32[0]:
                _widen_f16(np, x[i:j], vb)
            else:
                np.copyto(vb, x[i:j], casting="unsafe")  # a widening: exact, astype's values
        vk = vb if k == d else vb[:, :k]
        rb = r[i:j]
        if not _eager_rstd(np, np.add.reduce(np.multiply(vk, vk, out=sqbuf[:nb]), axis=1),
                           rb, plan, _np_sqrt_):
            rb[...] = _eager_general(vb, plan)
        yb = y[i:j] if ybuf is None else ybuf[:nb]
        np.multiply(vb, rb[:, None], out=yb)
        if g is not None:
            np.multiply(yb, g, out=yb)
        if bc is not None:
            np.add(yb, bc, out=yb)
        if ybuf is not None:
            np.copyto(y[i:j], yb, casting="unsafe")  # astype's rounding
    return y, (r if want_rstd else None)


def _eager_general(v, plan: Plan):
    """``rstd`` of rows ``v`` (compute dtype) by :func:`_rms` and :func:`_rstd_from_rms`."""
    xp = _xp(v)
    return _rstd_from_rms(xp, _rms(xp, v, plan), plan)


_TORCH_DT: dict = {}
#: dtype name -> the Tensor method casting to it (.to()'s rounding, without its parsing)
_TORCH_CAST: dict = {}


def _eager_torch(x, weight, bias, plan: Plan, want_rstd: bool):
    import numpy as np
    import torch

    if not _TORCH_DT:
        _torch_dtypes(torch)
    n, d = x.shape
    k = plan.k
    cdt = _TORCH_DT[plan.compute_dtype]
    odt = _TORCH_DT[plan.out_dtype]
    cast = _TORCH_CAST[plan.compute_dtype]
    g = _eager_gain(None if weight is None else
                    (weight if weight.dtype == cdt else cast(weight)), plan)
    bc = None if bias is None else (bias if bias.dtype == cdt else cast(bias))
    if n * d <= EAGER_BLOCK or n < 4:
        v = x if x.dtype == cdt else x.to(cdt)
        ss = torch.linalg.vecdot(v, v) if k == d else torch.sum(
            torch.mul(v[:, :k], v[:, :k]), 1)
        r2 = torch.empty(n, 1, dtype=cdt)
        if not _eager_rstd(np, ss.numpy(), r2.numpy().reshape(n), plan, _torch_sqrt_):
            r2 = torch.reshape(_eager_general(v, plan), (n, 1))
        y = torch.mul(v, r2)
        if g is not None:
            y.mul_(g)
        if bc is not None:
            y.add_(bc)
        if odt != cdt:
            y = y.to(odt)
        return y, (r2.reshape(n) if want_rstd else None)
    y = torch.empty(n, d, dtype=odt)
    r2 = torch.empty(n, 1, dtype=cdt)
    r_np = r2.numpy().reshape(n)  # the per-row arithmetic on the same memory, by numpy
    blocks = _eager_blocks(n, d)
    top = max(j - i for i, j in blocks)
    sqbuf = torch.empty((top, k), dtype=cdt)
    vbuf = None if x.dtype == cdt else torch.empty((top, d), dtype=cdt)
    ybuf = None if odt == cdt else torch.empty((top, d), dtype=cdt)
    for i, j in blocks:
        nb = j - i
        if vbuf is None:
            vb = x[i:j]
        else:
            vb = vbuf[:nb]
            vb.copy_(x[i:j])  # a widening: exact, .to()'s values
        vk = vb if k == d else vb[:, :k]
        ss = torch.sum(torch.mul(vk, vk, out=sqbuf[:nb]), 1)
        if not _eager_rstd(np, ss.numpy(), r_np[i:j], plan, _torch_sqrt_):
            r2[i:j, 0] = _eager_general(vb, plan)
        yb = y[i:j] if ybuf is None else ybuf[:nb]
        torch.mul(vb, r2[i:j], out=yb)
        if g is not None:
            yb.mul_(g)
        if bc is not None:
            yb.add_(bc)
        if ybuf is not None:
            y[i:j].copy_(yb)  # .to()'s rounding
    return y, (r2.reshape(n) if want_rstd else None)
