"""A first check that every backend case runs and agrees with a float64 formula."""

import numpy as np

import polynorm as pn


def test_forward_matches_float64_formula(case, rng):
    x = rng.standard_normal((5, 7))
    w = rng.standard_normal(7)
    y = case.to_numpy(pn.rms_norm(case.asarray(x), case.asarray(w), backend=case.backend))
    want = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
