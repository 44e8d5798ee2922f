"""Gated RMSNorm: an independent extended-precision oracle, float64 finite
differences of dx, dz, dweight and dbias, batch invariance and the errors.

The oracle re-derives the operation from the issue's text (Mamba-2's
``RMSNormGated``: ``rms_norm(x * silu(z))`` or ``rms_norm(x) * silu(z)``,
statistic per group of ``group_size`` channels, weight over all ``d``) in
``np.longdouble``; it does not import polynorm's own formulas.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import LD, NP_DTYPES, TOL, Tol, assert_close

import polynorm as pn

EPS = 0.05  # large, so that eps inside/outside are told apart


def oracle(x, z, w=None, b=None, *, group_size=None, nbg=False, eps=EPS, eps_mode="inside",
           offset=0.0, partial=1.0):
    """float64 y and rstd (rows, groups) of 2-D x, z."""
    xl, zl = x.astype(LD), z.astype(LD)
    s = zl / (LD(1) + np.exp(-zl))
    n, d = x.shape
    gs = d if group_size is None else group_size
    k = int(np.floor(d * partial)) if gs == d else gs
    v = xl if nbg else xl * s
    vg = v.reshape(n, d // gs, gs)
    ms = np.sum(vg[:, :, :k] ** 2, axis=2) / LD(k)
    rstd = LD(1) / (np.sqrt(ms + LD(eps)) if eps_mode == "inside" else np.sqrt(ms) + LD(eps))
    y = (vg * rstd[:, :, None]).reshape(n, d)
    if w is not None:
        y = y * (w.astype(LD) + LD(offset))
    if b is not None:
        y = y + b.astype(LD)
    if nbg:
        y = y * s
    return y.astype(np.float64), rstd.astype(np.float64)


def _data(n=4, d=8, dtype="float64", seed=0):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    z = (2 * rng.standard_normal((n, d))).astype(dt)
    w = (1 + 0.3 * rng.standard_normal(d)).astype(dt)
    b = (0.2 * rng.standard_normal(d)).astype(dt)
    return x, z, w, b


BACKENDS = ["array_api", "numba"]
CASES = [
    dict(nbg=False), dict(nbg=True), dict(nbg=False, group_size=4), dict(nbg=True, group_size=2),
    dict(nbg=False, eps_mode="outside", offset=1.0), dict(nbg=True, partial=0.5),
]


def _kw(case):
    c = dict(case)
    return dict(norm_before_gate=c.pop("nbg"), eps=EPS, **c)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_oracle_float64(backend, case):
    x, z, w, b = _data()
    y, r = pn.rms_norm_gated(x, z, w, b, return_rstd=True, backend=backend, **_kw(case))
    want_y, want_r = oracle(x, z, w, b, **case)
    assert_close(y, want_y, "float64", "y")
    assert_close(np.reshape(r, want_r.shape), want_r, "float64", "rstd")
    assert r.shape == ((4,) if case.get("group_size") is None else (4, 8 // case["group_size"]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_oracle_low_precision(backend, dtype):
    x, z, w, _ = _data(dtype=dtype, d=16)
    for nbg in (False, True):
        y = pn.rms_norm_gated(x, z, w, group_size=8, norm_before_gate=nbg, eps=EPS, backend=backend)
        assert y.dtype == x.dtype
        want, _ = oracle(x, z, w, group_size=8, nbg=nbg)
        assert_close(y, want, dtype, f"y nbg={nbg}")


# --------------------------------------------------------------------------- finite differences

H = 1e-6
FD_TOL = Tol(1e-6, 1e-6)


def _loss(G, backend, kw, x, z, w, b):
    return float(np.sum(pn.rms_norm_gated(x, z, w, b, backend=backend, **kw) * G))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_backward_finite_differences(backend, case):
    x, z, w, b = _data(n=3, d=8, seed=1)
    G = np.random.default_rng(2).standard_normal(x.shape)
    kw = _kw(case)
    _, r = pn.rms_norm_gated(x, z, w, b, return_rstd=True, backend=backend, **kw)
    for rstd in (None, r):
        dx, dz, dw, db = pn.rms_norm_gated_backward(G, x, z, w, b, rstd=rstd, backend=backend, **kw)
        for name, a, got in (("x", x, dx), ("z", z, dz), ("weight", w, dw), ("bias", b, db)):
            want = np.zeros_like(a)
            for idx in np.ndindex(a.shape):
                ap, am = a.copy(), a.copy()
                ap[idx] += H
                am[idx] -= H
                args = {"x": x, "z": z, "weight": w, "bias": b}
                lp = _loss(G, backend, kw, *({**args, name: ap}.values()))
                lm = _loss(G, backend, kw, *({**args, name: am}.values()))
                want[idx] = (lp - lm) / (2 * H)
            assert_close(got, want, FD_TOL, f"d{name} (rstd given: {rstd is not None})")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nbg", [False, True])
def test_backward_without_weight_ignores_offset(backend, nbg):
    """offset scales only a weight: without one, dx/dz are the finite differences of
    the forward (which ignores offset), whatever offset is."""
    x, z, _, _ = _data(n=3, d=8, seed=4)
    G = np.random.default_rng(5).standard_normal(x.shape)
    kw = dict(norm_before_gate=nbg, eps=EPS, offset=1.0)
    dx, dz, dw, db = pn.rms_norm_gated_backward(G, x, z, backend=backend, **kw)
    assert dw is None and db is None
    for name, a, got in (("x", x, dx), ("z", z, dz)):
        want = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            ap, am = a.copy(), a.copy()
            ap[idx] += H
            am[idx] -= H
            pair = {"x": (ap, z), "z": (x, ap)}[name], {"x": (am, z), "z": (x, am)}[name]
            lp, lm = (_loss(G, backend, kw, *p, None, None) for p in pair)
            want[idx] = (lp - lm) / (2 * H)
        assert_close(got, want, FD_TOL, f"d{name}")


# --------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nbg", [False, True])
def test_batch_invariance(backend, nbg):
    x, z, w, _ = _data(n=9, d=64, dtype="float32", seed=3)
    kw = dict(group_size=16, norm_before_gate=nbg, backend=backend)
    dy = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    y, r = pn.rms_norm_gated(x, z, w, return_rstd=True, **kw)
    dx, dz, _, _ = pn.rms_norm_gated_backward(dy, x, z, w, **kw)
    xf, zf, dyf = np.asfortranarray(x), np.asfortranarray(z), np.asfortranarray(dy)
    np.testing.assert_array_equal(pn.rms_norm_gated(xf, zf, w, **kw), y)
    dxF, dzF, _, _ = pn.rms_norm_gated_backward(dyf, xf, zf, w, **kw)
    np.testing.assert_array_equal(dxF, dx)
    np.testing.assert_array_equal(dzF, dz)
    for i in (0, 4, 8):
        sl = slice(i, i + 1)
        yi, ri = pn.rms_norm_gated(x[sl], z[sl], w, return_rstd=True, **kw)
        dxi, dzi, _, _ = pn.rms_norm_gated_backward(dy[sl], x[sl], z[sl], w, **kw)
        for got, whole in ((yi, y), (ri, r), (dxi, dx), (dzi, dz)):
            np.testing.assert_array_equal(got.view(np.uint32), whole[sl].view(np.uint32))


def test_numba_matches_reference_16bit_and_axis():
    import ml_dtypes

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 8)).astype(ml_dtypes.bfloat16)
    z = rng.standard_normal((3, 4, 8)).astype(np.float32)
    w = rng.standard_normal((3, 8)).astype(np.float32)
    kw = dict(axis=(0, 2), group_size=6, norm_before_gate=True, eps=EPS)
    yn = pn.rms_norm_gated(x, z, w, backend="numba", **kw)
    ya = pn.rms_norm_gated(x, z, w, backend="array_api", **kw)
    assert yn.dtype == x.dtype
    assert_close(yn, ya.astype(np.float64), TOL["bfloat16"], "numba vs reference")
    dy = rng.standard_normal(x.shape).astype(ml_dtypes.bfloat16)
    gn = pn.rms_norm_gated_backward(dy, x, z, w, backend="numba", **kw)
    ga = pn.rms_norm_gated_backward(dy, x, z, w, backend="array_api", **kw)
    for a, b_, name in zip(gn, ga, ("dx", "dz", "dw", "db"), strict=True):
        if b_ is None:
            assert a is None
            continue
        assert a.dtype == b_.dtype
        assert_close(a, b_.astype(np.float64), TOL["bfloat16"], name)


# --------------------------------------------------------------------------- other arrays


def _silu_inputs(n_rows):
    """float32 inputs for silu: the exp's cut-offs and their neighbours, zeros, infinities,
    NaN, subnormals, and random bit patterns; ``(n_rows, SILU_BLOCK)``."""
    from polynorm.backends.numba import gated as G

    base = np.array([0.0, 1e-45, 1e-38, 1e-8, 0.5, 1.0, 10.0, 20.0, 30.0, 85.0, 86.0, 87.0,
                     88.0, 88.37, 88.72283935546875, 89.0, 100.0, 1e10, 3e38, np.inf, np.nan],
                    np.float32)
    base = np.concatenate([base, -base])
    near = np.concatenate([np.nextafter(base, np.float32(np.inf)),
                           np.nextafter(base, np.float32(-np.inf))])
    rnd = np.random.default_rng(0).integers(0, 2**32, n_rows * G.SILU_BLOCK,
                                            dtype=np.uint64).astype(np.uint32).view(np.float32)
    v = np.concatenate([base, near, rnd])
    return v[: v.size // G.SILU_BLOCK * G.SILU_BLOCK].reshape(-1, G.SILU_BLOCK)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_numba_silu_block_is_the_scalar_silu(dtype):
    """The forward's vector silu blocks (``_silu_block``) give the scalar loop's bits,
    the product with x included, for every special value and random patterns."""
    from numba import njit

    from polynorm.backends.numba import _kview
    from polynorm.backends.numba import gated as G
    from polynorm.backends.numba.codec import HW_HALF, load
    from polynorm.core.dtypes import numpy_dtype

    if dtype == "float16" and not HW_HALF:
        pytest.skip("float16 blocks need the CPU's half conversions (else the scalar loop runs)")

    @njit
    def both(x, z, blk, blk_x, ref, ref_x):
        for i in range(z.shape[0]):
            G._silu_block(x, z, blk[i:i + 1], i, 0, False)
            G._silu_block(x, z, blk_x[i:i + 1], i, 0, True)
            for j in range(z.shape[1]):
                s = G.silu(np.float32(load(z[i, j])))
                ref[i, j] = s
                ref_x[i, j] = np.float32(load(x[i, j])) * s

    v = _silu_inputs(64)
    with np.errstate(invalid="ignore", over="ignore"):
        z = _kview(np.ascontiguousarray(v.astype(numpy_dtype(dtype))))
        x = _kview(np.ascontiguousarray(v[::-1].astype(numpy_dtype(dtype))))
    out = [np.zeros(v.shape, np.float32) for _ in range(4)]
    both(x, z, *out)
    assert np.isnan(out[2]).any() and np.isinf(out[2]).any()
    np.testing.assert_array_equal(out[0].view(np.uint32), out[2].view(np.uint32))
    np.testing.assert_array_equal(out[1].view(np.uint32), out[3].view(np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_numba_dsilu_block_is_the_scalar_dsilu(dtype):
    """The backward's vector blocks (``_dsilu_block``: silu and its derivative) give
    the scalar loop's bits for every special value and random patterns."""
    from numba import njit

    from polynorm.backends.numba import _kview
    from polynorm.backends.numba import gated as G
    from polynorm.backends.numba.codec import HW_HALF, load
    from polynorm.core.dtypes import numpy_dtype

    if dtype == "float16" and not HW_HALF:
        pytest.skip("float16 blocks need the CPU's half conversions (else the scalar loop runs)")

    @njit
    def both(z, blk, ref):
        one = np.float32(1.0)
        for i in range(z.shape[0]):
            G._dsilu_block(z, blk[i], i, 0)
            for j in range(z.shape[1]):
                zj = np.float32(load(z[i, j]))
                den = one + G.exp_c(-zj)
                sig = one / den
                ref[i, 0, j] = zj / den
                ref[i, 1, j] = sig * (one + zj * (one - sig))

    v = _silu_inputs(64)
    with np.errstate(invalid="ignore", over="ignore"):
        z = _kview(np.ascontiguousarray(v.astype(numpy_dtype(dtype))))
    blk, ref = (np.zeros((v.shape[0], 2, v.shape[1]), np.float32) for _ in range(2))
    both(z, blk, ref)
    assert np.isnan(ref).any() and np.isinf(ref).any()
    np.testing.assert_array_equal(blk.view(np.uint32), ref.view(np.uint32))


def test_array_api_strict_and_torch():
    import array_api_strict as xps

    torch = pytest.importorskip("torch")

    x, z, w, b = _data(dtype="float32")
    want, _ = oracle(x, z, w, b, group_size=4, nbg=True)
    ys = pn.rms_norm_gated(xps.asarray(x), xps.asarray(z), xps.asarray(w), xps.asarray(b),
                           group_size=4, norm_before_gate=True, eps=EPS)
    assert type(ys) is type(xps.asarray(x))
    assert_close(np.asarray(ys), want, "float32", "array-api-strict")
    yt = pn.rms_norm_gated(torch.from_numpy(x), torch.from_numpy(z), torch.from_numpy(w),
                           torch.from_numpy(b), group_size=4, norm_before_gate=True, eps=EPS)
    assert isinstance(yt, torch.Tensor)
    assert_close(yt.numpy(), want, "float32", "torch")


def test_out_and_inputs_untouched():
    x, z, w, _ = _data(dtype="float32")
    x0, z0 = x.copy(), z.copy()
    out = np.empty_like(x)
    y = pn.rms_norm_gated(x, z, w, out=out)
    assert y is out
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(z, z0)
    np.testing.assert_array_equal(out, pn.rms_norm_gated(x, z, w))
    with pytest.raises(ValueError, match="out overlaps z"):
        pn.rms_norm_gated(x, z, w, out=z)


def test_zero_tokens():
    x = np.zeros((0, 8), np.float32)
    y, r = pn.rms_norm_gated(x, x, group_size=4, return_rstd=True)
    assert y.shape == (0, 8) and r.shape == (0, 2)
    dx, dz, dw, db = pn.rms_norm_gated_backward(x, x, x, np.ones(8, np.float32), group_size=4)
    assert dx.shape == dz.shape == (0, 8) and dw.shape == (8,) and not dw.any() and db is None


@pytest.mark.parametrize("kw, exc, match", [
    (dict(group_size=3), ValueError, "group_size=3"),
    (dict(group_size=0), ValueError, "group_size=0"),
    (dict(group_size=2.0), TypeError, "group_size"),
    (dict(group_size=4, partial=0.5), ValueError, "partial"),
    (dict(norm_before_gate="yes"), TypeError, "norm_before_gate"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(backend="dask"), TypeError, "backend"),
])
def test_errors(kw, exc, match):
    if kw.get("backend") == "dask":
        pytest.importorskip("dask")  # without dask the backend is unavailable: a ValueError
    x, z, w, _ = _data(dtype="float32")
    with pytest.raises(exc, match=match):
        pn.rms_norm_gated(x, z, w, **kw)


def test_errors_arrays():
    x, z, w, _ = _data(dtype="float32")
    with pytest.raises(ValueError, match="z must have shape"):
        pn.rms_norm_gated(x, z[:, :4], w)
    with pytest.raises(TypeError, match="z"):
        pn.rms_norm_gated(x, z.astype(np.int32), w)
    with pytest.raises(TypeError, match="z"):
        pn.rms_norm_gated(x, [[1.0] * 8] * 4, w)
    with pytest.raises(ValueError, match="rstd must have shape"):
        pn.rms_norm_gated_backward(x, x, z, w, group_size=4, rstd=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="out"):
        pn.rms_norm_gated_backward(x, x, z, w, out=x)


def test_dask_per_chunk():
    da = pytest.importorskip("dask.array")
    x, z, w, b = _data(n=7, d=8, dtype="float32", seed=6)
    dy = np.random.default_rng(7).standard_normal(x.shape).astype(np.float32)
    kw = dict(group_size=4, norm_before_gate=True, eps=EPS)
    c = dict(chunks=(3, 8))
    xd, zd, dyd = da.from_array(x, **c), da.from_array(z, **c), da.from_array(dy, **c)
    y, r = pn.rms_norm_gated(xd, zd, w, b, return_rstd=True, **kw)
    assert isinstance(y, da.Array) and r.shape == (7, 2)
    y0, r0 = pn.rms_norm_gated(x, z, w, b, return_rstd=True, **kw)
    np.testing.assert_array_equal(y.compute(), y0)
    np.testing.assert_array_equal(r.compute(), r0)
    got = pn.rms_norm_gated_backward(dyd, xd, zd, w, b, rstd=r, **kw)
    want = pn.rms_norm_gated_backward(dy, x, z, w, b, **kw)
    np.testing.assert_array_equal(got[0].compute(), want[0])
    np.testing.assert_array_equal(got[1].compute(), want[1])
    for g, e in zip(got[2:], want[2:], strict=True):  # chunk-order sums: not the row tree's bits
        assert_close(np.asarray(g), e.astype(np.float64), "float32", "dweight/dbias")


# --------------------------------------------------------------------------- the Numba forward's numerics


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numba_nbg_rstd_is_rms_norms(dtype):
    # norm_before_gate=True takes the statistic of x with the plain forward's
    # reduction: a group's rstd has the bits rms_norm gives it as a row
    x, z, w, _ = _data(n=5, d=96, dtype=dtype, seed=8)
    for gs, partial in ((None, 1.0), (None, 0.7), (32, 1.0)):
        _, r = pn.rms_norm_gated(x, z, w, group_size=gs, norm_before_gate=True, eps=EPS,
                                 partial=partial, return_rstd=True, backend="numba")
        rows = x if gs is None else x.reshape(-1, gs)
        _, want = pn.rms_norm(rows, eps=EPS, partial=partial, return_rstd=True, backend="numba")
        np.testing.assert_array_equal(np.reshape(r, -1).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("nbg", [False, True])
def test_numba_gate_specials(nbg):
    # silu's exp is the kernels' own: inf, NaN and overflowing z as numpy's float32 formula
    z = np.array([[np.inf, -np.inf, np.nan, 0.0, -0.0, 88.8, -88.8, 100.0, -100.0, 3.0, -3.0,
                   1e30]], np.float32)
    x = np.linspace(0.5, 2.0, z.shape[1], dtype=np.float32)[None]
    y = pn.rms_norm_gated(x, z, norm_before_gate=nbg, eps=EPS, backend="numba")
    ya = pn.rms_norm_gated(x, z, norm_before_gate=nbg, eps=EPS, backend="array_api")
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ya))
    assert_close(np.where(np.isnan(y), 0, y), np.where(np.isnan(ya), 0, ya).astype(np.float64),
                 "float32", "y")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numba_parallel_rows_invariant(dtype):
    # large enough for the parallel driver: each row's bits are those of the row alone
    x, z, w, b = _data(n=70, d=1024, dtype=dtype, seed=9)
    for nbg in (False, True):
        kw = dict(norm_before_gate=nbg, group_size=256, eps=EPS, backend="numba")
        y, r = pn.rms_norm_gated(x, z, w, b, return_rstd=True, **kw)
        want, _ = oracle(x, z, w, b, group_size=256, nbg=nbg)
        assert_close(y, want, dtype, f"y nbg={nbg}")
        dy = np.random.default_rng(10).standard_normal(x.shape).astype(x.dtype)
        dx, dz, _, _ = pn.rms_norm_gated_backward(dy, x, z, w, b, **kw)
        for i in (0, 37, 69):
            sl = slice(i, i + 1)
            yi, ri = pn.rms_norm_gated(x[sl], z[sl], w, b, return_rstd=True, **kw)
            np.testing.assert_array_equal(yi.view(np.uint16), y[sl].view(np.uint16))
            np.testing.assert_array_equal(ri, r[sl])
            # the backward recomputes the forward's rstd bits, or takes them
            for rs in (None, ri):
                dxi, dzi, _, _ = pn.rms_norm_gated_backward(dy[sl], x[sl], z[sl], w, b, rstd=rs,
                                                            **kw)
                np.testing.assert_array_equal(dxi.view(np.uint16), dx[sl].view(np.uint16))
                np.testing.assert_array_equal(dzi.view(np.uint16), dz[sl].view(np.uint16))
