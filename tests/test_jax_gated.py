"""polynorm.jax.rms_norm_gated: jax.grad against polynorm.rms_norm_gated_backward, eager and jit."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import polynorm as pn  # noqa: E402
import polynorm.jax as pj  # noqa: E402


@pytest.mark.parametrize("nbg", [False, True])
def test_grad_matches_backward_eager_and_jit(nbg):
    rng = np.random.default_rng(0)
    x, z, dy = (rng.standard_normal((3, 8)) for _ in range(3))
    w = 1 + 0.3 * rng.standard_normal(8)
    kw = dict(group_size=4, norm_before_gate=nbg, eps=0.05)

    def loss(a, b, c):
        return jnp.sum(pj.rms_norm_gated(a, b, c, **kw) * dy)

    want = pn.rms_norm_gated_backward(dy, x, z, w, **kw)[:3]
    for f in (jax.grad(loss, argnums=(0, 1, 2)), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        got = f(jnp.asarray(x), jnp.asarray(z), jnp.asarray(w))
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), e, rtol=1e-12, atol=1e-12)
    y = jax.jit(lambda a, b, c: pj.rms_norm_gated(a, b, c, **kw))(x, z, w)
    np.testing.assert_allclose(np.asarray(y), pn.rms_norm_gated(x, z, w, **kw), rtol=1e-12)
