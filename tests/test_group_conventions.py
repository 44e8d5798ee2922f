"""``group_size`` on the plain norm: Mamba's ``RMSNormGated`` without a gate.

The oracle is Mamba's own torch reference (``mamba_ssm/ops/triton/layernorm_gated.py``
``rms_norm_ref`` with ``z=None``, ``upcast=True``), written out here in numpy:
x, weight and bias in float32 (float64 stays float64), every group of ``group_size``
consecutive elements gets ``rstd = 1 / sqrt(mean(x_group**2) + eps)``, then
``out = rearrange(x_group * rstd) * weight + bias`` rounded once to x's dtype.
Its Triton kernel (``_layer_norm_fwd_1pass_kernel``, one program per (row, group))
does the same float32 steps.  The backward is Mamba's too (``_layer_norm_bwd_kernel``
per group, ``dw``/``db`` summed over rows); it is checked by central differences in
tests/test_backward_fd.py (the ``grouped`` configurations) and against the
written-out formula below.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from _oracle import NP_DTYPES, TOL, Tol, assert_close

import polynorm as pn

EPS = 1e-5


def mamba_rms_norm_ref(x, weight=None, bias=None, *, eps=EPS, group_size=None):
    """Mamba's ``rms_norm_ref(x, weight, bias, z=None, group_size=...)``: ``(out, rstd)``,
    rstd as ``(rows, groups)``."""
    dtype = x.dtype
    cdt = np.float64 if dtype == np.float64 else np.float32
    xf = x.astype(cdt)
    n, d = xf.shape
    gs = d if group_size is None else group_size
    xg = xf.reshape(n, d // gs, gs)
    rstd = cdt(1) / np.sqrt(np.mean(np.square(xg), axis=-1, keepdims=True) + cdt(eps))
    out = (xg * rstd).reshape(n, d)
    if weight is not None:
        out = out * weight.astype(cdt)
    if bias is not None:
        out = out + bias.astype(cdt)
    return out.astype(dtype), rstd[..., 0]


def mamba_rms_norm_bwd(dy, x, weight, *, eps=EPS, group_size):
    """Mamba's ``_layer_norm_bwd_kernel`` (is_rms_norm, no z) per group, in float64:
    ``xhat = x * rstd``, ``wdy = w * dy``, ``dx = (wdy - xhat * mean(xhat * wdy)) * rstd``,
    ``dw = sum_rows dy * xhat``, ``db = sum_rows dy``."""
    n, d = x.shape
    xg = x.astype(np.float64).reshape(n, d // group_size, group_size)
    dyg = dy.astype(np.float64).reshape(xg.shape)
    wg = weight.astype(np.float64).reshape(1, d // group_size, group_size)
    rstd = 1 / np.sqrt(np.mean(xg * xg, axis=-1, keepdims=True) + eps)
    xhat = xg * rstd
    wdy = wg * dyg
    c1 = np.mean(xhat * wdy, axis=-1, keepdims=True)
    dx = (wdy - xhat * c1) * rstd
    return dx.reshape(n, d), (dyg * xhat).reshape(n, d).sum(0), dy.astype(np.float64).sum(0)


def _data(rng, n, d, dtype):
    dt = NP_DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    w = (1 + 0.3 * rng.standard_normal(d)).astype(dt)
    b = (0.2 * rng.standard_normal(d)).astype(dt)
    return x, w, b


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_forward_is_mambas_rms_norm_ref(case, dtype, rng):
    case.skip_unless_dtype(dtype)
    x, w, b = _data(rng, 5, 12, dtype)
    A = case.asarray
    y, rstd = pn.rms_norm(A(x), A(w), A(b), eps=EPS, group_size=4, return_rstd=True,
                          backend=case.backend)
    want, want_r = mamba_rms_norm_ref(x, w, b, group_size=4)
    assert tuple(rstd.shape) == (5, 3)
    assert case.to_numpy(y).dtype == want.dtype
    # one rounding of the same float32 value: at most one ulp of the output dtype apart
    assert_close(case.to_numpy(y), want, dtype, "y")
    assert_close(case.to_numpy(rstd), want_r, "float32", "rstd")
    dy = rng.standard_normal((5, 12)).astype(NP_DTYPES[dtype])
    dx, dw, db = pn.rms_norm_backward(A(dy), A(x), A(w), A(b), rstd=rstd, eps=EPS, group_size=4,
                                      backend=case.backend)
    wdx, wdw, wdb = mamba_rms_norm_bwd(dy, x, w, group_size=4)
    tol = TOL[dtype]
    assert_close(case.to_numpy(dx), wdx, Tol(tol.rtol * 4, tol.atol * 4, tol.floor), "dx")
    assert_close(case.to_numpy(dw), wdw, Tol(tol.rtol * 8, tol.atol * 8, tol.floor), "dweight")
    assert_close(case.to_numpy(db), wdb, Tol(tol.rtol * 8, tol.atol * 8, tol.floor), "dbias")


def test_grouped_float64_matches_the_formula_closely(rng):
    """float64: the formula to a few ulps, so a wrong group boundary or weight period fails."""
    x, w, b = _data(rng, 4, 16, "float64")
    for gs in (1, 2, 8, 16):
        y, r = pn.rms_norm(x, w, b, eps=EPS, group_size=gs, return_rstd=True)
        want, want_r = mamba_rms_norm_ref(x, w, b, group_size=gs)
        np.testing.assert_allclose(y, want, rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(r, want_r, rtol=1e-14)
        assert r.shape == (4, 16 // gs)


def test_group_of_d_is_rms_norm_with_a_groups_axis(rng):
    x, w, _ = _data(rng, 3, 8, "float32")
    y, r = pn.rms_norm(x, w, group_size=8, return_rstd=True)
    y0, r0 = pn.rms_norm(x, w, return_rstd=True)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(r, r0[:, None])


def test_grouped_add_rms_norm_and_axes(rng):
    """The fused add normalizes h per group; a 3-D x and a tuple axis group the slice in
    C order."""
    x, w, b = _data(rng, 6, 8, "float32")
    res = rng.standard_normal((6, 8)).astype(np.float32)
    y, h = pn.add_rms_norm(x, res, w, b, eps=EPS, group_size=2)
    np.testing.assert_array_equal(h, x + res)
    assert_close(y, mamba_rms_norm_ref(x + res, w, b, group_size=2)[0], "float32", "y")
    x3 = x.reshape(2, 3, 8)
    y3 = pn.rms_norm(x3, w.reshape(1, 8).repeat(3, 0), axis=(1, 2), eps=EPS, group_size=6)
    want = mamba_rms_norm_ref(x3.reshape(2, 24), np.tile(w, 3), group_size=6)[0]
    assert_close(y3.reshape(2, 24), want, "float32", "y (tuple axis)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the slow run (tests/conftest.py)
def test_grouped_batch_invariant(dtype, rng):
    x, w, _ = _data(rng, 9, 12, dtype)
    y = pn.rms_norm(x, w, group_size=3)
    for i in (0, 4, 8):
        np.testing.assert_array_equal(pn.rms_norm(x[i:i + 1], w, group_size=3), y[i:i + 1])


def test_rms_norm_gated_without_a_gate(rng):
    """Mamba's ``RMSNormGated(x, z=None)``: the grouped plain norm, dz is None."""
    x, w, _ = _data(rng, 4, 8, "float32")
    y, r = pn.rms_norm_gated(x, None, w, group_size=4, eps=EPS, return_rstd=True)
    want, want_r = mamba_rms_norm_ref(x, w, group_size=4)
    assert_close(y, want, "float32", "y")
    assert r.shape == (4, 2)
    dy = rng.standard_normal((4, 8)).astype(np.float32)
    dx, dz, dw, db = pn.rms_norm_gated_backward(dy, x, None, w, group_size=4, eps=EPS)
    assert dz is None and db is None
    wdx, wdw, _ = mamba_rms_norm_bwd(dy, x, w, group_size=4)
    assert_close(dx, wdx, Tol(4e-6, 4e-6), "dx")
    assert_close(dw, wdw, Tol(1e-5, 1e-5), "dweight")


@pytest.mark.parametrize(("kw", "exc", "match"), [
    (dict(group_size=5), ValueError, "group_size=5"),
    (dict(group_size=0), ValueError, "group_size=0"),
    (dict(group_size=True), TypeError, "group_size must be an int"),
    (dict(group_size=2.0), TypeError, "group_size must be an int"),
    (dict(group_size=4, partial=0.5), ValueError, "group_size=4 < d=8 cannot be combined"),
    (dict(group_size=4, partial_size=3), ValueError, "partial"),
])
def test_grouped_errors(kw, exc, match):
    x = np.ones((2, 8), np.float32)
    with pytest.raises(exc, match=match):
        pn.rms_norm(x, **kw)
    with pytest.raises(exc, match=match):
        pn.rms_norm_backward(x, x, **kw)


def test_grouped_backward_rstd_shape_is_checked():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="rstd must have shape"):
        pn.rms_norm_backward(x, x, group_size=4, rstd=np.ones(2, np.float32))


def test_grouped_torch_autograd(rng):
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x, w, b = _data(rng, 3, 8, "float64")
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    assert torch.autograd.gradcheck(
        lambda a, c, e: pt.rms_norm(a, c, e, eps=EPS, group_size=2), (xt, wt, bt))
    y = pt.rms_norm(xt, wt, eps=EPS, group_size=4)
    np.testing.assert_allclose(y.detach().numpy(), mamba_rms_norm_ref(x, w, group_size=4)[0],
                               rtol=1e-14, atol=1e-14)
    dy = rng.standard_normal((3, 8))
    y.backward(torch.tensor(dy))
    wdx, wdw, _ = mamba_rms_norm_bwd(dy, x, w, group_size=4)
    np.testing.assert_allclose(xt.grad.numpy(), wdx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(wt.grad.numpy(), wdw, rtol=1e-12, atol=1e-12)
    m = pt.RMSNormGated(8, eps=EPS, group_size=4)
    np.testing.assert_allclose(m(torch.tensor(x)).detach().numpy(),
                               mamba_rms_norm_ref(x, group_size=4)[0], rtol=1e-14)


@pytest.mark.slow
def test_grouped_torch_compile_fullgraph(rng):
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x, w, _ = _data(rng, 3, 8, "float32")
    xt, wt = (torch.tensor(a, requires_grad=True) for a in (x, w))
    f = torch.compile(lambda a, c: pt.rms_norm(a, c, eps=EPS, group_size=4), fullgraph=True)
    y = f(xt, wt)
    assert_close(y.detach().numpy(), mamba_rms_norm_ref(x, w, group_size=4)[0], "float32", "y")
    dy = rng.standard_normal((3, 8)).astype(np.float32)
    y.backward(torch.tensor(dy))
    wdx, wdw, _ = mamba_rms_norm_bwd(dy, x, w, group_size=4)
    assert_close(xt.grad.numpy(), wdx, Tol(4e-6, 4e-6), "dx")
    assert_close(wt.grad.numpy(), wdw, Tol(1e-5, 1e-5), "dweight")


def test_grouped_jax_grad_under_jit(rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    import polynorm.jax as pj

    x, w, _ = _data(rng, 3, 8, "float64")
    dy = rng.standard_normal((3, 8))

    def loss(a, c):
        return jnp.sum(pj.rms_norm(a, c, eps=EPS, group_size=4) * dy)

    for f in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
        gx, gw = f(jnp.asarray(x), jnp.asarray(w))
        wdx, wdw, _ = mamba_rms_norm_bwd(dy, x, w, group_size=4)
        np.testing.assert_allclose(np.asarray(gx), wdx, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(gw), wdw, rtol=1e-12, atol=1e-12)


@pytest.fixture
def fake_cupy(monkeypatch):
    """test_emul_cupy_backend.py's stand-in cupy: the generated CUDA kernels, NVRTC's
    source run by the CPU emulator."""
    import test_emul_cupy_backend as E

    from polynorm.backends import cuda as cupy_backend
    from polynorm.backends.cuda import nvrtc as _nvrtc

    monkeypatch.setitem(sys.modules, "cupy", E._make_fake_cupy(3, 227 * 1024))
    monkeypatch.setattr(_nvrtc, "available", lambda: (True, "stubbed"))
    monkeypatch.setattr(_nvrtc, "cached_cubin", E._stub_cached_cubin)
    monkeypatch.setattr(cupy_backend, "_kernels", {})
    monkeypatch.setattr(cupy_backend, "_device_info", {})
    # the front end's registry answers once per process: usable, for this test only
    _backends = sys.modules["polynorm.backends"]  # polynorm.backends is also a function
    monkeypatch.setitem(_backends._status, "cupy", (True, "ok"))
    monkeypatch.setitem(_backends._loaded, "cupy", cupy_backend)
    E._POINTERS.clear()
    E._Kernel.launches.clear()
    yield E._fake, E._Kernel.launches
    E._POINTERS.clear()


def test_emul_cupy_grouped(fake_cupy, rng):
    """backend="cupy" runs the groups on the CUDA kernels (emulated), Mamba's bits within
    the float32 rounding, the backward its formula."""
    fake, launches = fake_cupy
    x, w, b = _data(rng, 5, 12, "float32")
    y, r = pn.rms_norm(fake(x), fake(w), fake(b), eps=EPS, group_size=4, return_rstd=True,
                       backend="cupy")
    want, want_r = mamba_rms_norm_ref(x, w, b, group_size=4)
    assert_close(np.asarray(y), want, "float32", "y")
    assert_close(np.asarray(r), want_r, "float32", "rstd")
    assert any(nm.startswith("pn_fwd") for nm, *_ in launches)
    dy = rng.standard_normal((5, 12)).astype(np.float32)
    dx, dw, db = pn.rms_norm_backward(fake(dy), fake(x), fake(w), fake(b), eps=EPS,
                                      group_size=4, backend="cupy")
    wdx, wdw, wdb = mamba_rms_norm_bwd(dy, x, w, group_size=4)
    assert_close(np.asarray(dx), wdx, Tol(4e-6, 4e-6), "dx")
    assert_close(np.asarray(dw), wdw, Tol(1e-5, 1e-5), "dweight")
    assert_close(np.asarray(db), wdb, Tol(1e-5, 1e-5), "dbias")
    assert any(nm.startswith("pn_bwd") for nm, *_ in launches)
