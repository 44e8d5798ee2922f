"""Finite-difference check of ``rms_norm_backward`` on every backend case.

For a fixed random ``G`` the scalar loss is ``L = sum(y * G)`` (plus
``sum(h * Gh)`` for ``add_rms_norm``, whose gradient reaches ``h`` through
the residual stream and enters the backward as ``grad_residual``).  Float64
central differences of ``L`` through the backend's own forward are compared
with the backend's ``rms_norm_backward`` for ``dx`` (and ``dresidual``,
which must equal ``dx``), ``dweight`` and ``dbias``; once recomputing rstd
and once passing the forward's ``rstd``.

Step and tolerance: ``(L(x+h) - L(x-h)) / 2h`` has a truncation error
``h**2/6 * |L'''|`` (~1e-12 * O(10) for these O(1) inputs) and a rounding
error ``~ eps64 * |L| / h`` (2.2e-16 * O(10) / 1e-6 ~ 2e-9).  ``h = 1e-6``
balances the two; ``rtol = atol = 1e-6`` (atol relative to the largest
gradient) leaves a factor ~500 of headroom and still catches any formula
error, which is O(eps) = O(5e-2) or larger here (eps is chosen that large so
that eps inside/outside is told apart).

To keep this fast on backends where a call costs milliseconds (dask), the
``2 d`` perturbations of ``x`` are stacked along a new leading axis and done
in one call (tokens are independent, so perturbing position ``p`` of every
token at once still gives each token's partial derivative), and ``weight``
and ``bias`` are checked along three random directions (``L`` is linear in
both, so a directional difference is exact up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from _oracle import Tol, assert_close, batch_shape, from_rows, to_rows

import polynorm as pn

H = 1e-6
EPS = 0.05
FD_TOL = Tol(1e-6, 1e-6)
N_DIRECTIONS = 3


@dataclass(frozen=True)
class Cfg:
    id: str
    shape: tuple[int, ...] = (3, 5)
    axis: int | tuple[int, ...] = -1
    weight: bool = False
    bias: bool = False
    add: bool = False
    options: dict = field(default_factory=dict)

    def kw(self) -> dict:
        return dict(eps=EPS, axis=self.axis, **self.options)


CONFIGS = [
    Cfg("plain"),
    Cfg("weight", weight=True),
    Cfg("weight-bias", weight=True, bias=True),
    Cfg("partial-0.5", shape=(3, 6), weight=True, options=dict(partial=0.5)),
    Cfg("partial-0.3-odd-d", shape=(3, 7), weight=True, bias=True, options=dict(partial=0.3)),
    Cfg("partial-no-weight", shape=(2, 7), options=dict(partial=0.3)),
    Cfg("offset", weight=True, options=dict(offset=1.0)),
    Cfg("offset-without-weight", options=dict(offset=1.0)),  # no weight: no scale, offset unused
    Cfg("outside", weight=True, options=dict(eps_mode="outside")),
    Cfg("outside-partial-offset-bias", shape=(2, 7), weight=True, bias=True,
        options=dict(eps_mode="outside", partial=0.3, offset=1.0)),
    Cfg("llama", weight=True, bias=True, options=dict(casting="llama")),
    Cfg("add-grad_residual", weight=True, bias=True, add=True),
    Cfg("add-outside-partial", shape=(2, 6), weight=True, add=True,
        options=dict(eps_mode="outside", partial=0.5)),
    Cfg("tuple-axis", shape=(3, 2, 4), axis=(0, 2), weight=True, bias=True,
        options=dict(partial=0.5)),
    Cfg("non-last-axis", shape=(5, 3), axis=0, weight=True, options=dict(offset=1.0)),
    Cfg("d=1", shape=(4, 1), weight=True, bias=True),
    Cfg("d=1-outside", shape=(4, 1), weight=True, options=dict(eps_mode="outside")),
    Cfg("3-D", shape=(2, 3, 5), weight=True, bias=True),
    Cfg("3-D-trailing-tuple", shape=(2, 3, 4), axis=(-2, -1), weight=True, add=True),
    # Mamba's grouped RMSNormGated without a gate: one statistic per group
    Cfg("grouped", shape=(3, 6), weight=True, bias=True, options=dict(group_size=2)),
    Cfg("grouped-add-outside-offset", shape=(2, 8), weight=True, add=True,
        options=dict(group_size=4, eps_mode="outside", offset=1.0)),
    # Liger's casting_mode "none": in float64 every rounding of the mode is exact
    Cfg("casting-none-outside-bias", weight=True, bias=True,
        options=dict(casting="none", eps_mode="outside", offset=1.0)),
]


def _norm_shape(shape, axis) -> tuple[int, ...]:
    axes = sorted(a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,)))
    return tuple(shape[a] for a in axes)


def _shift_axis(axis):
    """The same axes after a new leading axis is inserted."""
    if isinstance(axis, tuple):
        return tuple(_shift_axis(a) for a in axis)
    return axis + 1 if axis >= 0 else axis


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_backward_matches_central_differences(case, cfg, rng):
    shape, axis, kw = cfg.shape, cfg.axis, cfg.kw()
    nshape = _norm_shape(shape, axis)
    x = rng.standard_normal(shape)
    w = 1.0 + 0.5 * rng.standard_normal(nshape) if cfg.weight else None
    b = rng.standard_normal(nshape) if cfg.bias else None
    res = rng.standard_normal(shape) if cfg.add else None
    G = rng.standard_normal(shape)
    Gh = rng.standard_normal(shape) if cfg.add else None
    A = case.asarray

    def run(xv, resv, wv, bv, axis_):
        """(y, h) as numpy for numpy inputs; h is None without residual."""
        wa = None if wv is None else A(wv)
        ba = None if bv is None else A(bv)
        kw_ = dict(kw, axis=axis_, backend=case.backend)
        if resv is None:
            return case.to_numpy(pn.rms_norm(A(xv), wa, ba, **kw_)), None
        y, h = pn.add_rms_norm(A(xv), A(resv), wa, ba, **kw_)
        return case.to_numpy(y), case.to_numpy(h)

    def token_losses(y, h, axis_):
        """Per-token loss, shape (tokens,) -- or (P, tokens) for a stacked batch."""
        term = y * G + (0.0 if h is None else h * Gh)
        if term.ndim == len(shape):
            return to_rows(term, axis_).sum(axis=1)
        return np.stack([to_rows(t, axis).sum(axis=1) for t in term])

    def total_loss(wv, bv):
        y, h = run(x, res, wv, bv, axis)
        return float(np.sum(token_losses(y, h, axis)))

    # -- the analytic gradient, with and without the forward's rstd
    if cfg.add:
        y0, h0, rstd = pn.add_rms_norm(
            A(x), A(res), None if w is None else A(w), None if b is None else A(b),
            return_rstd=True, backend=case.backend, **kw,
        )
        xin = h0
    else:
        y0, rstd = pn.rms_norm(
            A(x), None if w is None else A(w), None if b is None else A(b),
            return_rstd=True, backend=case.backend, **kw,
        )
        xin = A(x)
    groups = kw.get("group_size") and int(np.prod(nshape)) // kw["group_size"]
    assert tuple(rstd.shape) == batch_shape(shape, axis) + ((groups,) if groups else ())
    grads = {}
    for passed in (False, True):
        grads[passed] = pn.rms_norm_backward(
            A(G), xin, None if w is None else A(w), None if b is None else A(b),
            rstd=rstd if passed else None, grad_residual=None if Gh is None else A(Gh),
            backend=case.backend, **kw,
        )

    # -- central differences for x (and residual): 2*d perturbations in one stacked call
    n_tok, d = to_rows(x, axis).shape
    stacked_axis = _shift_axis(axis)
    eye = np.zeros((2 * d, n_tok, d))
    for p in range(d):
        eye[2 * p, :, p] = H
        eye[2 * p + 1, :, p] = -H
    pert = np.stack([from_rows(e, shape, axis) for e in eye])
    fd = {}
    for name in ("x", "residual") if cfg.add else ("x",):
        xs = x + pert if name == "x" else np.broadcast_to(x, pert.shape).copy()
        rs = None
        if cfg.add:
            rs = res + pert if name == "residual" else np.broadcast_to(res, pert.shape).copy()
        y, h = run(xs, rs, w, b, stacked_axis)
        lt = token_losses(y, h, stacked_axis)  # (2d, tokens)
        rows = ((lt[0::2] - lt[1::2]) / (2 * H)).T  # (tokens, d)
        fd[name] = from_rows(rows, shape, axis)

    # -- directional differences for weight and bias
    def directional(which):
        out = []
        for _ in range(N_DIRECTIONS):
            u = rng.standard_normal(nshape)
            if which == "weight":
                lp, lm = total_loss(w + H * u, b), total_loss(w - H * u, b)
            else:
                lp, lm = total_loss(w, b + H * u), total_loss(w, b - H * u)
            out.append((u, (lp - lm) / (2 * H)))
        return out

    dir_w = directional("weight") if cfg.weight else None
    dir_b = directional("bias") if cfg.bias else None

    for passed, (dx, dw, db) in grads.items():
        tag = f"{cfg.id}, rstd {'passed' if passed else 'recomputed'}"
        dx = case.to_numpy(dx)
        assert dx.shape == shape
        for name, want in fd.items():
            assert_close(dx, want, FD_TOL, f"d{name} ({tag})")
        assert (dw is None) == (w is None) and (db is None) == (b is None), tag
        for grad, dirs, name in ((dw, dir_w, "dweight"), (db, dir_b, "dbias")):
            if grad is None:
                continue
            grad = case.to_numpy(grad)
            assert grad.shape == nshape, f"{name} shape ({tag})"
            got = np.array([np.sum(grad * u) for u, _ in dirs])
            want = np.array([fdv for _, fdv in dirs])
            assert_close(got, want, FD_TOL, f"{name} along random directions ({tag})")


@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5)], ids=str)
def test_backward_zero_tokens(case, add, shape, rng):
    """No tokens: L = 0 for every weight/bias, so dweight = dbias = 0; dx is empty."""
    A = case.asarray
    x = np.zeros(shape)
    w, b = rng.standard_normal(5), rng.standard_normal(5)
    kw = dict(eps=EPS, partial=0.5, backend=case.backend)
    if add:
        _, h, rstd = pn.add_rms_norm(A(x), A(x), A(w), A(b), return_rstd=True, **kw)
    else:
        _, rstd = pn.rms_norm(A(x), A(w), A(b), return_rstd=True, **kw)
        h = A(x)
    assert tuple(rstd.shape) == shape[:-1]
    for passed in (None, rstd):
        dx, dw, db = pn.rms_norm_backward(
            A(x), h, A(w), A(b), rstd=passed, grad_residual=A(x) if add else None, **kw
        )
        assert tuple(dx.shape) == shape
        np.testing.assert_array_equal(case.to_numpy(dw), np.zeros(5))
        np.testing.assert_array_equal(case.to_numpy(db), np.zeros(5))
