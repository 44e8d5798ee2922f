"""Every backend against the extended-precision oracle, per dtype (tolerances: ``_oracle.TOL``).

Inputs are first rounded to the dtype under test and the oracle is given
those rounded values, so the only error measured is the backend's own:
its compute precision and its final rounding.
"""

from __future__ import annotations

import dataclasses

import _oracle as oracle
import numpy as np
import pytest
from _oracle import (
    EXTENDED,
    NP_DTYPES,
    TOL,
    Tol,
    assert_close,
    dtype_name,
    hf_llama_rms_norm,
    looser,
    promote,
)

import polynorm as pn

DTYPES = ("float16", "bfloat16", "float32", "float64")
COMPUTE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}

OPTIONS = {
    "plain": dict(weight=False, bias=False, kw=dict()),
    "weight-bias": dict(weight=True, bias=True, kw=dict(eps=1e-5)),
    "partial-outside-offset": dict(
        weight=True, bias=False, kw=dict(partial=0.3, eps_mode="outside", offset=1.0, eps=1e-2)
    ),
}


def _rand(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(NP_DTYPES[dtype])


def _opt(case, a):
    return None if a is None else case.asarray(a)


def _fwd(case, x, w=None, b=None, **kw):
    out = pn.rms_norm(case.asarray(x), _opt(case, w), _opt(case, b), return_rstd=True,
                      backend=case.backend, **kw)
    return case.to_numpy(out[0]), case.to_numpy(out[1])


# ----------------------------------------------------------------------- forward / add / backward


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_oracle(case, dtype, opt, rng):
    case.skip_unless_dtype(dtype)
    o = OPTIONS[opt]
    x = _rand(rng, (6, 33), dtype, 3.0)
    w = _rand(rng, (33,), dtype) if o["weight"] else None
    b = _rand(rng, (33,), dtype) if o["bias"] else None
    y, rstd = _fwd(case, x, w, b, **o["kw"])
    want_y, want_rstd = oracle.forward(x, w, b, **o["kw"])
    assert dtype_name(y) == dtype and dtype_name(rstd) == COMPUTE[dtype]
    assert_close(y, want_y, dtype, f"y ({dtype}, {opt})")
    assert_close(rstd, want_rstd, COMPUTE[dtype], f"rstd ({dtype}, {opt})")


def test_partial_size_and_partial_k_over_d_select_k(case, rng):
    """``partial_size=k`` and ``partial=k/d`` both take the statistic over the first k
    elements, also where ``d * (k/d)`` rounds below k (d = 22: k = 15 only)."""
    d = 22
    x = _rand(rng, (5, d), "float32", 3.0)
    w = _rand(rng, (d,), "float32")
    dy = _rand(rng, (5, d), "float32")
    assert [k for k in range(1, d + 1) if int(d * (k / d)) != k] == [15]
    for k in (1, 14, 15, 16, 22):
        y, rstd = _fwd(case, x, w, partial_size=k, eps=1e-5)
        want_y, want_rstd = oracle.forward(x, w, partial_size=k, eps=1e-5)
        assert_close(y, want_y, "float32", f"y (partial_size={k})")
        assert_close(rstd, want_rstd, "float32", f"rstd (partial_size={k})")
        yp, rstdp = _fwd(case, x, w, partial=k / d, eps=1e-5)
        np.testing.assert_array_equal(yp, y)
        np.testing.assert_array_equal(rstdp, rstd)
        dx, dw, _ = pn.rms_norm_backward(case.asarray(dy), case.asarray(x), case.asarray(w),
                                         partial_size=k, eps=1e-5, backend=case.backend)
        want_dx, want_dw, _ = oracle.backward(dy, x, w, partial_size=k, eps=1e-5)
        assert_close(case.to_numpy(dx), want_dx, "float32", f"dx (partial_size={k})")
        assert_close(case.to_numpy(dw), want_dw, "float32", f"dweight (partial_size={k})")


@pytest.mark.parametrize(
    "xdt, rdt", [("float32", "float32"), ("bfloat16", "float32"), ("float16", "float16"),
                 ("float16", "bfloat16"), ("float64", "float64")], ids=lambda p: p
)
def test_add_matches_oracle(case, xdt, rdt, rng):
    """h = x + residual in promote(x, residual), y == rms_norm(h) for the h returned."""
    case.skip_unless_dtype(xdt)
    case.skip_unless_dtype(rdt)
    x, r = _rand(rng, (5, 24), xdt), _rand(rng, (5, 24), rdt)
    w = _rand(rng, (24,), xdt)
    kw = dict(partial=0.5, eps=1e-4)
    y, h, rstd = pn.add_rms_norm(case.asarray(x), case.asarray(r), case.asarray(w),
                                 return_rstd=True, backend=case.backend, **kw)
    y, h, rstd = case.to_numpy(y), case.to_numpy(h), case.to_numpy(rstd)
    hdt = promote(xdt, rdt)
    assert dtype_name(h) == hdt and dtype_name(y) == hdt and dtype_name(rstd) == COMPUTE[hdt]
    assert_close(h, oracle.add(x, r), hdt, "h")
    want_y, want_rstd = oracle.forward(h, w, **kw)
    assert_close(y, want_y, hdt, "y of the returned h")
    assert_close(rstd, want_rstd, COMPUTE[hdt], "rstd")
    # and literally the same as rms_norm of that h
    y2, _ = _fwd(case, h, w, **kw)
    assert_close(y, y2, Tol(0.0, 0.0), "add_rms_norm y vs rms_norm(h) y")


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_oracle(case, dtype, opt, rng):
    case.skip_unless_dtype(dtype)
    o = OPTIONS[opt]
    x = _rand(rng, (6, 33), dtype, 2.0)
    dy = _rand(rng, (6, 33), dtype)
    w = _rand(rng, (33,), dtype) if o["weight"] else None
    b = _rand(rng, (33,), "float32") if o["bias"] else None
    gr = _rand(rng, (6, 33), dtype)
    dx, dw, db = pn.rms_norm_backward(
        case.asarray(dy), case.asarray(x), _opt(case, w), _opt(case, b),
        grad_residual=case.asarray(gr), backend=case.backend, **o["kw"],
    )
    want = oracle.backward(dy, x, w, b, grad_residual=gr, **o["kw"])
    dx = case.to_numpy(dx)
    assert dtype_name(dx) == dtype
    assert_close(dx, want[0], dtype, f"dx ({dtype}, {opt})")
    if w is not None:
        dw = case.to_numpy(dw)
        assert dtype_name(dw) == dtype
        assert_close(dw, want[1], dtype, "dweight")
    if b is not None:
        db = case.to_numpy(db)
        assert dtype_name(db) == "float32"
        assert_close(db, want[2], "float32", "dbias")


# ----------------------------------------------------------------------- dtype mixes


@pytest.mark.parametrize(
    "xdt, wdt", [("bfloat16", "float32"), ("float16", "float32"), ("float32", "float64"),
                 ("float32", "bfloat16"), ("float64", "float32")], ids=lambda p: p
)
def test_weight_dtype_differs_from_x(case, xdt, wdt, rng):
    """fp32 casting: y has x's dtype, one rounding; dweight has weight's dtype."""
    case.skip_unless_dtype(xdt)
    case.skip_unless_dtype(wdt)
    x, w, b = _rand(rng, (4, 40), xdt, 2.0), _rand(rng, (40,), wdt), _rand(rng, (40,), wdt)
    y, rstd = _fwd(case, x, w, b)
    want_y, _ = oracle.forward(x, w, b)
    assert dtype_name(y) == xdt and dtype_name(rstd) == COMPUTE[xdt]
    assert_close(y, want_y, xdt, "y")
    dy = _rand(rng, (4, 40), xdt)
    dx, dw, db = pn.rms_norm_backward(case.asarray(dy), case.asarray(x), case.asarray(w),
                                      case.asarray(b), backend=case.backend)
    want = oracle.backward(dy, x, w, b)
    dx, dw, db = case.to_numpy(dx), case.to_numpy(dw), case.to_numpy(db)
    assert (dtype_name(dx), dtype_name(dw), dtype_name(db)) == (xdt, wdt, wdt)
    assert_close(dx, want[0], xdt, "dx")
    # dweight is computed in the compute dtype and rounded to weight's dtype
    assert_close(dw, want[1], looser(COMPUTE[xdt], wdt), "dweight")
    assert_close(db, want[2], looser(COMPUTE[xdt], wdt), "dbias")


@pytest.mark.parametrize(
    "xdt, odt", [("bfloat16", "float32"), ("float32", "float16"), ("float64", "bfloat16"),
                 ("float16", "float64"), ("float32", "float64")], ids=lambda p: p
)
def test_out_dtype(case, xdt, odt, rng):
    """out_dtype only changes the final rounding: the compute dtype stays x's."""
    case.skip_unless_dtype(xdt)
    case.skip_unless_dtype(odt)
    x, w = _rand(rng, (3, 20), xdt, 2.0), _rand(rng, (20,), xdt)
    y, rstd = _fwd(case, x, w, out_dtype=odt)
    assert dtype_name(y) == odt and dtype_name(rstd) == COMPUTE[xdt]
    assert_close(y, oracle.forward(x, w)[0], looser(odt, COMPUTE[xdt]), "y")
    if type(case.asarray(x)) is np.ndarray:  # a numpy dtype object works as well as its name
        y2, _ = _fwd(case, x, w, out_dtype=NP_DTYPES[odt])
        np.testing.assert_array_equal(y2, y)


# ----------------------------------------------------------------------- overflow / underflow


OVERFLOW = [
    # dtype, scale, eps: x**2 overflows (or underflows) the naive compute type
    ("float32", 1e25, 1e-6),
    ("float32", 1e-25, 0.0),
    ("bfloat16", 1e30, 1e-6),
    ("bfloat16", 1e-30, 0.0),
    ("float16", 6e4, 1e-6),
    ("float16", 1e-6, 0.0),  # float16 subnormals (below 6.1e-5)
    ("float64", 1e200, 1e-6),
    ("float64", 1e-200, 0.0),
]


def test_float32_rows_whose_partials_leave_float32_range():
    # the kernels sum float32 squares in float32 partials over blocks of 512 elements: a
    # row with one overflowing block, one whose sum is below 2**-100 (its squares partly
    # subnormal) and one whose tiny squares sit beside ordinary ones each get the float64
    # answer, alone and in the batch
    rng = np.random.default_rng(11)
    x = rng.uniform(0.5, 2.0, (4, 1100)) * rng.choice([-1.0, 1.0], (4, 1100))
    x[0, 600:700] *= 1e21  # squares overflow float32 in the second block only
    x[1] *= 1e-22  # subnormal squares (~1e-44): the sum is below 2**-100
    x[2, :512] *= 1e-22  # subnormal squares in the first block, ordinary ones after
    x[3, 1099] = 3e19  # one overflowing square in the last, partial, block
    x = x.astype(np.float32)
    w = rng.uniform(0.5, 2.0, 1100).astype(np.float32)
    for kw in (dict(eps=0.0), dict(eps=1e-30, eps_mode="outside", partial=0.5)):
        y, rstd = pn.rms_norm(x, w, backend="numba", return_rstd=True, **kw)
        want_y, want_rstd = oracle.forward(x, w, **kw)
        assert_close(y, want_y, "float32", f"y {kw}")
        assert_close(rstd, want_rstd, "float32", f"rstd {kw}")
        for i in range(4):
            yi = pn.rms_norm(x[i : i + 1], w, backend="numba", **kw)
            assert yi.tobytes() == y[i : i + 1].tobytes(), (i, kw)


@pytest.mark.parametrize("dtype, scale, eps", OVERFLOW, ids=lambda p: str(p))
def test_no_spurious_overflow_or_underflow(case, dtype, scale, eps, rng):
    case.skip_unless_dtype(dtype)
    if dtype == "float64" and not EXTENDED:
        pytest.skip("the oracle needs an extended-range np.longdouble for float64 extremes")
    # magnitudes in [0.5, 2) * scale (also below float16's max), random signs: none rounds to 0
    mag = rng.uniform(0.5, 2.0, (4, 16)) * rng.choice([-1.0, 1.0], (4, 16))
    x = np.clip(mag * scale, -6e4, 6e4) if dtype == "float16" else mag * scale
    x = x.astype(NP_DTYPES[dtype])
    assert np.all(np.isfinite(x.astype(np.float64))) and np.all(x.astype(np.float64) != 0)
    w = _rand(rng, (16,), dtype)
    for kw in (dict(eps=eps), dict(eps=eps, eps_mode="outside", partial=0.5)):
        y, rstd = _fwd(case, x, w, **kw)
        want_y, want_rstd = oracle.forward(x, w, **kw)
        assert np.all(np.isfinite(y.astype(np.float64))), f"{kw}: non-finite y for finite x"
        assert_close(y, want_y, dtype, f"y at scale {scale} {kw}")
        # dx ~ dy / scale: tiny rows get a tiny dy so that dx is representable
        dy = _rand(rng, (4, 16), dtype, min(scale, 1.0))
        dx, dw, _ = pn.rms_norm_backward(case.asarray(dy), case.asarray(x), case.asarray(w),
                                         backend=case.backend, **kw)
        want = oracle.backward(dy, x, w, **kw)
        assert_close(case.to_numpy(dx), want[0], dtype, f"dx at scale {scale} {kw}")
        assert_close(case.to_numpy(dw), want[1], dtype, f"dweight at scale {scale} {kw}")
        # rstd itself may legitimately be outside the compute range (1/1e-200 in float64
        # is fine, 1/1e-30 in float32 is not): compare it only where representable.
        if np.all(np.isfinite(want_rstd.astype(NP_DTYPES[COMPUTE[dtype]]))) and np.all(
            want_rstd.astype(NP_DTYPES[COMPUTE[dtype]]) != 0
        ):
            assert_close(rstd, want_rstd, COMPUTE[dtype], f"rstd at scale {scale} {kw}")


# ----------------------------------------------------------------------- NaN / Inf / zeros


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_stay_in_their_token(case, dtype, rng):
    """A NaN/Inf poisons its own token's output only; every other token is bit-identical.

    The spec's "makes that token's output NaN/Inf" is read as torch does it: the
    poisoned position is non-finite, the rest of that token may not be (an Inf makes
    rstd 0, so torch gives ``[nan, 0, ...]``; with partial < 1 an Inf outside the
    first k elements leaves rstd finite).  What is promised is the isolation.
    """
    case.skip_unless_dtype(dtype)
    x = _rand(rng, (6, 10), dtype)
    w = _rand(rng, (10,), dtype)
    b = _rand(rng, (10,), dtype)
    bad = x.copy()
    bad[1, 0] = np.nan
    bad[3, 2] = np.inf
    bad[4, 9] = -np.inf  # beyond k for partial=0.5: outside the statistic, only y[4, 9] is hit
    for kw in (dict(), dict(partial=0.5, eps_mode="outside")):
        clean, _ = _fwd(case, x, w, b, **kw)
        y, rstd = _fwd(case, bad, w, b, **kw)
        y64 = y.astype(np.float64)
        for t, i in ((1, 0), (3, 2), (4, 9)):
            assert not np.isfinite(y64[t, i]), f"{kw}: token {t} position {i} should be NaN/Inf"
        for t in (0, 2, 5):
            np.testing.assert_array_equal(y[t], clean[t], err_msg=f"{kw}: token {t} was touched")
        assert np.all(np.isfinite(rstd[[0, 2, 5]]))
        dx, _, _ = pn.rms_norm_backward(case.asarray(x), case.asarray(bad), case.asarray(w),
                                        backend=case.backend, **kw)
        dx_clean, _, _ = pn.rms_norm_backward(case.asarray(x), case.asarray(x), case.asarray(w),
                                              backend=case.backend, **kw)
        dx, dx_clean = case.to_numpy(dx), case.to_numpy(dx_clean)
        np.testing.assert_array_equal(dx[[0, 2, 5]], dx_clean[[0, 2, 5]])


@pytest.mark.parametrize("opts", [{}, {"eps_mode": "outside"}, {"eps": 0.0}, {"partial": 0.5}],
                         ids=["inside", "outside", "eps0", "partial"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_token_follows_specs_formula(case, dtype, opts, rng):
    """An Inf among a token's first k elements: ms = Inf, rstd = 1/sqrt(Inf + eps) = 0
    (1/(Inf + eps) outside), so y = x * 0 * w + b: NaN at the Inf, b elsewhere, as torch's
    F.rms_norm gives ([1, 2, inf, 3] -> [0, 0, nan, 0]); not a NaN token.  An Inf beyond k
    is not in the statistic (that element's y is +-Inf, the rest as without it); a NaN
    makes its token NaN.  Backward with rstd = 0 (SPEC's dx; the masked term is xhat * 0):
    dx is NaN on the first k elements (0 * Inf in the sum), beyond k it is 0 * g * dy plus
    grad_residual (NaN at an Inf there); dweight is NaN in the Inf's column only."""
    case.skip_unless_dtype(dtype)
    d = 8
    k = 4 if opts.get("partial") else d
    x = _rand(rng, (5, d), dtype)
    x[0, 2] = np.inf
    x[1, 0], x[1, 5] = -np.inf, np.inf  # two Infs; the second beyond k with partial
    x[2, 6] = -np.inf  # beyond k with partial
    x[3, 1], x[3, 3] = np.nan, np.inf
    w, b = _rand(rng, (d,), dtype), _rand(rng, (d,), dtype)
    y, rstd = _fwd(case, x, w, b, **opts)
    clean = x.copy()
    clean[2, 6] = 1.0
    y_clean, rstd_clean = _fwd(case, clean, w, b, **opts)
    y64, b64 = y.astype(np.float64), b.astype(np.float64)
    assert rstd[0] == 0 and rstd[1] == 0 and np.isnan(rstd[3]), rstd
    for t, infs in ((0, [2]), (1, [0, 5])):
        assert np.isnan(y64[t, infs]).all(), (t, y64[t])
        np.testing.assert_array_equal(np.delete(y64[t], infs), np.delete(b64, infs), err_msg=f"token {t}")
    assert np.isnan(y64[3]).all()
    if k == d:
        assert rstd[2] == 0 and np.isnan(y64[2, 6])
    else:  # the -Inf is outside the statistic: only its own element is hit
        assert rstd[2] == rstd_clean[2] and y64[2, 6] == -np.inf * np.sign(w[6].astype(np.float64))
        np.testing.assert_array_equal(np.delete(y[2], 6), np.delete(y_clean[2], 6))
    np.testing.assert_array_equal(y[4], y_clean[4])
    if not opts or opts == {"eps": 0.0}:
        torch = pytest.importorskip("torch")
        t = torch.nn.functional.rms_norm(torch.from_numpy(x.astype(np.float64)), (d,),
                                         torch.from_numpy(w.astype(np.float64)),
                                         eps=opts.get("eps", 1e-6)) + torch.from_numpy(b64)
        assert_close(y, t.numpy(), dtype, f"y against torch {opts}")
    # fused add: the Inf comes through h (x + residual), same rule
    r = _rand(rng, (5, d), dtype)
    ya, ha, ra = (case.to_numpy(a) for a in pn.add_rms_norm(
        case.asarray(x), case.asarray(r), case.asarray(w), case.asarray(b), return_rstd=True,
        backend=case.backend, **opts))
    assert ra[0] == 0 and np.isnan(ya.astype(np.float64)[0, 2])
    np.testing.assert_array_equal(np.delete(ya[0], 2).astype(np.float64), np.delete(b64, 2))
    # backward on the tokens without the NaN one (which would make all of dweight NaN)
    rows = [0, 1, 2, 4]
    xb, dy, g = x[rows], _rand(rng, (4, d), dtype), _rand(rng, (4, d), dtype)
    dx, dw, db = (case.to_numpy(a) for a in pn.rms_norm_backward(
        case.asarray(dy), case.asarray(xb), case.asarray(w), case.asarray(b),
        grad_residual=case.asarray(g), backend=case.backend, **opts))
    dx64 = dx.astype(np.float64)
    for t, infs in ((0, [2]), (1, [0, 5])):
        assert np.isnan(dx64[t, :k]).all(), (t, dx64[t])
        tail = [j for j in range(k, d) if j not in infs]
        np.testing.assert_array_equal(dx64[t, tail], g[t, tail].astype(np.float64), err_msg=f"dx {t}")
        assert np.isnan(dx64[t, [j for j in infs if j >= k]]).all()
    assert np.isnan(dx64[2, :k]).all() == (k == d) and np.isnan(dx64[2, 6])
    assert np.isfinite(dx64[3]).all()
    bad = {2, 0, 5} | ({6} if k == d else set())
    assert set(np.flatnonzero(np.isnan(dw.astype(np.float64)))) == bad, dw
    if k < d:
        assert np.isinf(dw.astype(np.float64)[6])  # dy * (-Inf * rstd) with rstd finite
    assert np.isfinite(db.astype(np.float64)).all()


@pytest.mark.parametrize("casting", ["fp32", "llama"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zero_weight_keeps_its_sign(case, dtype, casting, rng):
    """A -0.0 in the weight gives y = x * rstd * -0.0, a zero with the sign of -x, as torch's
    F.rms_norm (and Hugging Face's ``weight * x``) give: ``weight + offset`` with offset 0
    must not turn -0.0 into +0.0.  With offset=1.0 the factor is 1 - 0 and the sign is x's."""
    case.skip_unless_dtype(dtype)
    d = 8
    x = _rand(rng, (3, d), dtype)
    x[:, ::2] = np.abs(x[:, ::2])
    x[:, 1::2] = -np.abs(x[:, 1::2])
    w = _rand(rng, (d,), dtype)
    w[:4] = -0.0
    w[4:6] = 0.0
    y, _ = _fwd(case, x, w, casting=casting)
    zeros = y[:, :6].astype(np.float64)
    assert (zeros == 0).all()
    xs, ws = np.signbit(x[:, :6].astype(np.float64)), np.signbit(w[:6].astype(np.float64))
    np.testing.assert_array_equal(np.signbit(zeros), xs ^ ws)
    if casting == "fp32":
        torch = pytest.importorskip("torch")
        t = torch.nn.functional.rms_norm(torch.from_numpy(x.astype(np.float32)), (d,),
                                         torch.from_numpy(w.astype(np.float32)), eps=1e-6)
        np.testing.assert_array_equal(np.signbit(zeros), np.signbit(t.numpy()[:, :6]))
    y1, _ = _fwd(case, x, w, casting=casting, offset=1.0)
    np.testing.assert_array_equal(np.signbit(y1[:, :6].astype(np.float64)), xs)


@pytest.mark.parametrize("eps_mode", ["inside", "outside"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_slice_stays_zero(case, dtype, eps_mode, rng):
    """eps > 0: a zero token gives exactly 0 * weight + bias, and a finite backward.

    (eps = 1e-3 so that its rstd, 1/eps outside, and hence dx fit float16.)
    """
    case.skip_unless_dtype(dtype)
    eps = 1e-3
    x = _rand(rng, (3, 8), dtype)
    x[1] = 0
    w, b = _rand(rng, (8,), dtype), _rand(rng, (8,), dtype)
    y, rstd = _fwd(case, x, w, eps=eps, eps_mode=eps_mode)
    np.testing.assert_array_equal(y[1].astype(np.float64), np.zeros(8))
    assert np.isfinite(rstd[1])
    y, _ = _fwd(case, x, w, b, eps=eps, eps_mode=eps_mode)
    np.testing.assert_array_equal(y[1], b)
    dy = _rand(rng, (3, 8), dtype)
    dx, dw, _ = pn.rms_norm_backward(case.asarray(dy), case.asarray(x), case.asarray(w),
                                     eps=eps, eps_mode=eps_mode, backend=case.backend)
    want = oracle.backward(dy, x, w, eps=eps, eps_mode=eps_mode)
    assert_close(case.to_numpy(dx), want[0], dtype, "dx with a zero token")


# ----------------------------------------------------------------------- llama casting


LLAMA = [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float16", "float16"),
         ("float16", "float32"), ("float32", "float32"), ("float32", "bfloat16")]


@pytest.mark.parametrize("xdt, wdt", LLAMA, ids=lambda p: p)
def test_llama_casting_matches_oracle_emulation(case, xdt, wdt, rng):
    case.skip_unless_dtype(xdt)
    case.skip_unless_dtype(wdt)
    x, w, b = _rand(rng, (6, 48), xdt, 2.0), _rand(rng, (48,), wdt), _rand(rng, (48,), wdt)
    for kw in (dict(), dict(offset=1.0, partial=0.5), dict(out_dtype=promote(xdt, wdt))):
        y, _ = _fwd(case, x, w, b, casting="llama", **kw)
        want, _ = oracle.forward(x, w, b, casting="llama", **kw)
        assert_close(y, want, looser(xdt, dtype_name(y)), f"llama {kw}")


def _hf_compare(ours: np.ndarray, hf: np.ndarray, xdt: str, what: str) -> None:
    """Within 2 ulp of x's dtype (one rounding boundary of xhat), and for half-precision x
    mostly bit-identical (float32 x differs only by float32 compute, rsqrt vs 1/sqrt)."""
    assert dtype_name(ours) == dtype_name(hf), what
    assert_close(ours, hf, looser(xdt, dtype_name(hf)), what)
    if xdt == "float32":
        return
    same = np.mean(ours.astype(np.float64) == hf.astype(np.float64))
    # fp32 casting would agree on far fewer entries where weight is wider than x
    assert same >= 0.9, f"{what}: only {same:.1%} of entries bit-identical to Hugging Face"


@pytest.mark.parametrize("xdt, wdt", LLAMA[:5], ids=lambda p: p)
def test_llama_casting_matches_hf_transcription(case, xdt, wdt, rng):
    """casting='llama' with out_dtype=promote(x, w) is Hugging Face's LlamaRMSNorm."""
    case.skip_unless_dtype(xdt)
    case.skip_unless_dtype(wdt)
    x, w = _rand(rng, (8, 64), xdt, 2.0), _rand(rng, (64,), wdt)
    odt = promote(xdt, wdt)
    y, _ = _fwd(case, x, w, eps=1e-6, casting="llama", out_dtype=odt)
    _hf_compare(y, hf_llama_rms_norm(x, w, 1e-6), xdt, "vs numpy transcription")
    if xdt != wdt:
        y32, _ = _fwd(case, x, w, eps=1e-6, out_dtype=odt)
        assert np.mean(y32 == hf_llama_rms_norm(x, w, 1e-6)) < 0.9, "test cannot tell the casts apart"


@pytest.mark.parametrize("xdt, wdt", LLAMA[:5], ids=lambda p: p)
def test_llama_casting_matches_torch_hf(case, xdt, wdt, rng):
    """The same against HF's code run in torch itself (torch's own rsqrt and mean)."""
    torch = pytest.importorskip("torch")
    case.skip_unless_dtype(xdt)
    case.skip_unless_dtype(wdt)
    x, w = _rand(rng, (8, 64), xdt, 2.0), _rand(rng, (64,), wdt)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    xt = torch.from_numpy(x.astype(np.float32)).to(tdt[xdt])
    wt = torch.from_numpy(w.astype(np.float32)).to(tdt[wdt])
    input_dtype = xt.dtype
    hs = xt.to(torch.float32)
    variance = hs.pow(2).mean(-1, keepdim=True)
    hs = hs * torch.rsqrt(variance + 1e-6)
    hf = (wt * hs.to(input_dtype)).float().numpy().astype(NP_DTYPES[promote(xdt, wdt)])
    y, _ = _fwd(case, x, w, eps=1e-6, casting="llama", out_dtype=promote(xdt, wdt))
    _hf_compare(y, hf, xdt, "vs torch LlamaRMSNorm")


def test_tolerance_table_is_tight_enough():
    """The tolerances are at most a few ulp: a wrong rounding order would be caught."""
    assert TOL["float16"].rtol <= 2 * 2.0**-10 and TOL["bfloat16"].rtol <= 2 * 2.0**-7
    assert TOL["float32"].rtol <= 1e-5 and TOL["float64"].rtol <= 1e-12


# ----------------------------------------------------------------------- many tokens, same bits


def test_many_tokens_match_oracle_and_repeat_bit_for_bit(case, rng):
    """Enough tokens for the compiled backends' parallel paths and blocked dweight sums;
    the same call twice gives the same bits (the spec's determinism)."""
    n, d = 517, 96
    x, dy = _rand(rng, (n, d), "float32", 2.0), _rand(rng, (n, d), "float32")
    w, b = _rand(rng, (d,), "float32"), _rand(rng, (d,), "float32")
    kw = dict(partial=0.5, eps=1e-5)
    runs = []
    for _ in range(2):
        y, rstd = _fwd(case, x, w, b, **kw)
        grads = pn.rms_norm_backward(case.asarray(dy), case.asarray(x), case.asarray(w),
                                     case.asarray(b), backend=case.backend, **kw)
        runs.append([y, rstd, *(case.to_numpy(g) for g in grads)])
    want_y, want_rstd = oracle.forward(x, w, b, **kw)
    want = oracle.backward(dy, x, w, b, **kw)
    names = ("y", "rstd", "dx", "dweight", "dbias")
    for name, got, exp in zip(names, runs[0], (want_y, want_rstd, *want), strict=True):
        assert_close(got, exp, "float32", name)
    for name, a, c in zip(names, runs[0], runs[1], strict=True):
        np.testing.assert_array_equal(a, c, err_msg=f"{name} differs between two identical calls")


# ----------------------------------------------------------------------- the reference everywhere


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reference_backend_on_every_library(case, dtype, rng):
    """backend="array_api" forced on every case's arrays: the pure array-API path must run
    unchanged on numpy, strict, torch, dask, jax and cupy, whichever backend auto would pick."""
    ref = dataclasses.replace(case, backend="array_api")
    x, r, dy = (_rand(rng, (2, 5, 6), dtype, 2.0) for _ in range(3))
    w, b = _rand(rng, (2, 6), dtype), _rand(rng, (2, 6), dtype)
    kw = dict(axis=(0, 2), partial=0.5, eps_mode="outside", offset=1.0, eps=1e-3)
    A = ref.asarray
    y, h, rstd = pn.add_rms_norm(A(x), A(r), A(w), A(b), return_rstd=True, backend="array_api", **kw)
    h = ref.to_numpy(h)
    assert_close(h, oracle.add(x, r), dtype, "h")
    want_y, want_rstd = oracle.forward(h, w, b, **kw)
    assert_close(ref.to_numpy(y), want_y, dtype, "y")
    assert_close(ref.to_numpy(rstd), want_rstd, dtype, "rstd")
    yl = pn.rms_norm(A(x), A(w), casting="llama", backend="array_api", **kw)
    assert_close(ref.to_numpy(yl), oracle.forward(x, w, casting="llama", **kw)[0], dtype, "llama y")
    grads = pn.rms_norm_backward(A(dy), A(h), A(w), A(b), rstd=rstd, grad_residual=A(dy),
                                 backend="array_api", **kw)
    want = oracle.backward(dy, h, w, b, grad_residual=dy, **kw)
    for name, got, exp in zip(("dx", "dweight", "dbias"), grads, want, strict=True):
        assert_close(ref.to_numpy(got), exp, dtype, name)
