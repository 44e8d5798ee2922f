"""Per-head weights: ``weight``/``bias`` of shape ``x.shape[-m:]`` spanning batch axes.

QuACK's ``(H, N)`` weight and Flax's ``feature_axes``: x of shape (T, H, D),
weight (H, D), each head's row normalized over D with its own weight row.
The forward is checked against the formula written out here, the backward
against central differences, and the bits against one plain call per row.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import Tol, assert_close

import polynorm as pn

EPS = 0.05
#: the finite-difference tolerance of tests/test_backward_fd.py (step 1e-6, float64)
FD_TOL = Tol(1e-6, 1e-6)


def _formula(x, w, b, eps=EPS, residual=None):
    """float64 RMSNorm over the last axis with weight/bias broadcast from the right."""
    v = x.astype(np.float64) if residual is None else x.astype(np.float64) + residual
    rstd = 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    y = v * rstd
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, rstd[..., 0]


def test_per_head_forward_and_backward_on_every_case(case, rng):
    x = rng.standard_normal((3, 2, 4, 6))
    r = rng.standard_normal(x.shape)
    w = 1 + 0.5 * rng.standard_normal((2, 4, 6))  # two head axes
    b = rng.standard_normal((2, 4, 6))
    A, kw = case.asarray, dict(eps=EPS, backend=case.backend)
    y, rstd = pn.rms_norm(A(x), A(w), A(b), return_rstd=True, **kw)
    want, want_rstd = _formula(x, w, b)
    assert_close(case.to_numpy(y), want, "float64", "y")
    assert_close(case.to_numpy(rstd), want_rstd, "float64", "rstd")
    ya, h = pn.add_rms_norm(A(x), A(r), A(w), A(b), **kw)
    assert_close(case.to_numpy(ya), _formula(x, w, b, residual=r)[0], "float64", "add y")
    assert_close(case.to_numpy(h), x + r, "float64", "h")
    dy = rng.standard_normal(x.shape)
    dx, dw, db = pn.rms_norm_backward(A(dy), A(x), A(w), A(b), rstd=rstd, **kw)
    xhat = x * want_rstd[..., None]
    assert_close(case.to_numpy(dw), (dy * xhat).sum(axis=0), "float64", "dweight")
    assert_close(case.to_numpy(db), dy.sum(axis=0), "float64", "dbias")
    g = dy * w
    want_dx = want_rstd[..., None] * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    assert_close(case.to_numpy(dx), want_dx, "float64", "dx")
    assert tuple(dw.shape) == w.shape and tuple(db.shape) == b.shape


@pytest.mark.parametrize("add", [False, True], ids=["plain", "add"])
def test_per_head_backward_matches_central_differences(rng, add):
    x = rng.standard_normal((3, 2, 5))
    res = rng.standard_normal(x.shape) if add else None
    w = 1 + 0.5 * rng.standard_normal((2, 5))
    b = rng.standard_normal((2, 5))
    G, Gh = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    kw = dict(eps=EPS, offset=0.5)

    def loss(xv, wv, bv):
        if res is None:
            return float(np.sum(pn.rms_norm(xv, wv, bv, **kw) * G))
        y, h = pn.add_rms_norm(xv, res, wv, bv, **kw)
        return float(np.sum(y * G) + np.sum(h * Gh))

    def fd(f, a, step=1e-6):
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            e = np.zeros_like(a)
            e[i] = step
            g[i] = (f(a + e) - f(a - e)) / (2 * step)
        return g

    if res is None:
        dx, dw, db = pn.rms_norm_backward(G, x, w, b, **kw)
    else:
        _, h, rstd = pn.add_rms_norm(x, res, w, b, return_rstd=True, **kw)
        dx, dw, db = pn.rms_norm_backward(G, h, w, b, rstd=rstd, grad_residual=Gh, **kw)
    assert_close(dx, fd(lambda a: loss(a, w, b), x), FD_TOL, "dx")
    assert_close(dw, fd(lambda a: loss(x, a, b), w), FD_TOL, "dweight")
    assert_close(db, fd(lambda a: loss(x, w, a), b), FD_TOL, "dbias")


def test_per_head_bits_are_batch_invariant(rng):
    x = rng.standard_normal((6, 3, 32)).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal((3, 32))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y, rstd = pn.rms_norm(x, w, return_rstd=True)
    dx, dw, _ = pn.rms_norm_backward(dy, x, w, rstd=rstd)
    for t in (0, 4):
        for j in range(3):
            # a token's head row alone, with its weight row: the same bits
            np.testing.assert_array_equal(y[t, j], pn.rms_norm(x[t:t + 1, j], w[j])[0])
    # dweight's bits depend only on the token order: each head summed on its own
    for j in range(3):
        np.testing.assert_array_equal(dw[j], pn.rms_norm_backward(dy[:, j], x[:, j], w[j])[1])
    # the same tokens as (2, 3) batch axes: the same bits throughout
    y4 = pn.rms_norm(x.reshape(2, 3, 3, 32), w)
    dw4 = pn.rms_norm_backward(dy.reshape(2, 3, 3, 32), x.reshape(2, 3, 3, 32), w)[1]
    np.testing.assert_array_equal(y4.reshape(y.shape), y)
    np.testing.assert_array_equal(dw4, dw)


def test_per_head_in_place_and_out(rng):
    x = rng.standard_normal((4, 3, 16)).astype(np.float32)
    r = rng.standard_normal(x.shape).astype(np.float32)
    w = rng.standard_normal((3, 16)).astype(np.float32)
    y, h = pn.add_rms_norm(x, r, w)
    xi, ri = x.copy(), r.copy()
    pn.add_rms_norm_(xi, ri, w)
    np.testing.assert_array_equal(xi, y)
    np.testing.assert_array_equal(ri, h)
    out = np.empty_like(x)
    assert pn.rms_norm(x, w, out=out) is out
    np.testing.assert_array_equal(out, pn.rms_norm(x, w))


def test_per_head_weights_that_do_not_fit_are_named(rng):
    x = np.ones((4, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\).*per-head.*got \(2, 8\)"):
        pn.rms_norm(x, np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match=r"weight of shape \(4, 3\).*normalized axes last"):
        pn.rms_norm(x, np.ones((4, 3), np.float32), axis=1)
    with pytest.raises(ValueError, match=r"bias must have the shape of weight \(\(3, 8\)\)"):
        pn.rms_norm(x, np.ones((3, 8), np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        pn.rms_norm_backward(x, x, np.ones((5, 3, 8), np.float32))


def test_per_head_torch_autograd_and_compile(rng):
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x = torch.from_numpy(rng.standard_normal((3, 2, 4))).requires_grad_()
    w = torch.from_numpy(1 + 0.5 * rng.standard_normal((2, 4))).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: pt.rms_norm(a, b, eps=EPS), (x, w))
    f = torch.compile(lambda a, b: pt.rms_norm(a, b, eps=EPS), fullgraph=True,
                      backend="aot_eager")
    assert torch.equal(f(x.detach(), w.detach()), pt.rms_norm(x.detach(), w.detach(), eps=EPS))


def test_per_head_jax_grad(rng):
    jax = pytest.importorskip("jax")
    import polynorm.jax as pj

    jax.config.update("jax_enable_x64", True)
    x = rng.standard_normal((3, 2, 4))
    w = 1 + 0.5 * rng.standard_normal((2, 4))
    G = rng.standard_normal(x.shape)

    def loss(a, b):
        return (pj.rms_norm(a, b, eps=EPS) * G).sum()

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    dx, dw, _ = pn.rms_norm_backward(G, x, w, eps=EPS)
    assert_close(np.asarray(gx), dx, "float64", "dx")
    assert_close(np.asarray(gw), dw, "float64", "dweight")
