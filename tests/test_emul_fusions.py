"""The fusion kernels (pn_gated_fwd, pn_gated_bwd, pn_quant_fwd), run on the CPU by the emulator.

Launched as ``polynorm/backends/cuda.py`` launches them (launch rules from
:mod:`polynorm.backends.cuda.launch`, arguments in the ABI order and scalar
types, checked by the harness against the compiled signature), on numpy
buffers; ``test_emul_fusion_backend_glue`` runs the backend's own functions on
the stand-in cupy of test_emul_cupy_backend.py and checks they give these bits.

What is bit for bit, and against what:

* the encoders (pn_e4m3fn, pn_e5m2, pn_int8) against the reference's clip-and-cast
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

from polynorm.backends import reference
from polynorm.backends.cuda import launch as cl
from polynorm.core.options import Options, make_gated_plan, make_plan, make_quant_plan

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


def _qplan(d, dtype, qdtype="float8_e4m3fn", scale=None, group_size=None, scale_mode="divide",
           **kw):
    plan = make_plan(d, dtype, Options(out_dtype="float32", **kw))
    return make_quant_plan(plan, qdtype=qdtype, scale=scale, scale_is_array=False,
                           group_size=group_size, scale_mode=scale_mode)


# ----------------------------------------------------------------------------- launchers (cupy.py's packing)


def emul_gated_forward(x, z, w, b, gplan, *, rows=True, rows_config=None):
    plan = gplan.plan
    xd, ct = _name(x), plan.compute_dtype
    kz, ko = cl.kernel_dtype(xd, _name(z)), cl.kernel_dtype(xd, plan.out_dtype)
    zk, wk, bk = _as(z, kz), _as(w, ct), _as(b, ct)
    n, d = x.shape
    y = _garbage((n, d), ko)
    rstd = _garbage((n, gplan.groups), ct)
    launch = cl.gated_forward_launch(n, d, gplan.group_size, xd, kz, ko, rows=rows, rows_config=rows_config)
    args = (x, _rs(x), zk, _rs(zk), wk, bk, y, _rs(y), rstd,
            np.int64(n), np.int32(d), np.int32(gplan.group_size), np.int32(gplan.k),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(gplan.norm_before_gate))
    _launch(launch, args, xd)
    return _as(y, plan.out_dtype), rstd


def emul_gated_backward(dy, x, z, w, b, rstd, gplan):
    from polynorm.backends.numba.gated import tree_sum

    plan = gplan.plan
    xd, zd, ct = _name(x), _name(z), plan.compute_dtype
    kz, kdy = cl.kernel_dtype(xd, zd), cl.kernel_dtype(xd, _name(dy))
    x, zk, dyk = (np.ascontiguousarray(a) for a in (x, _as(z, kz), _as(dy, kdy)))
    wk, bk = _as(w, ct), _as(b, ct)
    rk = None if rstd is None else np.ascontiguousarray(_as(rstd, ct))
    n, d = x.shape
    dx, dz = _garbage((n, d), xd), _garbage((n, d), kz)
    lw = _garbage((n, d), ct) if w is not None else None
    lb = _garbage((n, d), ct) if b is not None else None
    launch = cl.gated_backward_launch(n, d, gplan.group_size, xd, kz, kdy)
    args = (dyk, x, zk, wk, bk, rk, dx, dz, lw, lb,
            np.int64(n), np.int32(d), np.int32(gplan.group_size), np.int32(gplan.k),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(gplan.norm_before_gate))
    _launch(launch, args, xd)
    dw = None if w is None else tree_sum(lw).astype(w.dtype)
    db = None if b is None else tree_sum(lb).astype(b.dtype)
    return dx, _as(dz, zd), dw, db


def emul_quant_forward(x, res, w, b, qplan, scale=None, *, rows=True, rows_config=None):
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
    launch = cl.quant_launch(n, d, hd, qplan.qdtype, group_size=qplan.group_size, rows=rows,
                             rows_config=rows_config)
    args = (xk, _rs(xk), rk, _rs(rk), h, _rs(h), wk, bk, q, _rs(q), sc, sdev,
            np.int64(n), np.int32(d), np.int32(plan.k), np.int32(qplan.group_size),
            np.int32(launch.tpr), np.float64(plan.eps), np.int32(plan.eps_inside),
            np.float64(plan.offset), np.int32(qplan.reciprocal))
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


# ----------------------------------------------------------------------------- the encoders

_ENC_SRC = f"""
#include "{cl.SOURCE_PATH}"
template <int FMT> __global__ void pn_enc_test(const float* v, unsigned char* o, int n) {{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] = FMT == 1 ? pn_e4m3fn(v[i]) : FMT == 2 ? pn_e5m2(v[i]) : pn_int8(v[i]);
}}
"""


def _encoder_inputs() -> np.ndarray:
    rng = np.random.default_rng(5)
    f = np.float32
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448, -448, 464, 464.00003, 480,
                        1e30, -1e30, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 2.0**-10 * 1.0000001,
                        3 * 2.0**-10, 127, 127.5, 128, -128, -128.5, -129, 0.5, 1.5, 2.5, -0.5,
                        -2.5, 1e-45, -1e-45, 126.5, 3.4e38, 57344, 61439.996, 61440, 65536,
                        2.0**-14, 2.0**-16, 2.0**-17, 3 * 2.0**-18, -57344], f)
    # every float8 code's value and the midpoints between neighbours (ties: nearest even)
    parts = [special]
    for fmt in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        codes = np.arange(256, dtype=np.uint8).view(fmt).astype(f)
        codes = np.sort(codes[np.isfinite(codes)])
        mids = (codes[:-1].astype(np.float64) + codes[1:]) / 2
        near = np.concatenate([np.nextafter(mids.astype(f), f(np.inf)),
                               np.nextafter(mids.astype(f), f(-np.inf))])
        parts += [codes, mids.astype(f), near]
    ints = np.arange(-140, 141, 0.25, dtype=f)
    rand = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(f)
    scaled = (rng.standard_normal(20000) * 300).astype(f)
    return np.concatenate([*parts, ints, rand, scaled])


ENC_TOP = {1: 448.0, 2: 57344.0}
ENC_FMT = {1: ml_dtypes.float8_e4m3fn, 2: ml_dtypes.float8_e5m2}


def test_emul_encoders_bit_exact():
    """pn_e4m3fn / pn_e5m2 / pn_int8 on every class of float32 give the reference's
    clip-and-cast bits (ml_dtypes for the float8 formats, NaN's sign kept)."""
    from emulator import compile_source

    mod = compile_source(_ENC_SRC, [f"pn_enc_test<{k}>" for k in (0, 1, 2)])
    v = _encoder_inputs()
    n = v.size
    nan = np.isnan(v)
    for fmt in (1, 2, 0):
        o = np.zeros(n, np.uint8)
        mod.launch(f"pn_enc_test<{fmt}>", -(-n // 256), 256, (v, o, np.int32(n)))
        if fmt:
            t = ENC_TOP[fmt]
            want = np.clip(v, -t, t).astype(ENC_FMT[fmt]).view(np.uint8)
            # NaN: ml_dtypes' NaN code (0x7f e4m3fn, 0x7e e5m2) with the sign kept
            np.testing.assert_array_equal(o[nan] & 0x7F, 0x7F if fmt == 1 else 0x7E)
            np.testing.assert_array_equal(o[nan] >> 7, np.signbit(v[nan]).astype(np.uint8))
        else:
            c = np.clip(np.where(nan, 0, v), -128, 127)
            want = np.round(c).astype(np.int8).view(np.uint8)
        bad = np.flatnonzero((o != want) & ~(nan & (fmt != 0)))
        assert bad.size == 0, f"fmt={fmt}: {v[bad[:5]]} -> {o[bad[:5]]}, want {want[bad[:5]]}"


# ----------------------------------------------------------------------------- quantized output

QUANT_OPTS = [
    {},
    {"bias": True, "offset": 1.0},
    {"partial": 0.5, "eps_mode": "outside"},
    {"residual": True},
    {"residual": True, "bias": True, "eps": 0.0},
]


def _quant_case(rng, n, d, dtype, opt, qdtype, mode):
    x = _data(rng, (n, d), dtype, 3.0)
    res = _data(rng, (n, d), dtype) if opt.get("residual") else None
    w = _data(rng, d, dtype)
    b = _data(rng, d, "float32") if opt.get("bias") else None
    kw = {k: v for k, v in opt.items() if k in ("partial", "eps_mode", "offset", "eps")}
    scale = 0.02 if mode == "static" else None
    gs = d // 3 if mode == "group" else None
    return x, res, w, b, _qplan(d, dtype, qdtype, scale, gs, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("mode", ["static", "token", "group"])
def test_emul_quant_bits_of_pn_fwd_then_reference_quantize(dtype, qdtype, mode):
    """q, scales and h are the reference's quantization of pn_fwd's own float32 y
    and its h, bit for bit; against the Numba backend q is at most one code off
    (where its y differs in the last bit) and the scales within float32 rounding."""
    from polynorm.backends import numba as nb

    rng = np.random.default_rng(len(dtype) + len(qdtype) + len(mode))
    for d in (48, 300):
        for opt in QUANT_OPTS:
            x, res, w, b, qp = _quant_case(rng, 5, d, dtype, opt, qdtype, mode)
            q, s, h = emul_quant_forward(x, res, w, b, qp)
            y, fh, _, _ = emul_forward(x, res, w, b, qp.plan)
            rq, rs = reference.quantize(np, np.asarray(y, np.float32), qp)
            tag = f"d={d} {opt}"
            np.testing.assert_array_equal(_qbits(q), _qbits(rq), err_msg=f"q {tag}")
            np.testing.assert_array_equal(_bits(np.asarray(s, np.float32)), _bits(np.asarray(rs, np.float32)),
                                          err_msg=f"scales {tag}")
            if res is not None:
                np.testing.assert_array_equal(_bits(h), _bits(fh), err_msg=f"h {tag}")
            nq, ns, nh = nb.quant_forward(x, res, w, b, qp)
            if res is not None:
                np.testing.assert_array_equal(_bits(h), _bits(nh), err_msg=f"h vs numba {tag}")
            assert_close(s, ns, Tol(4e-7, 0.0), f"scales vs numba {tag}")
            a = np.asarray(q).view(ml_dtypes.float8_e4m3fn if qdtype != "int8" else np.int8).astype(np.float64)
            e = np.asarray(nq).astype(np.float64)
            step = np.maximum(np.abs(e) * 2.0**-3, 2.0**-9) if qdtype != "int8" else 1.0
            assert np.all((np.abs(a - e) <= step) | (np.isnan(a) & np.isnan(e))), f"q vs numba {tag}"
            assert np.mean(a == e) > 0.9, f"q vs numba {tag}"


@pytest.mark.parametrize("qdtype, scale_mode", [("float8_e5m2", "divide"),
                                                ("float8_e4m3fn", "reciprocal"),
                                                ("float8_e5m2", "reciprocal"),
                                                ("int8", "reciprocal")])
@pytest.mark.parametrize("mode", ["static", "token", "group"])
def test_emul_quant_e5m2_and_reciprocal(qdtype, scale_mode, mode):
    """float8_e5m2 and scale_mode="reciprocal": q and scales are the reference's
    quantization of pn_fwd's own float32 y, bit for bit (one dtype, one width:
    the rest of the kernel is the one the test above covers)."""
    rng = np.random.default_rng(len(qdtype) + len(scale_mode) + len(mode))
    d = 48
    for opt in (QUANT_OPTS[0], QUANT_OPTS[3]):
        x, res, w, b, qp = _quant_case(rng, 5, d, "bfloat16", opt, qdtype, mode)
        qp = _qplan(d, "bfloat16", qdtype, qp.scale, None if mode != "group" else d // 3,
                    scale_mode=scale_mode, **({"eps": qp.plan.eps}))
        q, s, h = emul_quant_forward(x, res, w, b, qp)
        y, fh, _, _ = emul_forward(x, res, w, b, qp.plan)
        rq, rs = reference.quantize(np, np.asarray(y, np.float32), qp)
        tag = f"{opt}"
        np.testing.assert_array_equal(_qbits(q), _qbits(rq), err_msg=f"q {tag}")
        np.testing.assert_array_equal(_bits(np.asarray(s, np.float32)),
                                      _bits(np.asarray(rs, np.float32)), err_msg=f"scales {tag}")
        if res is not None:
            np.testing.assert_array_equal(_bits(h), _bits(fh), err_msg=f"h {tag}")


# ----------------------------------------------------------------------------- gated

GATED_CASES = [
    # (group_size divisor or None, norm_before_gate, options)
    (None, False, {}),
    (None, True, {}),
    (None, True, {"partial": 0.5, "bias": True, "offset": 1.0}),
    (None, False, {"eps_mode": "outside", "bias": True, "z": "float32"}),
    (3, False, {"bias": True}),
    (3, True, {"eps_mode": "outside", "out_dtype": "float32"}),
    (4, True, {"offset": 1.0, "no_weight": True}),
]


def _gated_case(rng, n, d, dtype, groups, nbg, opt):
    x = _data(rng, (n, d), dtype)
    z = _data(rng, (n, d), opt.get("z", dtype), 2.0)
    w = None if opt.get("no_weight") else _data(rng, d, dtype)
    b = _data(rng, d, dtype) if opt.get("bias") else None
    kw = {k: v for k, v in opt.items() if k in ("partial", "eps_mode", "offset", "out_dtype")}
    if w is None:
        kw.pop("offset", None)
    return x, z, w, b, _gplan(d, dtype, None if groups is None else d // groups, nbg, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emul_gated_forward(dtype):
    """y and rstd against the reference and the Numba backend (per-dtype tolerances);
    with norm_before_gate and one group rstd has pn_fwd's bits for x."""
    from polynorm.backends import numba as nb

    rng = np.random.default_rng(len(dtype))
    for d in (96, 300):
        for groups, nbg, opt in GATED_CASES:
            x, z, w, b, gp = _gated_case(rng, 5, d, dtype, groups, nbg, opt)
            y, r = emul_gated_forward(x, z, w, b, gp)
            tag = f"d={d} groups={groups} nbg={nbg} {opt}"
            assert y.dtype == NP[gp.plan.out_dtype] and r.shape == (5, gp.groups)
            ydt = max((gp.plan.out_dtype, dtype), key=lambda t: TOL[t].rtol)
            rtol = Tol(2e-6, 0.0) if gp.plan.compute_dtype == "float32" else Tol(1e-13, 0.0)
            for name, (ey, er) in (("reference", reference.gated_forward(x, z, w, b, gp)),
                                   ("numba", nb.gated_forward(x, z, w, b, gp))):
                assert_close(y, ey, _tol(ydt), f"y vs {name} {tag}")
                assert_close(r, er, rtol, f"rstd vs {name} {tag}")
            if nbg and gp.groups == 1:
                _, _, fr, _ = emul_forward(x, None, None, None, gp.plan)
                np.testing.assert_array_equal(_bits(r[:, 0]), _bits(fr), err_msg=f"rstd vs pn_fwd {tag}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_emul_gated_backward(dtype):
    """dx, dz, dweight, dbias against the reference and Numba (tolerances); the
    forward's rstd passed in gives the bits of recomputing it (eps inside)."""
    from polynorm.backends import numba as nb

    rng = np.random.default_rng(len(dtype) + 1)
    for d in (96, 300):
        for groups, nbg, opt in GATED_CASES:
            x, z, w, b, gp = _gated_case(rng, 6, d, dtype, groups, nbg, opt)
            dy = _data(rng, (6, d), dtype)
            got = emul_gated_backward(dy, x, z, w, b, None, gp)
            tag = f"d={d} groups={groups} nbg={nbg} {opt}"
            for name, want in (("reference", reference.gated_backward(dy, x, z, w, b, None, gp)),
                               ("numba", nb.gated_backward(dy, x, z, w, b, None, gp))):
                for what, a, e in zip(("dx", "dz", "dweight", "dbias"), got, want, strict=True):
                    assert (a is None) == (e is None), what
                    if a is not None:
                        assert a.dtype == e.dtype, what
                        assert_close(a, e, _tol(dtype, 16), f"{what} vs {name} {tag}")
            if gp.plan.eps_inside:
                _, r = emul_gated_forward(x, z, w, b, gp)
                again = emul_gated_backward(dy, x, z, w, b, r, gp)
                for a, e in zip(got[:2], again[:2], strict=True):
                    np.testing.assert_array_equal(_bits(a), _bits(e), err_msg=f"rstd given {tag}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_emul_fusions_inf_rows_follow_specs_formula(dtype):
    """An Inf in a group's statistic makes that group's rms Inf and rstd 0, the plain
    norm's rule (SPEC's formula): pn_gated_fwd / pn_gated_bwd agree with the reference
    and Numba (NaN positions and values), and pn_quant_fwd's q and scales are the
    reference's quantization of pn_fwd's y (a NaN scale for the Inf's token or group)."""
    from polynorm.backends import numba as nb

    rng = np.random.default_rng(len(dtype) + 7)
    d = 96
    x = _data(rng, (4, d), dtype)
    x[0, 5] = np.inf
    x[1, 50], x[1, 90] = -np.inf, np.inf  # group 1 and 2 of three; beyond k with partial
    x[2, 3] = np.nan
    z = _data(rng, (4, d), dtype, 2.0)
    w, b = _data(rng, d, dtype), _data(rng, d, dtype)
    dy = _data(rng, (4, d), dtype)
    for groups, nbg, opt in ((None, False, {}), (3, True, {}),
                             (None, True, {"partial": 0.5, "eps_mode": "outside"})):
        gp = _gplan(d, dtype, None if groups is None else d // groups, nbg, **opt)
        tag = f"groups={groups} nbg={nbg} {opt}"
        y, r = emul_gated_forward(x, z, w, b, gp)
        assert r[0, 0] == 0 and np.isnan(r[2, 0]), tag
        if groups == 3:
            assert r[1, 1] == 0 and r[1, 2] == 0 and np.isfinite(r[1, 0]), tag
        rtol = Tol(2e-6, 0.0) if gp.plan.compute_dtype == "float32" else Tol(1e-13, 0.0)
        for name, (ey, er) in (("reference", reference.gated_forward(x, z, w, b, gp)),
                               ("numba", nb.gated_forward(x, z, w, b, gp))):
            assert_close(y, ey, _tol(dtype), f"y vs {name} {tag}")
            assert_close(r, er, rtol, f"rstd vs {name} {tag}")
        got = emul_gated_backward(dy, x, z, w, b, None, gp)
        want = reference.gated_backward(dy, x, z, w, b, None, gp)
        for what, a, e in zip(("dx", "dz", "dweight", "dbias"), got, want, strict=True):
            assert_close(a, e, _tol(dtype, 16), f"{what} {tag}")
    for qdtype, mode in (("float8_e4m3fn", "token"), ("int8", "group"), ("float8_e4m3fn", "static")):
        qp = _qplan(d, dtype, qdtype, 0.02 if mode == "static" else None,
                    d // 3 if mode == "group" else None)
        q, sc, _ = emul_quant_forward(x, None, w, b, qp)
        yf, _, _, _ = emul_forward(x, None, w, b, qp.plan)
        rq, rs = reference.quantize(np, np.asarray(yf, np.float32), qp)
        np.testing.assert_array_equal(_qbits(q), _qbits(rq), err_msg=f"q {qdtype} {mode}")
        np.testing.assert_array_equal(_bits(np.asarray(sc, np.float32)), _bits(np.asarray(rs, np.float32)),
                                      err_msg=f"scales {qdtype} {mode}")
        if mode != "static":
            assert np.isnan(np.asarray(sc)[0, 0]) and np.isfinite(np.asarray(sc)[3]).all()


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_emul_fusions_batch_invariance_and_schedules(dtype):
    """A token's y, rstd, dx, dz, q, scales and h bits equal those of the token alone,
    also with a NaN token and an all-zero token (eps 0) next to it, and for other
    block schedules and worker counts."""
    rng = np.random.default_rng(3)
    n, d = 7, 120

    def run(rows):
        out = []
        x, z, w, b, gp = xs
        out += [*emul_gated_forward(x[rows], z[rows], w, b, gp)]
        out += [a for a in emul_gated_backward(dy[rows], x[rows], z[rows], w, b, None, gp)[:2]]
        for qp in qps:
            q, s, h = emul_quant_forward(x[rows], res[rows], w, b, qp)
            out += [q, s if qp.static else s, h]
        return out

    xs = _gated_case(rng, n, d, dtype, 4, True, {"bias": True, "eps_mode": "outside"})
    xs[0][2] = np.nan
    xs[0][4] = 0
    xs = (*xs[:4], _gplan(d, dtype, d // 4, True, eps=0.0, eps_mode="outside"))
    dy = _data(rng, (n, d), dtype)
    res = _data(rng, (n, d), dtype)
    qps = [_qplan(d, dtype, "float8_e4m3fn", None, 40, eps=0.0), _qplan(d, dtype, "int8", None, None)]
    full = run(slice(0, n))
    for i in range(n):
        alone = run(slice(i, i + 1))
        for j, (a, f) in enumerate(zip(alone, full, strict=True)):
            f = np.asarray(f)
            if f.ndim == 0:
                continue
            np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(f[i:i + 1]), err_msg=f"token {i} output {j}")
    assert np.isnan(full[0][2]).all() and np.isfinite(full[0][[0, 1, 3, 5, 6]]).all()
    try:
        for schedule, workers in ((1, 1), (977, 3)):
            _RUN.update(schedule=schedule, workers=workers)
            for j, (a, f) in enumerate(zip(run(slice(0, n)), full, strict=True)):
                np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(np.asarray(f)),
                                              err_msg=f"schedule={schedule} output {j}")
    finally:
        _RUN.update(schedule=0, workers=None)


# ----------------------------------------------------------------------------- launch rules


def test_fusion_launches_cover_the_segments_and_do_not_depend_on_n():
    names = set(cl.specialisations())
    for x in DTYPES:
        for d, gs in ((1, 1), (7, 7), (96, 32), (4096, 128), (8192, 8192), (20000, 20000), (262144, 262144)):
            tprs = set()
            for n in (1, 3, 1000):
                for la, segs in ((cl.gated_forward_launch(n, d, gs, x, rows=False), n * (d // gs)),
                                 (cl.gated_backward_launch(n, d, gs, x), n * (d // gs)),
                                 (cl.quant_launch(n, d, x, True), n), (cl.quant_launch(n, d, x, False), n)):
                    assert la.name in names
                    assert la.block % 32 == 0 and 32 <= la.block <= cl.FUSE_THREADS
                    assert la.tpr & (la.tpr - 1) == 0 and la.block % la.tpr == 0
                    assert la.grid * (la.block // la.tpr) >= segs
                tprs.add((cl.gated_forward_launch(n, d, gs, x, rows=False).tpr, cl.quant_launch(n, d, x).tpr))
            assert len(tprs) == 1, (x, d, gs, tprs)


# ----------------------------------------------------------------------------- polynorm/backends/cuda.py


@pytest.fixture
def fake_cupy(monkeypatch):
    """test_emul_cupy_backend.py's stand-in cupy (numpy arrays, kernels in the emulator)."""
    import test_emul_cupy_backend as E

    from polynorm.backends import cuda as cupy_backend
    from polynorm.backends.cuda import nvrtc as _nvrtc

    monkeypatch.setitem(sys.modules, "cupy", E._make_fake_cupy(3, 227 * 1024))
    monkeypatch.setattr(_nvrtc, "available", lambda: (True, "stubbed"))
    monkeypatch.setattr(_nvrtc, "cached_cubin", E._stub_cached_cubin)
    monkeypatch.setattr(cupy_backend, "_kernels", {})
    monkeypatch.setattr(cupy_backend, "_device_info", {})
    E._POINTERS.clear()
    E._Kernel.launches.clear()
    yield cupy_backend, E._fake, E._Kernel.launches
    E._POINTERS.clear()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_emul_fusion_backend_glue(fake_cupy, dtype):
    """The cupy backend's gated_forward / gated_backward / quant_forward (its casts,
    pointers, strides, buffers and row-tree sums) give the launchers' bits above,
    on strided rows and with a cast z; inputs are left as they were."""
    backend, fake, launches = fake_cupy
    rng = np.random.default_rng(11)
    n, d = 5, 96
    base = _data(rng, (2 * n, d + 8), dtype)
    x = np.ascontiguousarray(base[::2, 4:4 + d])
    z = _data(rng, (n, d), "float32" if dtype == "float16" else dtype, 2.0)
    w, b, dy, res = _data(rng, d, dtype), _data(rng, d, dtype), _data(rng, (n, d), dtype), _data(rng, (n, d), dtype)
    fx = fake(base.copy())[::2, 4:4 + d]
    fz, fw, fb, fdy, fres = (fake(a.copy()) for a in (z, w, b, dy, res))
    for nbg, gs in ((False, 32), (True, None)):
        gp = _gplan(d, dtype, gs, nbg)
        y, r = backend.gated_forward(fx, fz, fw, fb, gp)
        ey, er = emul_gated_forward(x, z, w, b, gp)
        for a, e in ((y, ey), (r, er)):
            assert type(a).__module__ == "cupy" and a.dtype == e.dtype
            np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(e))
        got = backend.gated_backward(fdy, fx, fz, fw, fb, None, gp)
        want = emul_gated_backward(dy, x, z, w, b, None, gp)
        for a, e in zip(got, want, strict=True):
            assert a.dtype == e.dtype
            np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(e))
    for qp, scale in ((_qplan(d, dtype, "int8", None, 32), None), (_qplan(d, dtype, "int8", 0.05), None),
                      (_qplan(d, dtype, "int8", 1.0), 0.03)):
        if scale is not None:
            qp = make_quant_plan(qp.plan, qdtype="int8", scale=None, scale_is_array=True, group_size=None)
        fs = None if scale is None else fake(np.array([scale], np.float32))
        q, s, h = backend.quant_forward(fx, fres, fw, fb, qp, fs)
        eq, es, eh = emul_quant_forward(x, res, w, b, qp, scale)
        assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == np.shape(es)
        np.testing.assert_array_equal(_qbits(q), _qbits(eq))
        np.testing.assert_array_equal(_bits(np.asarray(s, np.float32)), _bits(np.asarray(es, np.float32)))
        np.testing.assert_array_equal(_bits(np.asarray(h)), _bits(eh))
    np.testing.assert_array_equal(np.asarray(fx), x)
    # float32 rows of 96 take the rows body where one segment is the whole row (32 tree threads)
    rows = {"pn_gated_rows", "pn_quant_rows"} if dtype == "float32" else set()
    assert {nm.split("<")[0] for nm, *_ in launches} == {"pn_gated_fwd", "pn_gated_bwd", "pn_quant_fwd"} | rows


def test_emul_backend_scale_mode_at_midpoints(fake_cupy):
    """The cupy backend passes scale_mode to pn_quant_fwd: on a row of ones with eps=0
    (rstd exactly 1, so y is the weight) whose weights sit where y / s and
    y * float32(1 / s) round to neighbouring int8 values, each mode gives its
    formula's codes (written out here), static and per token."""
    from test_quant_conventions import _midpoint_row, peer_divide, peer_reciprocal

    backend, fake, _ = fake_cupy
    s1 = np.float32(0.875)
    w = _midpoint_row("int8", s1)
    x = np.ones((2, w.size), np.float32)
    assert w.size > 10
    for mode, f in (("divide", peer_divide), ("reciprocal", peer_reciprocal)):
        want = f(x * w, s1, "int8")
        for scale in (float(s1), None):
            qp = _qplan(w.size, "float32", "int8", scale, None, scale_mode=mode, eps=0.0)
            q, s, _ = backend.quant_forward(fake(x.copy()), None, fake(w.copy()), None, qp)
            np.testing.assert_array_equal(np.asarray(q), want, f"{mode} scale={scale}")
            assert np.all(np.asarray(s) == s1)


def test_cupy_backend_offers_the_fusions():
    """The front end sends CUDA arrays to these kernels only if the module has the capabilities."""
    from polynorm.backends import cuda as cupy_backend

    registry = sys.modules["polynorm.backends"]

    assert isinstance(cupy_backend, registry.GatedKernels)
    assert isinstance(cupy_backend, registry.QuantKernels)
