"""``casting="none"``: Liger-Kernel's ``casting_mode="none"`` (``_CASTING_MODE_NONE``).

Liger's forward kernel (``src/liger_kernel/ops/rms_norm.py``,
``_rms_norm_forward_kernel``) in this mode keeps ``X_row`` in its dtype ``T``,
casts ``eps`` and ``offset`` to ``T`` and computes::

    mean_square = tl.sum(X_row * X_row) / n_cols
    rstd        = rsqrt(mean_square + eps)          # stored in T (RSTD has X's dtype)
    Y_row       = (X_row * rstd) * (offset + W_row)

every operation on ``T`` values giving a ``T`` value.  Its own tests
(``test/transformers/test_rms_norm.py``) hold it against ``BaseRMSNorm``, the
torch reference transcribed in :func:`liger_base_rms_norm` below, at a tolerance.
For bfloat16 and float16 polynorm gives the bits of the kernel's steps
(:func:`liger_kernel_formula`: every step rounded to ``T``, the division by
``n_cols`` as the kernel does it) exactly, and BaseRMSNorm's within a ``T`` ulp
(its ``mean`` multiplies by ``1/n``: where that rounds the mean apart from the
kernel's division, a row moves by an ulp).  Where polynorm's and Liger's
kernels cannot agree bit for bit: the sum of the squares is accumulated in
float32 (as torch's mean of ``T`` values does), where Triton's ``tl.sum`` adds
``T`` values in its own tree; for float32 input that order shows in the last
bit, so float32 is held within a few ulps.

Liger's backward kernel in this mode (``_rms_norm_backward_kernel``) loads ``X``
and the stored ``rstd`` and works in float32::

    m  = dY * (W + offset)
    dX = rstd * m - rstd * (1 / n) * rstd * rstd * sum(m * X) * X
    dW = sum over rows of dY * (X * rstd)

transcribed in :func:`liger_backward` (numpy, float64 from the same inputs).
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracle import NP_DTYPES, TOL, Tol, assert_close

import polynorm as pn

EPS = 1e-6


def liger_base_rms_norm(x, w):
    """Liger's ``BaseRMSNorm.forward`` (its reference for casting_mode "none"), in torch."""
    torch = pytest.importorskip("torch")
    input_dtype = x.dtype
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + EPS)
    return w * x.to(input_dtype), torch.rsqrt(variance + EPS)[..., 0]


def liger_kernel_formula(x, w, offset=0.0):
    """The Triton kernel's steps in numpy, each rounded to ``T`` (the sum in float32)."""
    t = x.dtype

    def r(a):
        return np.asarray(a, dtype=np.float32).astype(t).astype(np.float32)

    xf = x.astype(np.float32)
    ms = r(r(xf * xf).sum(axis=1, dtype=np.float32) / np.float32(x.shape[1]))
    rstd = r(np.float32(1) / np.sqrt(r(ms + r(np.float32(EPS)))))
    y = r(r(xf * rstd[:, None]) * r(w.astype(np.float32) + r(np.float32(offset))))
    return y.astype(t), rstd


def liger_backward(dy, x, w, rstd, offset=0.0):
    """Liger's ``_rms_norm_backward_kernel`` for casting_mode "none" (float64 here)."""
    dy, x, rstd = (a.astype(np.float64) for a in (dy, x, rstd))
    m = dy * (w.astype(np.float64) + offset)
    rs = rstd[:, None]
    dx = rs * m - rs * (1 / x.shape[1]) * rs * rs * np.sum(m * x, axis=1, keepdims=True) * x
    return dx, np.sum(dy * (x * rs), axis=0)


def _data(rng, n, d, dtype):
    dt = NP_DTYPES[dtype]
    x = rng.standard_normal((n, d)).astype(dt)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(dt)
    dy = rng.standard_normal((n, d)).astype(dt)
    return x, w, dy


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_none_has_ligers_bits_in_16_bit(case, dtype, rng):
    """Every backend case gives the bits of Liger's torch reference and of its kernel's steps."""
    torch = pytest.importorskip("torch")
    case.skip_unless_dtype(dtype)
    x, w, _ = _data(rng, 6, 96, dtype)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    want, want_r = liger_base_rms_norm(torch.tensor(x.astype(np.float32)).to(tdt),
                                       torch.tensor(w.astype(np.float32)).to(tdt))
    want = want.float().numpy().astype(NP_DTYPES[dtype])
    y, rstd = pn.rms_norm(case.asarray(x), case.asarray(w), eps=EPS, casting="none",
                          return_rstd=True, backend=case.backend)
    y = case.to_numpy(y)
    assert y.dtype == NP_DTYPES[dtype]
    kernel_y, kernel_r = liger_kernel_formula(x, w)
    np.testing.assert_array_equal(_bits(y), _bits(kernel_y))
    # rstd: a T value (Liger stores it in T), returned in float32
    r = case.to_numpy(rstd)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r, kernel_r)
    # BaseRMSNorm's mean multiplies by 1/n where the kernel divides by n: where the two
    # round the mean apart (rarely), rstd and that row's y are one T ulp apart
    assert_close(y, want, dtype, "y against BaseRMSNorm")
    assert_close(r, want_r.float().numpy(), dtype, "rstd against BaseRMSNorm")


def test_none_float32_within_ulps_of_liger(case, rng):
    torch = pytest.importorskip("torch")
    case.skip_unless_dtype("float32")
    x, w, _ = _data(rng, 6, 96, "float32")
    want, _ = liger_base_rms_norm(torch.tensor(x), torch.tensor(w))
    y = case.to_numpy(pn.rms_norm(case.asarray(x), case.asarray(w), eps=EPS, casting="none",
                                  backend=case.backend))
    assert_close(y, want.numpy(), Tol(4e-7, 4e-7), "y")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_none_backward_is_ligers(case, dtype, rng):
    """dx/dweight against Liger's backward kernel formula with the stored (T-rounded) rstd,
    whether rstd is passed or recomputed."""
    case.skip_unless_dtype(dtype)
    x, w, dy = _data(rng, 5, 64, dtype)
    offset = 1.0 if dtype == "float16" else 0.0
    A = case.asarray
    _, rstd = pn.rms_norm(A(x), A(w), eps=EPS, casting="none", offset=offset, return_rstd=True,
                          backend=case.backend)
    want_r = liger_kernel_formula(x, w, offset)[1]
    got_r = case.to_numpy(rstd)
    if dtype == "float32":  # the sum's order shows in float32's last bit
        assert_close(got_r, want_r, Tol(4e-7, 4e-7), "rstd")
    else:
        np.testing.assert_array_equal(got_r, want_r)
    wdx, wdw = liger_backward(dy, x, w, got_r, offset)
    tol = TOL[dtype]
    for passed in (rstd, None):
        dx, dw, _ = pn.rms_norm_backward(A(dy), A(x), A(w), rstd=passed, eps=EPS, casting="none",
                                         offset=offset, backend=case.backend)
        assert case.to_numpy(dx).dtype == NP_DTYPES[dtype]
        assert_close(case.to_numpy(dx), wdx, Tol(tol.rtol * 2, tol.atol * 2, tol.floor), "dx")
        assert_close(case.to_numpy(dw), wdw, Tol(tol.rtol * 8, tol.atol * 8, tol.floor), "dw")


def test_none_differs_from_fp32_in_16_bit(rng):
    """The mode is not the default's arithmetic: bfloat16 results differ somewhere."""
    x, w, _ = _data(rng, 8, 256, "bfloat16")
    assert not np.array_equal(_bits(pn.rms_norm(x, w, casting="none")),
                              _bits(pn.rms_norm(x, w)))


def test_none_without_weight_with_bias_and_partial(rng):
    """No weight: y = xhat; a bias is added in its promoted dtype; partial: the mean of
    the first k squares."""
    x, w, _ = _data(rng, 4, 32, "bfloat16")
    b = (0.1 * rng.standard_normal(32)).astype(np.float32)
    ones = np.ones(32, NP_DTYPES["bfloat16"])
    y = pn.rms_norm(x, eps=EPS, casting="none")
    np.testing.assert_array_equal(_bits(y), _bits(liger_kernel_formula(x, ones)[0]))
    yb = pn.rms_norm(x, None, b, eps=EPS, casting="none", out_dtype="float32")
    # the sum in promote(bfloat16, float32): float32, exact here
    np.testing.assert_array_equal(yb, y.astype(np.float32) + b)
    yp = pn.rms_norm(x, eps=EPS, casting="none", partial=0.5)
    xf = x.astype(np.float32)
    ms = (xf[:, :16] ** 2).astype(x.dtype).astype(np.float32).sum(1, dtype=np.float32) / 16
    r = (1 / np.sqrt((ms.astype(x.dtype).astype(np.float32) + np.float32(EPS))
                     .astype(x.dtype).astype(np.float32))).astype(x.dtype).astype(np.float32)
    np.testing.assert_array_equal(_bits(yp), _bits((xf * r[:, None]).astype(x.dtype)))


def test_none_torch_autograd_bfloat16(rng):
    torch = pytest.importorskip("torch")
    import polynorm.torch as pt

    x, w, dy = _data(rng, 4, 64, "bfloat16")
    xt = torch.tensor(x.astype(np.float32)).to(torch.bfloat16).requires_grad_(True)
    wt = torch.tensor(w.astype(np.float32)).to(torch.bfloat16).requires_grad_(True)
    y = pt.rms_norm(xt, wt, eps=EPS, casting="none")
    np.testing.assert_array_equal(_bits(y.detach().view(torch.int16).numpy()),
                                  _bits(liger_kernel_formula(x, w)[0].view(np.int16)))
    y.backward(torch.tensor(dy.astype(np.float32)).to(torch.bfloat16))
    wdx, wdw = liger_backward(dy, x, w, liger_kernel_formula(x, w)[1])
    assert_close(xt.grad.float().numpy(), wdx, Tol(2 * TOL["bfloat16"].rtol,
                                                   2 * TOL["bfloat16"].atol), "dx")
    assert_close(wt.grad.float().numpy(), wdw, Tol(8 * TOL["bfloat16"].rtol,
                                                   8 * TOL["bfloat16"].atol), "dw")


def test_none_errors():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="norm_input='sum' with casting='none'"):
        pn.add_rms_norm(x, x, casting="none", norm_input="sum")
    with pytest.raises(ValueError, match="'none'"):
        pn.rms_norm(x, casting="nope")
    # no peer gates or quantizes in this mode; the kernels would ignore it
    with pytest.raises(ValueError, match="casting='none' is not available for rms_norm_gated"):
        pn.rms_norm_gated(x, x, casting="none")
    with pytest.raises(ValueError, match="casting='none' is not available for rms_norm_quant"):
        pn.rms_norm_quant(x, dtype="int8", casting="none")
