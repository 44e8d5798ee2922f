"""The fusion kernels (pn_gated_fwd, pn_gated_bwd, pn_quant_fwd), run on the CPU by the emulator.

Launched as ``polynorm/backends/cupy.py`` launches them (launch rules from
:mod:`polynorm.backends._cuda_launch`, arguments in the ABI order and scalar
types, checked by the harness against the compiled signature), on numpy
buffers; ``test_emul_fusion_backend_glue`` runs the backend's own functions on
the stand-in cupy of test_emul_cupy_backend.py and checks they give these bits.

What is bit for bit, and against what:

* the encoders (pn_e4m3fn, pn_int8) against the reference's clip-and-cast
  (ml_dtypes / numpy round) on every float32 class of value;
* pn_quant_fwd's q, scales and h against the reference's quantization of
  pn_fwd's own float32 y and h (the same row statistic: a segment's sums are
  pn_fwd's), and its scales/q against the Numba backend's given the same y;
* pn_gated_fwd's rstd for ``norm_before_gate=True`` with one group against
  pn_fwd's rstd of x;
* every output of a token alone against the same token in a batch (batch
  invariance) and across block schedules.

Against the reference and Numba backends the values are compared at the
per-dtype tolerances of tests/_oracle.py: their row statistics sum in
another order than pn_fwd's tree (as the plain forward's do), so rstd may
differ in its last bit, and y, q after it.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest
from _oracle import TOL, Tol, assert_close
from test_emul_kernels import NP, _garbage, _rs, emul_forward, module

from polynorm._options import Options, make_gated_plan, make_plan, make_quant_plan
from polynorm.backends import _cuda_launch as cl
from polynorm.backends import reference

DTYPES = ("float16", "bfloat16", "float32", "float64")
_RUN: dict = {"schedule": 0, "workers": None}


def _name(a) -> str | None:
    if a is None:
        return None
    return next(k for k, v in NP.items() if a.dtype == v)


def _as(a, dtype: str | None):
    if a is None or dtype is None or _name(a) == dtype:
        return a
    return a.astype(NP[dtype])


def _launch(launch: cl.Launch, args: tuple, family: str) -> None:
    module(family).launch(launch.name, launch.grid, launch.block, args, launch.shared, **_RUN)


def _gplan(d, dtype, group_size=None, nbg=False, out_dtype=None, **kw):
    plan = make_plan(d, dtype, Options(out_dtype=out_dtype, **kw))
    return make_gated_plan(plan, group_size=group_size, norm_before_gate=nbg)


def _qplan(d, dtype, qdtype="float8_e4m3fn", scale=None, group_size=None, **kw):
    plan = make_plan(d, dtype, Options(out_dtype="float32", **kw))
    return make_quant_plan(plan, qdtype=qdtype, scale=scale, scale_is_array=False,
                           group_size=group_size)


# ----------------------------------------------------------------------------- launchers (cupy.py's packing)


def emul_gated_forward(x, z, w, b, gplan):
    plan = gplan.plan
    xd, ct = _name(x), plan.compute_dtype
    kz, ko = cl.kernel_dtype(xd, _name(z)), cl.kernel_dtype(xd, plan.out_dtype)
    zk, wk, bk = _as(z, kz), _as(w, ct), _as(b, ct)
    n, d = x.shape
    y = _garbage((n, d), ko)
    rstd = _garbage((n, gplan.groups), ct)
    launch = cl.gated_forward_launch(n, d, gplan.group_size, xd, kz, ko)
    args = (x, _rs(x), zk, _rs(zk), wk, bk, y, _rs(y), rstd,
            np.int64(n), np.int32(d), np.int32(gplan.group_size), np.int32(gplan.k),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(gplan.norm_before_gate))
    _launch(launch, args, xd)
    return _as(y, plan.out_dtype), rstd


def emul_gated_backward(dy, x, z, w, b, rstd, gplan):
    from polynorm.backends._numba_gated import tree_sum

    plan = gplan.plan
    xd, zd, ct = _name(x), _name(z), plan.compute_dtype
    kz, kdy = cl.kernel_dtype(xd, zd), cl.kernel_dtype(xd, _name(dy))
    zk, dyk, wk, bk = _as(z, kz), _as(dy, kdy), _as(w, ct), _as(b, ct)
    rk = None if rstd is None else np.ascontiguousarray(_as(rstd, ct))
    n, d = x.shape
    dx, dz = _garbage((n, d), xd), _garbage((n, d), kz)
    lw = _garbage((n, d), ct) if w is not None else None
    lb = _garbage((n, d), ct) if b is not None else None
    launch = cl.gated_backward_launch(n, d, gplan.group_size, xd, kz, kdy)
    args = (dyk, _rs(dyk), x, _rs(x), zk, _rs(zk), wk, bk, rk, dx, _rs(dx), dz, _rs(dz), lw, lb,
            np.int64(n), np.int32(d), np.int32(gplan.group_size), np.int32(gplan.k),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(gplan.norm_before_gate))
    _launch(launch, args, xd)
    dw = None if w is None else tree_sum(lw).astype(w.dtype)
    db = None if b is None else tree_sum(lb).astype(b.dtype)
    return dx, _as(dz, zd), dw, db


def emul_quant_forward(x, res, w, b, qplan, scale=None):
    plan = qplan.plan
    xd = _name(x)
    hd = xd if res is None else np.promote_types(NP[xd], NP[_name(res)]).name
    hd = "bfloat16" if NP[hd] == NP["bfloat16"] else hd
    ct = plan.compute_dtype
    xk, rk, wk, bk = _as(x, hd), _as(res, hd), _as(w, ct), _as(b, ct)
    n, d = x.shape
    h = _garbage((n, d), hd) if res is not None else None
    q = np.full((n, d), 0xAB, np.uint8)
    if qplan.static:
        sdev = np.array([qplan.scale if scale is None else scale], np.float32)
        sc = None
    else:
        sdev = None
        sc = np.full((n, qplan.groups), np.nan, np.float32)
    launch = cl.quant_launch(n, d, hd, qplan.qdtype == "float8_e4m3fn")
    args = (xk, _rs(xk), rk, _rs(rk), h, _rs(h), wk, bk, q, _rs(q), sc, sdev,
            np.int64(n), np.int32(d), np.int32(plan.k), np.int32(qplan.group_size),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset))
    _launch(launch, args, hd)
    scales = sdev.reshape(()) if qplan.static else sc
    return q, scales, h


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.itemsize}"))


def _qbits(q) -> np.ndarray:
    return np.asarray(q).view(np.uint8)


def _data(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(NP[dtype])


def _tol(dtype: str, factor: float = 4.0) -> Tol:
    t = TOL[dtype]
    return Tol(t.rtol * factor, t.atol * factor, t.floor)
