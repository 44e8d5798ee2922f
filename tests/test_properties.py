"""Property tests (hypothesis) of the operation's invariants, on every backend case.

Float64 throughout, so each property holds to ~1e-13 and a violation is
not hidden by rounding.  The ``@given`` functions are built inside each test
so that the number of examples can follow the backend: a call costs ~0.1 ms
on numpy and tens of ms on dask or a fresh jax shape.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import polynorm as pn

#: examples per property; slower array libraries get fewer.
EXAMPLES = {"dask": 10, "jax": 10}
DEFAULT_EXAMPLES = 40
TIGHT = dict(rtol=1e-13, atol=1e-13)


def _settings(case):
    return settings(
        max_examples=EXAMPLES.get(case.name, DEFAULT_EXAMPLES),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        derandomize=True,  # reproducible in CI; hypothesis still shrinks on failure
        database=None,
    )


@st.composite
def token_rows(draw, min_d=1, max_d=9):
    """(n, d) float64 with every token's first element bounded away from 0 (eps=0 is used)."""
    n = draw(st.integers(1, 4))
    d = draw(st.integers(min_d, max_d))
    elems = st.floats(-100, 100, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    x = draw(hnp.arrays(np.float64, (n, d), elements=elems))
    x[:, 0] = np.where(np.abs(x[:, 0]) < 1e-2, 1.0, x[:, 0])
    return x


def _partial_for(d, p):
    return p if int(d * p) >= 1 else 1.0


partials = st.sampled_from([1.0, 0.5, 0.3])
eps_modes = st.sampled_from(["inside", "outside"])


def _y(case, x, w=None, b=None, **kw):
    return case.to_numpy(pn.rms_norm(case.asarray(x), None if w is None else case.asarray(w),
                                      None if b is None else case.asarray(b),
                                      backend=case.backend, **kw))


def test_scale_invariance(case):
    """eps = 0: rms_norm(c * x) == rms_norm(x) for every c > 0."""

    @given(token_rows(), st.floats(1e-3, 1e3), partials, eps_modes, st.data())
    def check(x, c, p, mode, data):
        d = x.shape[1]
        w = data.draw(hnp.arrays(np.float64, d, elements=st.floats(-3, 3)))
        b = data.draw(hnp.arrays(np.float64, d, elements=st.floats(-3, 3)))
        kw = dict(eps=0.0, partial=_partial_for(d, p), eps_mode=mode)
        np.testing.assert_allclose(_y(case, c * x, w, b, **kw), _y(case, x, w, b, **kw), **TIGHT)

    _settings(case)(check)()


def test_sign_flip(case):
    """eps = 0, no bias: rms_norm(c * x) == -rms_norm(x) for every c < 0."""

    @given(token_rows(), st.floats(-1e3, -1e-3), partials, st.data())
    def check(x, c, p, data):
        d = x.shape[1]
        w = data.draw(hnp.arrays(np.float64, d, elements=st.floats(-3, 3)))
        kw = dict(eps=0.0, partial=_partial_for(d, p), offset=0.5)
        np.testing.assert_allclose(_y(case, c * x, w, **kw), -_y(case, x, w, **kw), **TIGHT)

    _settings(case)(check)()


def test_additive_shift_changes_the_output(case):
    """No centering: unlike LayerNorm, rms_norm(x + s) != rms_norm(x) for a non-constant token."""

    @given(token_rows(min_d=2), st.floats(0.5, 10), st.booleans())
    def check(x, s, negative):
        s = -s if negative else s
        scale = np.max(np.abs(x), axis=1)
        assume(np.all(np.ptp(x, axis=1) > 1e-3 * scale))  # no token is parallel to (1, ..., 1)
        y0, y1 = _y(case, x), _y(case, x + s)
        per_token = np.max(np.abs(y1 - y0), axis=1)
        assert np.all(per_token > 1e-10), per_token
        # while subtracting the mean first (LayerNorm) would have made them equal
        xc = x - x.mean(axis=1, keepdims=True)
        np.testing.assert_allclose(_y(case, xc), _y(case, (x + s) - (x + s).mean(axis=1, keepdims=True)),
                                   rtol=1e-9, atol=1e-9)

    _settings(case)(check)()


def test_tokens_are_independent(case):
    """Permuting tokens permutes the outputs (and rstd, and dx); no token sees another."""

    @given(token_rows(), partials, eps_modes, st.randoms(use_true_random=False))
    def check(x, p, mode, rnd):
        n, d = x.shape
        perm = list(range(n))
        rnd.shuffle(perm)
        kw = dict(eps=1e-3, partial=_partial_for(d, p), eps_mode=mode, backend=case.backend)
        A = case.asarray
        y, r = pn.rms_norm(A(x), return_rstd=True, **kw)
        yp, rp = pn.rms_norm(A(x[perm]), return_rstd=True, **kw)
        np.testing.assert_allclose(case.to_numpy(yp), case.to_numpy(y)[perm], **TIGHT)
        np.testing.assert_allclose(case.to_numpy(rp), case.to_numpy(r)[perm], **TIGHT)
        dy = np.cos(np.arange(n * d, dtype=np.float64)).reshape(n, d)
        dx = case.to_numpy(pn.rms_norm_backward(A(dy), A(x), **kw)[0])
        dxp = case.to_numpy(pn.rms_norm_backward(A(dy[perm]), A(x[perm]), **kw)[0])
        np.testing.assert_allclose(dxp, dx[perm], **TIGHT)
        # a symmetric cross-token statistic would survive a permutation: also change one
        # token and normalize each token alone -- the others must not notice
        x2 = x.copy()
        x2[0] = 3.0 * x2[0][::-1] + 1.0
        y2 = case.to_numpy(pn.rms_norm(A(x2), **kw))
        np.testing.assert_allclose(y2[1:], case.to_numpy(y)[1:], **TIGHT)
        alone = np.concatenate([case.to_numpy(pn.rms_norm(A(x[t : t + 1]), **kw)) for t in range(n)])
        np.testing.assert_allclose(alone, case.to_numpy(y), **TIGHT)

    _settings(case)(check)()


def test_all_zero_slice_stays_zero(case):
    """eps > 0: zero tokens give exactly 0 (times weight), plus bias; the others are finite."""

    @given(token_rows(), st.floats(1e-8, 1.0), partials, eps_modes, st.data())
    def check(x, eps, p, mode, data):
        n, d = x.shape
        zero = data.draw(hnp.arrays(np.bool_, n))
        x = np.where(zero[:, None], 0.0, x)
        w = data.draw(hnp.arrays(np.float64, d, elements=st.floats(-3, 3)))
        b = data.draw(hnp.arrays(np.float64, d, elements=st.floats(-3, 3)))
        kw = dict(eps=eps, partial=_partial_for(d, p), eps_mode=mode)
        y = _y(case, x, w, **kw)
        np.testing.assert_array_equal(y[zero], 0.0)
        assert np.all(np.isfinite(y))
        np.testing.assert_array_equal(_y(case, x, w, b, **kw)[zero], np.broadcast_to(b, (int(zero.sum()), d)))

    _settings(case)(check)()


def test_inputs_never_modified(case):
    """Forward, fused add and backward leave every input array as it was."""

    @given(token_rows(), partials, eps_modes, st.sampled_from(["fp32", "llama"]), st.data())
    def check(x, p, mode, casting, data):
        n, d = x.shape
        other = hnp.arrays(np.float64, (n, d), elements=st.floats(-10, 10))
        vec = hnp.arrays(np.float64, d, elements=st.floats(-3, 3))
        arrays = dict(x=x, residual=data.draw(other), dy=data.draw(other),
                      grad_residual=data.draw(other), weight=data.draw(vec), bias=data.draw(vec))
        a = {k: case.asarray(v) for k, v in arrays.items()}
        kw = dict(partial=_partial_for(d, p), eps_mode=mode, casting=casting, backend=case.backend)
        _, _, rstd = pn.add_rms_norm(a["x"], a["residual"], a["weight"], a["bias"],
                                     return_rstd=True, **kw)
        pn.rms_norm(a["x"], a["weight"], a["bias"], **kw)
        pn.rms_norm_backward(a["dy"], a["x"], a["weight"], a["bias"], rstd=rstd,
                             grad_residual=a["grad_residual"], **kw)
        for k, v in arrays.items():
            np.testing.assert_array_equal(case.to_numpy(a[k]), v, err_msg=f"{k} was modified")

    _settings(case)(check)()
