"""``polynorm.jax.distributed.rms_norm``: the hidden axis split over a mesh axis under
``jax.shard_map``, on the two CPU devices tests/conftest.py configures.  Expected
values: the RMSNorm formula in jnp on the whole array, and its jax.grad."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from polynorm.jax.distributed import rms_norm  # noqa: E402

EPS = 0.05


def _formula(x, w, b):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w + b


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 jax devices (tests/conftest.py sets XLA_FLAGS before jax starts)")
    return jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))


def test_split_forward_and_gradient_match_the_unsplit_formula(mesh):
    rng = np.random.default_rng(0)
    x, g = (jnp.asarray(rng.standard_normal((2, 3, 12)), jnp.float32) for _ in range(2))
    w, b = (jnp.asarray(rng.standard_normal(12), jnp.float32) for _ in range(2))
    split = jax.jit(jax.shard_map(
        lambda x, w, b: rms_norm(x, w, b, axis_name="tp", eps=EPS), mesh=mesh,
        in_specs=(P(None, None, "tp"), P("tp"), P("tp")), out_specs=P(None, None, "tp")))
    y = split(x, w, b)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(y, _formula(x, w, b), rtol=2e-6, atol=2e-6)

    def loss(fn):
        return lambda x, w, b: jnp.sum(fn(x, w, b) * g)

    got = jax.grad(loss(split), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(_formula), argnums=(0, 1, 2))(x, w, b)
    for name, a, e in zip(("dx", "dweight", "dbias"), got, want, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=name)


def test_uneven_d_total_and_bad_axis(mesh):
    x = jnp.ones((2, 4), jnp.float32)
    f = jax.jit(jax.shard_map(lambda x: rms_norm(x, axis_name="tp", d_total=16, eps=0.0),
                              mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp")))
    # 4 ones of a row of 16 whose other 12 elements are zero: rms = 1/2
    np.testing.assert_allclose(f(x), np.full((2, 4), 2.0), rtol=1e-6)
    with pytest.raises(ValueError, match="axis"):
        jax.jit(jax.shard_map(lambda x: rms_norm(x, axis_name="tp", axis=3), mesh=mesh,
                              in_specs=P(None, "tp"), out_specs=P(None, "tp")))(x)
